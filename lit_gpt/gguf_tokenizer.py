"""The tokenizer files of a GGUF checkpoint (`lit_gpt.gguf`): a byte-level BPE `tokenizer.json` or a sentencepiece
`tokenizer.model` rebuilt from the file's vocabulary, merges, scores and token types, and the
`tokenizer_config.json` beside it, so that the lit tokenizer and transformers encode as the model's own tokenizer."""

import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from lit_gpt.utils import LitError, error_reason

# GGUF token types (llama.cpp's `llama_token_type`, the same numbers as sentencepiece's piece types).
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_TOKEN_UNUSED = 5
_TOKEN_BYTE = 6
_SENTENCEPIECE_TYPES = (_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE)

# llama.cpp's `tokenizer.ggml.pre` names -> how the text is split before byte-level BPE. Each family's split
# is the one its original `tokenizer.json` uses, so ids match the upstream tokenizer.
_GPT2_FAMILY = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"}
_DIGITS_FAMILY = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# o200k (GPT-4o's vocabulary, Phi-4-mini's): words split at case changes, digits in runs of up to three
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_FAMILY = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral", "lfm2"}
_QWEN2_FAMILY = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"}
_GPT4O_FAMILY = {"gpt-4o", "llama4"}


def _pre_tokenizer(pre: Optional[str], add_prefix_space: bool) -> Tuple[Any, bool]:
    """The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name, and whether merges ignore whole-word hits."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre is None or pre in _GPT2_FAMILY:
        return byte_level, False
    if pre in _DIGITS_FAMILY:
        # llama.cpp splits every digit on its own before the GPT-2 regex, i.e. HF's `Digits(individual)`.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    splits = ((_LLAMA3_FAMILY, _LLAMA3_SPLIT), (_QWEN2_FAMILY, _QWEN2_SPLIT), (_GPT4O_FAMILY, _GPT4O_SPLIT))
    split = next((regex for family, regex in splits if pre in family), None)
    if split is not None:
        return (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
                ]
            ),
            # llama.cpp looks a whole pre-token up in the vocabulary before merging for Llama 3 vocabularies.
            pre in _LLAMA3_FAMILY,
        )
    warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}: splitting text like GPT-2, ids may differ from upstream")
    return byte_level, False


def tokenizer_files(
    meta: Dict[str, Any], gguf_path: Path, arch_name: str
) -> Tuple[str, Callable[[Path], Any], Dict[str, Any]]:
    """(tokenizer file name, a function writing it to a path, the `tokenizer_config.json` dict) from GGUF metadata:
    `tokenizer.json` for byte-level BPE ('gpt2') vocabularies, `tokenizer.model` for sentencepiece ('llama') ones."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise LitError(
            f"{str(gguf_path)!r} has a {kind!r} tokenizer; only byte-level BPE ('gpt2') and sentencepiece ('llama')"
            " GGUF tokenizers can be converted. Download the original checkpoint with: python scripts/download.py"
            " --repo_id ORG/NAME"
        )
    tokens: List[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise LitError(f"{str(gguf_path)!r} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    config: Dict[str, Any] = {"clean_up_tokenization_spaces": False}
    if kind == "gpt2":
        tokenizer, add_prefix_space = _byte_level_bpe(meta, tokens)
        name, write = "tokenizer.json", (lambda tmp: tokenizer.save(str(tmp)))
        # `PreTrainedTokenizerFast` makes transformers use tokenizer.json exactly as written (a model-specific
        # class would rebuild its own pre-tokenizer and could drop e.g. SmolLM2's digit splitting).
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        defaults: Dict[str, Any] = {}
    else:
        model, add_prefix_space = _sentencepiece_model(meta, tokens, gguf_path)
        name, write = "tokenizer.model", (lambda tmp: tmp.write_bytes(model))
        config["tokenizer_class"] = "GemmaTokenizer" if arch_name.startswith("gemma") else "LlamaTokenizer"
        # As Llama 2's and Phi-3's own tokenizer_config.json: the dummy prefix goes in front of the text only (none
        # after a special token, none when the text starts with a space), the way lit_gpt.tokenizer reads a
        # tokenizer.model; llama.cpp prefixes every text fragment. transformers reads it the same way then.
        config["legacy"] = False
        # llama.cpp's defaults for sentencepiece vocabularies when the file does not say
        defaults = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0, "add_bos_token": True}
    config["add_prefix_space"] = add_prefix_space
    config["model_max_length"] = meta.get(f"{arch_name}.context_length", 2048)
    for token_name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                            ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}", defaults.get(key))
        if token_id is not None and 0 <= token_id < len(tokens):
            config[token_name] = tokens[token_id]
    for flag in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{flag}", defaults.get(flag))
        if value is not None:
            config[flag] = bool(value)
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return name, write, config


