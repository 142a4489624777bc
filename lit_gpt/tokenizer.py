"""The checkpoint's tokenizer: `tokenizer.json` (HF `tokenizers`) or `tokenizer.model` (sentencepiece).

Special tokens follow transformers' rules so that ids match `AutoTokenizer.from_pretrained(checkpoint_dir)`:
- the BOS/EOS strings come from `tokenizer_config.json` (then `special_tokens_map.json`); the ids of
  `generation_config.json` / `config.json` are the fallback;
- whether `encode` prepends BOS: for `tokenizer.json`, what its post-processor does (Llama 2/3 and Gemma add
  BOS, SmolLM2/Qwen do not; transformers 5 ignores `add_bos_token` there); for `tokenizer.model`,
  `add_bos_token` from `tokenizer_config.json` (transformers 5 adds no BOS when it is missing);
- EOS is appended only on request (`eos=True`), whatever `add_eos_token` says: prompts must not end in EOS;
- `stop_ids` is every id that ends generation: the tokenizer's EOS plus `generation_config.json`'s
  `eos_token_id` (an int or a list, e.g. Llama 3's <|eot_id|>).
"""

import json
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Union

import torch

from lit_gpt.utils import LitError, download_command

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LitError(f"{str(path)!r} is not valid JSON ({e}). Download the checkpoint again") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> Optional[str]:
    """Special tokens are stored as a string or as a serialized `AddedToken` ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_map(checkpoint_dir: Union[str, Path]) -> Dict[str, str]:
    """The named special tokens (bos_token, eos_token, ...) as strings, like transformers' `special_tokens_map`.
    Chat templates see these as variables."""
    checkpoint_dir = Path(checkpoint_dir)
    tokens: Dict[str, str] = {}
    # tokenizer_config.json wins over the older special_tokens_map.json, as in transformers.
    for source in (_read_json(checkpoint_dir / "special_tokens_map.json"),
                   _read_json(checkpoint_dir / "tokenizer_config.json")):
        for name in SPECIAL_TOKEN_NAMES:
            if name in source:
                content = _token_content(source[name])
                if content is None:
                    tokens.pop(name, None)
                else:
                    tokens[name] = content
    return tokens


def _as_id_list(value: Any) -> List[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    def __init__(self, checkpoint_dir: Union[str, Path]) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.is_dir():
            raise LitError(
                f"checkpoint directory {str(checkpoint_dir)!r} does not exist. Download a model first:"
                f" {download_command(checkpoint_dir)} (offline: python scripts/convert_gguf_checkpoint.py)"
            )
        self.checkpoint_dir = checkpoint_dir
        self.config = _read_json(checkpoint_dir / "tokenizer_config.json")
        generation_config = _read_json(checkpoint_dir / "generation_config.json")
        model_config = _read_json(checkpoint_dir / "config.json")
        self.special_tokens = special_tokens_map(checkpoint_dir)

        if (checkpoint_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self.backend = "huggingface"
            try:
                self.processor = HFTokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
            except Exception as e:  # the Rust side raises a bare `Exception` for unreadable files
                raise LitError(f"cannot load {str(checkpoint_dir / 'tokenizer.json')!r} ({e})") from e
        elif (checkpoint_dir / "tokenizer.model").is_file():
            self.backend = "sentencepiece"
            self._sp = _SentencePiece(checkpoint_dir / "tokenizer.model", self.config, self.special_tokens)
            self.processor = self._sp.processor
        else:
            raise LitError(
                f"no tokenizer.json or tokenizer.model in {str(checkpoint_dir)!r}. Download the model's tokenizer"
                f" with: {download_command(checkpoint_dir)} --tokenizer_only true"
            )

        self.bos_id = self._special_id("bos", generation_config, model_config)
        self.eos_id = self._special_id("eos", generation_config, model_config)
        self.use_bos = self._check_bos_used()

        # Every id that ends generation. transformers' `generate` takes generation_config's eos ids (falling back
        # to config.json's); the tokenizer's own EOS is included because chat templates end a turn with it.
        stop: List[int] = [self.eos_id] if self.eos_id is not None else []
        source = generation_config if "eos_token_id" in generation_config else model_config
        stop += _as_id_list(source.get("eos_token_id"))
        self.stop_ids: List[int] = list(dict.fromkeys(stop))

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        if self.backend == "huggingface":
            return self.processor.get_vocab_size(with_added_tokens=True)
        return self._sp.processor.vocab_size()

    def token_to_id(self, token: str) -> Optional[int]:
        if self.backend == "huggingface":
            return self.processor.token_to_id(token)
        return self._sp.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        if self.backend == "huggingface":
            return self.processor.id_to_token(token_id)
        return self._sp.processor.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None

    def _special_id(self, kind: str, generation_config: Dict[str, Any], model_config: Dict[str, Any]) -> Optional[int]:
        token = self.special_tokens.get(f"{kind}_token")
        if token is not None:
            token_id = self.token_to_id(token)
            if token_id is not None:
                return token_id
        if self.backend == "sentencepiece":
            token_id = self._sp.processor.bos_id() if kind == "bos" else self._sp.processor.eos_id()
            if token_id >= 0:
                return token_id
        for source in (generation_config, model_config):
            ids = _as_id_list(source.get(f"{kind}_token_id"))
            if ids:
                return ids[0]
        return None

    def _check_bos_used(self) -> bool:
        if self.bos_id is None:
            return False
        if self.backend == "huggingface":
            # transformers (5.x) keeps the tokenizer.json post-processor as written, whatever `add_bos_token`
            # says: it alone decides (e.g. Llama 3's TemplateProcessing adds BOS, SmolLM2's ByteLevel does not).
            with_special = self.processor.encode("a", add_special_tokens=True).ids
            return bool(with_special) and with_special[0] == self.bos_id
        # sentencepiece: `add_bos_token` (Llama 2 / Mistral configs set it); transformers 5 adds no BOS without it
        return bool(self.config.get("add_bos_token", False))

    # ------------------------------------------------------------------ encode / decode
    def encode(
        self,
        text: str,
        bos: Optional[bool] = None,
        eos: bool = False,
        device: Optional[Union[str, torch.device]] = None,
        max_length: int = -1,
    ) -> torch.Tensor:
        """Token ids of `text` as a 1-D LongTensor. Special-token strings in the text (e.g. "<|im_start|>")
        become their ids. `bos=None` follows the checkpoint (see the module docstring); a BOS already at the
        start of the text is not doubled."""
        if self.backend == "huggingface":
            ids = self.processor.encode(text, add_special_tokens=False).ids
        else:
            ids = self._sp.encode(text)
        if bos or (bos is None and self.use_bos):
            if self.bos_id is None:
                raise LitError(f"the tokenizer in {str(self.checkpoint_dir)!r} has no BOS token")
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        if eos:
            if self.eos_id is None:
                raise LitError(f"the tokenizer in {str(self.checkpoint_dir)!r} has no EOS token")
            if not ids or ids[-1] != self.eos_id:
                ids = ids + [self.eos_id]
        if max_length > 0:
            ids = ids[:max_length]
        return torch.tensor(ids, dtype=torch.long, device=device)

    def decode(self, ids: Union[torch.Tensor, Iterable[int]], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Like transformers, special tokens are kept unless `skip_special_tokens`."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = [int(i) for i in ids]
        if self.backend == "huggingface":
            return self.processor.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._sp.decode(ids, skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, ids: Iterable[Union[int, torch.Tensor]], skip_special_tokens: bool = False
    ) -> Iterator[str]:
        """Yield text as `ids` arrive (e.g. from a generator): only complete characters, never the same text
        twice. The pieces joined equal `decode(all ids)`."""
        decoder = self.stream_decoder(skip_special_tokens)
        for token_id in ids:
            text = decoder.step(token_id)
            if text:
                yield text
        text = decoder.flush()
        if text:
            yield text


class _SentencePiece:
    """A sentencepiece model that splits and decodes text the way transformers' `LlamaTokenizer` does with the
    same file (transformers turns it into a `tokenizers` BPE with a `Metaspace(prepend_scheme="first")`
    pre-tokenizer):
    - special-token strings (<s>, </s>, <unk>, tokenizer_config's added tokens) in the text become their ids;
    - spaces become "▁" and only the start of the whole text gets the extra "▁" (none after a special
      token, none if the text already starts with a space), where plain sentencepiece would prefix every
      piece of text and turn a leading space into two "▁";
    - decoding maps pieces back with the same `tokenizers` decoder chain (byte fallback, one leading space
      stripped)."""

    def __init__(self, path: Path, config: Dict[str, Any], special_tokens: Dict[str, str]) -> None:
        import re

        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import decoders

        try:
            proto = sentencepiece_model_pb2.ModelProto()
            proto.ParseFromString(path.read_bytes())
        except Exception as e:  # protobuf raises DecodeError (not an OSError) for a corrupt file
            raise LitError(f"cannot load {str(path)!r} as a sentencepiece model ({e})") from e
        prefix = config.get("add_prefix_space")
        self.add_prefix_space = proto.normalizer_spec.add_dummy_prefix if prefix is None else bool(prefix)
        # The prefix is added by `encode` (only at the start of the text), so the model itself must not add it.
        proto.normalizer_spec.add_dummy_prefix = False
        self.processor = spm.SentencePieceProcessor()
        self.processor.LoadFromSerializedProto(proto.SerializeToString())

        n = self.processor.vocab_size()
        special = {self.processor.id_to_piece(i): i for i in range(n)
                   if self.processor.is_control(i) or self.processor.is_unknown(i)}
        added = config.get("added_tokens_decoder") or {}
        for token in list(special_tokens.values()) + [_token_content(v) for v in added.values()]:
            token_id = self.token_to_id(token) if token else None
            if token_id is not None:
                special[token] = token_id
        self.special = special
        self.special_ids = set(special.values())
        # Longest first, so that a token that contains another one wins.
        alternatives = sorted(special, key=len, reverse=True)
        self.split_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if self.add_prefix_space:
            steps.append(decoders.Strip(" ", 1, 0))
        self.decoder = decoders.Sequence(steps)

    def token_to_id(self, token: str) -> Optional[int]:
        token_id = self.processor.piece_to_id(token)
        # sentencepiece answers unknown pieces with the unk id; only an exact match counts.
        return token_id if self.processor.id_to_piece(token_id) == token else None

    def encode(self, text: str) -> List[int]:
        parts = self.split_re.split(text) if self.split_re is not None else [text]
        ids: List[int] = []
        for index, part in enumerate(parts):
            if not part:
                continue
            if index % 2:  # `re.split` with one group puts the matched special tokens at odd positions
                ids.append(self.special[part])
                continue
            piece = part.replace(" ", "▁")
            if index == 0 and self.add_prefix_space and not piece.startswith("▁"):
                piece = "▁" + piece
            ids.extend(self.processor.encode(piece))
        return ids

    def decode(self, ids: List[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.decoder.decode([self.processor.id_to_piece(i) for i in ids])


class StreamDecoder:
    """Incremental detokenization. Decoding token by token breaks multi-byte characters (a byte-level token
    can hold half of an emoji) and sentencepiece's word-initial spaces (a piece decoded alone loses its
    leading space). So each step decodes a short window of recent ids twice, with and without the new ones,
    and emits the difference once it no longer ends in an incomplete character (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = []
        self.prefix_offset = 0  # window start: ids before it were emitted in an earlier window
        self.read_offset = 0  # ids before it have been emitted

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: Union[int, torch.Tensor]) -> str:
        """Add one id (or a tensor of ids); return the newly completed text, possibly ''."""
        if isinstance(token_id, torch.Tensor):
            self.ids.extend(int(i) for i in token_id.reshape(-1).tolist())
        else:
            self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end), once the ids are exhausted."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]