def _byte_level_bpe(meta: Dict[str, Any], tokens: List[str]) -> Tuple[Any, bool]:
    """A `tokenizers.Tokenizer` (byte-level BPE) from the GGUF vocabulary and merges, and its add_prefix_space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    token_types: List[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    pre_tokenizer, ignore_merges = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), add_prefix_space)

    vocab: Dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # the first id wins if llama.cpp stored a duplicate spelling
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (e.g. <|im_start|>) must match whole in text and are special; user-defined ones match
    # whole but decode like text.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _TOKEN_CONTROL]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types)
            if k == _TOKEN_USER_DEFINED
        ]
    )
    return tokenizer, add_prefix_space


def _sentencepiece_model(meta: Dict[str, Any], tokens: List[str], gguf_path: Path) -> Tuple[bytes, bool]:
    """A serialized sentencepiece BPE model (`tokenizer.model`) from the pieces, scores and types llama.cpp copied
    out of the original one (GGUF token types are sentencepiece's piece types), and its add-dummy-prefix flag.
    Sentencepiece merges the adjacent pair whose merged piece scores highest, as llama.cpp's SPM tokenizer does."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    n = len(tokens)
    scores: List[float] = meta.get("tokenizer.ggml.scores") or [0.0] * n
    types: List[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * n
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default for SPM
    proto = pb.ModelProto()
    seen: Dict[str, int] = {}
    for index, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
        if kind not in _SENTENCEPIECE_TYPES:
            kind = _TOKEN_NORMAL
        if kind == _TOKEN_USER_DEFINED:
            piece = piece.replace(" ", "▁")  # llama.cpp writes the spaces of user-defined pieces as spaces
        if not piece or piece in seen:
            # sentencepiece needs unique pieces: the later id keeps its place but can never be produced
            warnings.warn(f"GGUF token {index} {piece!r} repeats token {seen.get(piece)}; it is renamed")
            piece, kind = f"<gguf_duplicate_{index}>", _TOKEN_UNUSED
        seen[piece] = index
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, float(score), kind
    unknown = [i for i, entry in enumerate(proto.pieces) if entry.type == _TOKEN_UNKNOWN]
    if len(unknown) != 1:
        raise LitError(f"{str(gguf_path)!r}: a sentencepiece vocabulary needs exactly one unknown token, it has"
                       f" {len(unknown)}")
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = n
    spec.byte_fallback = any(entry.type == _TOKEN_BYTE for entry in proto.pieces)
    # sentencepiece matches user-defined pieces whole by their type; transformers' converter reads this list
    spec.user_defined_symbols.extend(entry.piece for entry in proto.pieces if entry.type == _TOKEN_USER_DEFINED)
    spec.unk_id, spec.unk_piece = unknown[0], proto.pieces[unknown[0]].piece
    for attr, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}", {"bos": 1, "eos": 2}.get(attr, -1))
        if token_id is not None and 0 <= token_id < n and token_id != unknown[0]:
            setattr(spec, f"{attr}_id", token_id)
            setattr(spec, f"{attr}_piece", proto.pieces[token_id].piece)
        else:
            setattr(spec, f"{attr}_id", -1)
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = add_prefix_space
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    model = proto.SerializeToString()
    try:  # what sentencepiece itself refuses should be a one-line error here, not at the first encode
        import sentencepiece as spm

        spm.SentencePieceProcessor(model_proto=model)
    except (RuntimeError, OSError) as e:
        raise LitError(f"{str(gguf_path)!r}: its sentencepiece vocabulary is not usable ({error_reason(e)})") from e
    return model, add_prefix_space


# ---------------------------------------------------------------------------------------------------------------
# writing (each file goes to a temporary name first, so an interrupted run never leaves a half-written file)
# ---------------------------------------------------------------------------------------------------------------
