"""Convert checkpoints between the Hugging Face layout and ours (`lit_model.pth` + `lit_config.json`).

HF -> lit (`convert_hf_checkpoint`) streams the HF weights tensor by tensor (safetensors headers or memory-mapped
`.bin` files), renames them, and fuses each layer's query/key/value projections into one `attn.qkv` matrix whose
rows are [all q heads | all k heads | all v heads]. lit -> HF (`convert_lit_checkpoint`) is the exact inverse and
writes `model.safetensors` (sharded above a size limit) plus a `config.json` that `transformers` loads.

Fused HF qkv layouts all fit one pattern: the rows form `n_groups` blocks of `q_per_kv` query heads followed by
one key head and one value head. GPT-NeoX and non-multi-query Falcon interleave per head (n_groups = n_head,
q_per_kv = 1), multi-query Falcon-7B stores [q heads, k, v] (n_groups = 1) and Falcon-40B's new decoder
architecture stores one block per KV group.
"""

import json
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from tqdm import tqdm

from lit_gpt.config import Config
from lit_gpt.hf_write import SUPPORTED_MODEL_TYPES, _falcon_arch, hf_config_dict, hf_model_type
from lit_gpt.model import GPT
from lit_gpt.utils import (
    LitError,
    check_checkpoint_dir,
    copy_file_atomic,
    error_reason,
    load_state_dict,
    refuse_overwrite,
    remove_stale_temp_files,
    save_atomic,
    write_text_atomic,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# files copied next to exported weights so that the output folder is a complete HF model
HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",  # transformers 5 and newer Hub repos (SmolLM3) keep the template in its own file
)
# ---------------------------------------------------------------------------------------------------------------
# Name layouts
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    top: Dict[str, str]  # HF module -> lit module, outside the layers
    layers: str  # HF prefix of layer i is f"{layers}.{i}."
    layer: Dict[str, str]  # HF sub-module -> lit sub-module inside a layer
    qkv: Tuple[str, ...]  # HF q, k, v projections (three names) or the fused projection (one name)
    skip: Tuple[str, ...] = ()  # regexes of HF tensors that hold no weights (buffers some checkpoints carry)
    rename: Tuple[Tuple[str, str], ...] = ()  # (regex, replacement) applied to HF names before mapping (import)


_GATED_MLP = {"mlp.gate_proj": "mlp.fc_1", "mlp.up_proj": "mlp.fc_2", "mlp.down_proj": "mlp.proj"}
_LLAMA_LAYER = {
    "input_layernorm": "norm_1",
    "post_attention_layernorm": "norm_2",
    "self_attn.o_proj": "attn.proj",
    **_GATED_MLP,
}
_LLAMA = _Layout(
    top={"model.embed_tokens": "transformer.wte", "model.norm": "transformer.ln_f", "lm_head": "lm_head"},
    layers="model.layers",
    layer=_LLAMA_LAYER,
    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    skip=(r"\.rotary_emb\.inv_freq$",),
)
_QK_NORMS = {"self_attn.q_norm": "attn.norm_q", "self_attn.k_norm": "attn.norm_k"}
_QWEN3 = _Layout(
    top=_LLAMA.top, layers=_LLAMA.layers, layer={**_LLAMA_LAYER, **_QK_NORMS}, qkv=_LLAMA.qkv, skip=_LLAMA.skip
)
_OLMO2 = _Layout(
    top=_LLAMA.top,
    layers=_LLAMA.layers,
    layer={
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_mlp_norm",
        "self_attn.o_proj": "attn.proj",
        **_GATED_MLP,
        **_QK_NORMS,
    },
    qkv=_LLAMA.qkv,
    skip=_LLAMA.skip,
)
_GEMMA2_LAYER = {
    "input_layernorm": "norm_1",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "norm_2",
    "post_feedforward_layernorm": "post_mlp_norm",
    "self_attn.o_proj": "attn.proj",
    **_GATED_MLP,
}
_GEMMA2 = _Layout(top=_LLAMA.top, layers=_LLAMA.layers, layer=_GEMMA2_LAYER, qkv=_LLAMA.qkv, skip=_LLAMA.skip)
_GEMMA3 = _Layout(
    top=_LLAMA.top,
    layers=_LLAMA.layers,
    layer={**_GEMMA2_LAYER, **_QK_NORMS},
    qkv=_LLAMA.qkv,
    # the multimodal checkpoint (model_type gemma3): its text tower under `language_model.model.` (Hub files) or
    # `model.language_model.` (transformers 5), and the vision tower and projector, which are left out
    skip=_LLAMA.skip + (r"(^|\.)vision_tower\.", r"(^|\.)multi_modal_projector\."),
    rename=((r"^language_model\.model\.", "model."), (r"^model\.language_model\.", "model."),
            (r"^language_model\.lm_head\.", "lm_head.")),
)
# Phi-3's fused qkv_proj already holds [q heads | k heads | v heads]; gate_up_proj is [gate | up] (`_FUSED_MLP`)
_PHI3 = _Layout(
    top=_LLAMA.top,
    layers=_LLAMA.layers,
    layer={
        "input_layernorm": "norm_1",
        "post_attention_layernorm": "norm_2",
        "self_attn.qkv_proj": "attn.qkv",
        "self_attn.o_proj": "attn.proj",
        "mlp.down_proj": "mlp.proj",
    },
    qkv=(),
    skip=_LLAMA.skip,
)
_FUSED_MLP = {"phi3": ("mlp.gate_up_proj", ("mlp.fc_1", "mlp.fc_2"))}
_PHI = _Layout(
    top={"model.embed_tokens": "transformer.wte", "model.final_layernorm": "transformer.ln_f", "lm_head": "lm_head"},
    layers="model.layers",
    layer={"input_layernorm": "norm_1", "self_attn.dense": "attn.proj", "mlp.fc1": "mlp.fc", "mlp.fc2": "mlp.proj"},
    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    skip=(r"\.rotary_emb\.inv_freq$",),
)
_GPT_NEOX = _Layout(
    # checkpoints name the head `embed_out`; transformers 5 renames it to `lm_head` in memory (export writes the first)
    top={
        "gpt_neox.embed_in": "transformer.wte",
        "gpt_neox.final_layer_norm": "transformer.ln_f",
        "embed_out": "lm_head",
        "lm_head": "lm_head",
    },
    layers="gpt_neox.layers",
    layer={
        "input_layernorm": "norm_1",
        "post_attention_layernorm": "norm_2",
        "attention.dense": "attn.proj",
        "mlp.dense_h_to_4h": "mlp.fc",
        "mlp.dense_4h_to_h": "mlp.proj",
    },
    qkv=("attention.query_key_value",),
    # older checkpoints store the causal-mask and RoPE buffers
    skip=(r"\.attention\.(bias|masked_bias)$", r"\.rotary_emb\.inv_freq$"),
)
_FALCON_COMMON = {"self_attention.dense": "attn.proj", "mlp.dense_h_to_4h": "mlp.fc", "mlp.dense_4h_to_h": "mlp.proj"}
_FALCON = _Layout(
    top={"transformer.word_embeddings": "transformer.wte", "transformer.ln_f": "transformer.ln_f", "lm_head": "lm_head"},
    layers="transformer.h",
    # import accepts every norm naming; export picks the one the config's architecture uses (`_falcon_layer`)
    layer={
        "input_layernorm": "norm_1",
        "post_attention_layernorm": "norm_2",
        "ln_attn": "norm_1",
        "ln_mlp": "norm_2",
        **_FALCON_COMMON,
    },
    qkv=("self_attention.query_key_value",),
    skip=(r"\.rotary_emb\.inv_freq$",),
)
_LAYOUTS = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gemma": _LLAMA,
    "stablelm": _LLAMA,
    "phi": _PHI,
    "gpt_neox": _GPT_NEOX,
    "falcon": _FALCON,
    "qwen3": _QWEN3,
    "smollm3": _LLAMA,
    "olmo2": _OLMO2,
    "phi3": _PHI3,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA3,
    "gemma3": _GEMMA3,
}


def _layer_map(model_type: str, config: Config) -> Dict[str, str]:
    """HF sub-module -> lit sub-module for one layer, one-to-one for this config (what export uses)."""
    if model_type != "falcon":
        layer = dict(_LAYOUTS[model_type].layer)
        if config.shared_attention_norm:
            layer.pop("post_attention_layernorm", None)
        return layer
    new_arch, _ = _falcon_arch(config)
    if config.shared_attention_norm:
        norms = {"input_layernorm": "norm_1"}
    elif new_arch:
        norms = {"ln_attn": "norm_1", "ln_mlp": "norm_2"}
    else:
        norms = {"input_layernorm": "norm_1", "post_attention_layernorm": "norm_2"}
    return {**norms, **_FALCON_COMMON}


def _qkv_grouping(model_type: str, config: Config) -> Tuple[int, int]:
    """(n_groups, q_per_kv) of a fused HF qkv tensor (see the module docstring)."""
    if model_type == "gpt_neox":
        return config.n_head, 1
    return config.n_query_groups, config.n_head // config.n_query_groups


def _ungroup_qkv(t: torch.Tensor, n_groups: int, q_per_kv: int, head_size: int) -> torch.Tensor:
    """HF fused rows (n_groups, q_per_kv + 2, head_size) -> lit rows [q heads | k heads | v heads]."""
    rest = t.shape[1:]
    g = t.reshape(n_groups, q_per_kv + 2, head_size, *rest)
    q = g[:, :q_per_kv].reshape(-1, *rest)
    k = g[:, q_per_kv].reshape(-1, *rest)
    v = g[:, q_per_kv + 1].reshape(-1, *rest)
    return torch.cat((q, k, v))


def _group_qkv(t: torch.Tensor, n_groups: int, q_per_kv: int, head_size: int) -> torch.Tensor:
    """lit rows [q heads | k heads | v heads] -> HF fused rows (n_groups, q_per_kv + 2, head_size)."""
    rest = t.shape[1:]
    q_rows = n_groups * q_per_kv * head_size
    kv_rows = n_groups * head_size
    q, k, v = t.split((q_rows, kv_rows, kv_rows))
    q = q.reshape(n_groups, q_per_kv, head_size, *rest)
    k = k.reshape(n_groups, 1, head_size, *rest)
    v = v.reshape(n_groups, 1, head_size, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def _split_qkv(t: torch.Tensor, config: Config) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv_rows = config.n_query_groups * config.head_size
    return t.split((config.n_head * config.head_size, kv_rows, kv_rows))


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------------
def _parse_dtype(dtype: Optional[Union[str, torch.dtype]]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise LitError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _expected_state(config: Config) -> Dict[str, torch.Size]:
    """Names and shapes of `GPT(config).state_dict()`, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    return {k: v.shape for k, v in model.state_dict().items()}


def _check_state(state: Dict[str, torch.Tensor], expected: Dict[str, torch.Size], what: str, hint: str) -> None:
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [
        f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items() if k in state and state[k].shape != s
    ]
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            shown = ", ".join(items[:3]) + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")
            raise LitError(f"{what}: {len(items)} {label} tensor(s): {shown}. {hint}")


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise LitError(f"cannot read {str(path)!r}: {error_reason(e)}") from e


def _write_text_atomic(path: Path, text: str) -> None:
    write_text_atomic(path, text)


# ---------------------------------------------------------------------------------------------------------------
# HF -> lit
# ---------------------------------------------------------------------------------------------------------------
def _weight_files(checkpoint_dir: Path) -> List[Path]:
    """The HF weight files: the shards an index names, else every `*.safetensors`, else `pytorch_model*.bin`."""
    kinds = (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model*.bin"))
    for index_name, pattern in kinds:
        index = checkpoint_dir / index_name
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise LitError(f"{str(index)!r} has no weight_map; download the checkpoint again")
            files = [checkpoint_dir / f for f in sorted(set(weight_map.values()))]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise LitError(
                    f"{str(index)!r} names shards that are missing: {', '.join(absent[:3])}. Download the checkpoint again"
                )
            return files
        # Mistral repos also ship `consolidated.safetensors` in Mistral's own layout: never mix it in
        files = sorted(f for f in checkpoint_dir.glob(pattern) if not f.name.startswith("consolidated"))
        if files:
            return files
    raise LitError(
        f"no weights found in {str(checkpoint_dir)!r}: expected *.safetensors or pytorch_model*.bin files."
        " Download them with: python scripts/download.py --repo_id ORG/NAME"
    )


@contextmanager
def _open_weights(path: Path) -> Iterator[Tuple[List[str], Callable[[str], torch.Tensor]]]:
    """The tensor names of one weight file and a getter that reads one tensor at a time."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                yield list(f.keys()), f.get_tensor
        except SafetensorError as e:
            raise LitError(f"cannot read {str(path)!r} ({e}); download it again") from e
    else:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                state = load_state_dict(path)  # raises the LitError for a corrupt file
            # the pre-2020 (non-zip) format cannot be memory-mapped: read it whole, once
            state = load_state_dict(path, mmap=False)
        # `.clone()`: a mmapped tensor may be a view of a larger storage that torch.save would write whole
        yield list(state), lambda name: state[name].clone()
        del state


class _HFToLit:
    """Maps HF tensor names to lit names, fusing each layer's q/k/v as soon as all three have been read."""

    def __init__(self, model_type: str, config: Config) -> None:
        self.model_type = model_type
        self.config = config
        self.layout = _LAYOUTS[model_type]
        self.skip = [re.compile(p) for p in self.layout.skip]
        self.layer_re = re.compile(rf"^{re.escape(self.layout.layers)}\.(\d+)\.(.+)\.(weight|bias)$")
        self.pending: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """The lit tensors one HF tensor gives: none (skipped, or q/k/v waiting for the rest), one, or two (a
        fused gate/up projection)."""
        if any(p.search(name) for p in self.skip):
            return []
        for pattern, replacement in self.layout.rename:
            name = re.sub(pattern, replacement, name)
        module, _, param = name.rpartition(".")
        if module in self.layout.top:
            return [(f"{self.layout.top[module]}.{param}", tensor)]
        m = self.layer_re.match(name)
        if m is None:
            raise self._unexpected(name)
        i, sub, param = int(m.group(1)), m.group(2), m.group(3)
        lit_prefix = f"transformer.h.{i}"
        if sub in self.layout.layer:
            return [(f"{lit_prefix}.{self.layout.layer[sub]}.{param}", tensor)]
        fused = _FUSED_MLP.get(self.model_type)
        if fused is not None and sub == fused[0]:
            gate, up = tensor.chunk(2, dim=0)
            return [(f"{lit_prefix}.{fused[1][0]}.{param}", gate), (f"{lit_prefix}.{fused[1][1]}.{param}", up)]
        if sub not in self.layout.qkv:
            raise self._unexpected(name)
        target = f"{lit_prefix}.attn.qkv.{param}"
        c = self.config
        if len(self.layout.qkv) == 1:
            return [(target, _ungroup_qkv(tensor, *_qkv_grouping(self.model_type, c), c.head_size))]
        parts = self.pending.setdefault((i, param), {})
        parts[sub] = tensor
        if len(parts) < 3:
            return []
        del self.pending[(i, param)]
        return [(target, torch.cat([parts[p] for p in self.layout.qkv]))]

    def _unexpected(self, name: str) -> LitError:
        return LitError(
            f"unexpected tensor {name!r} for model_type {self.model_type!r}: the weights do not match config.json"
            " (or --model_name)"
        )

    def finish(self) -> None:
        if self.pending:
            (i, param), parts = next(iter(self.pending.items()))
            raise LitError(f"layer {i} has only {sorted(parts)} of q/k/v {param}s: the checkpoint is incomplete")


def _mismatch_hint(model_name: Optional[str]) -> str:
    return "Does the checkpoint match" + (f" --model_name {model_name}?" if model_name else " its config.json?")


def convert_hf_checkpoint(
    checkpoint_dir: Path, model_name: Optional[str] = None, dtype: Optional[str] = None, overwrite: bool = False
) -> Path:
    """Convert the HF checkpoint in `checkpoint_dir` into `lit_model.pth` + `lit_config.json` in the same folder.

    The config comes from the registry entry `model_name` when given, else from `config.json` (named like the
    folder). `dtype` casts floating-point weights (float32, bfloat16 or float16). An existing `lit_model.pth` /
    `lit_config.json` is replaced only with `overwrite`. Returns the `lit_model.pth` path.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise LitError(
            f"checkpoint directory {str(checkpoint_dir)!r} does not exist. Download it with:"
            " python scripts/download.py --repo_id ORG/NAME"
        )
    target_dtype = _parse_dtype(dtype)
    refuse_overwrite(
        checkpoint_dir,
        ("lit_model.pth", "lit_config.json"),
        overwrite,
        "It is converted already: use it as it is, or pass --overwrite true to convert again",
    )
    hf_path = checkpoint_dir / "config.json"
    hf = _read_json(hf_path) if hf_path.exists() else None
    try:
        if model_name:
            config = Config.from_name(model_name)
        elif hf is None:
            raise LitError(
                f"no config.json in {str(checkpoint_dir)!r}: download it with the weights, or pass --model_name"
                " NAME (a registry entry, see `Config.names()`)"
            )
        else:
            config = Config.from_hf_config(hf, name=checkpoint_dir.name)
    except ValueError as e:
        raise LitError(str(e)) from e
    model_type = hf.get("model_type") if hf is not None else hf_model_type(config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise LitError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":
        print("Gemma 3 multimodal checkpoint: converting its text model; the vision tower is left out", file=sys.stderr)
    # the text tower exports as a text-only model
    config.hf_model_type = "gemma3_text" if model_type == "gemma3" else model_type

    files = _weight_files(checkpoint_dir)
    expected = _expected_state(config)
    mapper = _HFToLit(model_type, config)
    state: Dict[str, torch.Tensor] = {}
    with tqdm(total=0, desc="Converting", unit="tensor", file=sys.stderr) as bar:
        for path in files:
            with _open_weights(path) as (names, get):
                bar.total += len(names)
                bar.refresh()
                for name in names:
                    tensor = get(name)
                    try:
                        out = mapper(name, tensor)
                    except RuntimeError as e:  # a fused qkv whose size does not fit the config's heads
                        raise LitError(
                            f"tensor {name!r} of shape {tuple(tensor.shape)} does not fit the config ({e})."
                            f" {_mismatch_hint(model_name)}"
                        ) from e
                    bar.update()
                    for lit_name, tensor in out:
                        if target_dtype is not None and tensor.is_floating_point():
                            tensor = tensor.to(target_dtype)
                        elif tensor.untyped_storage().nbytes() != tensor.nbytes:
                            tensor = tensor.clone()  # half of a fused tensor: save only its own bytes
                        state[lit_name] = tensor
    mapper.finish()
    if config.tie_embeddings and "transformer.wte.weight" in state:
        # one tensor for both names, as in the model (torch.save stores shared storage once)
        state["lm_head.weight"] = state["transformer.wte.weight"]
    _check_state(state, expected, f"converting {str(checkpoint_dir)!r}", _mismatch_hint(model_name))

    out_path = checkpoint_dir / "lit_model.pth"
    save_atomic(state, out_path)
    config.save(checkpoint_dir)
    print(f"Saved {out_path} ({len(state)} tensors) and {checkpoint_dir / 'lit_config.json'}", file=sys.stderr)
    return out_path


# ---------------------------------------------------------------------------------------------------------------
# lit -> HF
# ---------------------------------------------------------------------------------------------------------------
def _lit_to_hf(
    name: str, config: Config, model_type: str, layer_map: Dict[str, str], state: Dict[str, torch.Tensor]
) -> List[Tuple[str, Callable, float]]:
    """HF names for one lit tensor, each with a function that makes the HF tensor from the lit one and the size of
    that HF tensor as a multiple of the lit one's (a third of a fused qkv, twice a gate that takes its up along)."""
    layout = _LAYOUTS[model_type]
    module, _, param = name.rpartition(".")
    ident = lambda t: t  # noqa: E731
    for hf_module, lit_module in layout.top.items():
        if module == lit_module:
            return [(f"{hf_module}.{param}", ident, 1.0)]
    m = re.match(r"^transformer\.h\.(\d+)\.(.+)$", module)
    if m is None:
        raise LitError(f"unexpected tensor {name!r} in the lit checkpoint")
    i, sub = m.group(1), m.group(2)
    prefix = f"{layout.layers}.{i}"
    if sub == "attn.qkv" and layout.qkv:
        if len(layout.qkv) == 1:
            groups = _qkv_grouping(model_type, config)
            return [(f"{prefix}.{layout.qkv[0]}.{param}", lambda t: _group_qkv(t, *groups, config.head_size), 1.0)]
        return [
            (f"{prefix}.{hf_sub}.{param}", lambda t, j=j: _split_qkv(t, config)[j], 1 / 3)
            for j, hf_sub in enumerate(layout.qkv)
        ]
    fused = _FUSED_MLP.get(model_type)
    if fused is not None and sub in fused[1]:
        if sub == fused[1][1]:
            return []  # written with the gate, below
        up = state[f"transformer.h.{i}.{fused[1][1]}.{param}"]
        return [(f"{prefix}.{fused[0]}.{param}", lambda t: torch.cat((t, up.to(t.dtype))), 2.0)]
    for hf_sub, lit_sub in layer_map.items():
        if sub == lit_sub:
            return [(f"{prefix}.{hf_sub}.{param}", ident, 1.0)]
    raise LitError(f"unexpected tensor {name!r} in the lit checkpoint")


def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", size, re.IGNORECASE)
    if m is None:
        raise LitError(f"cannot parse size {size!r}; write e.g. 5GB or 500MB")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2).upper()])


def convert_lit_checkpoint(
    checkpoint_dir: Path,
    output_dir: Path,
    checkpoint_path: Optional[Path] = None,
    dtype: Optional[str] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
) -> Path:
    """Export a lit checkpoint as an HF model folder that `transformers.AutoModelForCausalLM` loads.

    `checkpoint_dir` holds `lit_config.json` (and the tokenizer files, copied along); `checkpoint_path` picks other
    weights than its `lit_model.pth`, e.g. a finetuned or LoRA-merged file. Writes `model.safetensors` (sharded
    with an index above `max_shard_size`) and `config.json` into `output_dir`, which it returns. An `output_dir`
    that already holds an HF model (`config.json`, `model*.safetensors`) is refused unless `overwrite`.
    """
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    if output_dir.is_dir():
        existing = ["config.json", "model.safetensors.index.json", "pytorch_model.bin"]
        existing += sorted(p.name for p in output_dir.glob("model*.safetensors"))
        refuse_overwrite(
            output_dir, existing, overwrite, "Pass --output_dir NEW_FOLDER, or --overwrite true to replace that model"
        )
    elif output_dir.exists():
        raise LitError(f"--output_dir {str(output_dir)!r} is a file, not a folder: pass a folder")
    target_dtype = _parse_dtype(dtype)
    shard_limit = _parse_size(max_shard_size)
    path = Path(checkpoint_path) if checkpoint_path is not None else check_checkpoint_dir(checkpoint_dir)
    try:
        config = Config.from_checkpoint(checkpoint_dir)
    except (FileNotFoundError, ValueError) as e:
        raise LitError(str(e)) from e
    model_type = hf_model_type(config)
    hf_config = hf_config_dict(config, model_type)

    state = load_state_dict(path, mmap=True)
    if isinstance(state.get("model"), dict):  # training checkpoints wrap the weights with optimizer state
        state = state["model"]
    if any("lora_" in k for k in state):
        raise LitError(
            f"{str(path)!r} holds LoRA weights: merge them first with scripts/merge_lora.py and pass the merged"
            " lit_model.pth as --checkpoint_path"
        )
    if config.tie_embeddings and "lm_head.weight" not in state and "transformer.wte.weight" in state:
        state = {**state, "lm_head.weight": state["transformer.wte.weight"]}
    _check_state(state, _expected_state(config), f"{str(path)!r}", "Does it belong to this lit_config.json?")

    # plan every HF tensor and its size before writing, so shards can be named -0000k-of-0000n up front
    layer_map = _layer_map(model_type, config)
    plan: List[Tuple[str, str, Callable, int]] = []
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # transformers ties lm_head to the embeddings itself
        items = _lit_to_hf(name, config, model_type, layer_map, state)
        itemsize = (target_dtype or tensor.dtype).itemsize if tensor.is_floating_point() else tensor.element_size()
        for hf_name, fn, fraction in items:
            plan.append((hf_name, name, fn, int(tensor.numel() * itemsize * fraction)))
    shards: List[List[Tuple[str, str, Callable, int]]] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and size + item[3] > shard_limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[3]

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LitError(f"cannot write --output_dir {str(output_dir)!r}: {error_reason(e)}") from None
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    # earlier exports into this folder with another shard count would be picked up by transformers: remove them
    for old in list(output_dir.glob("model*.safetensors")) + [output_dir / "model.safetensors.index.json"]:
        ours = re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", old.name)
        if ours and old.name not in names and old.is_file():
            old.unlink()
    weight_map: Dict[str, str] = {}
    total = 0
    out_dtype = None
    with tqdm(total=len(plan), desc="Exporting", unit="tensor", file=sys.stderr) as bar:
        for shard_name, shard in zip(names, shards):
            tensors: Dict[str, torch.Tensor] = {}
            for hf_name, lit_name, fn, _ in shard:
                t = fn(state[lit_name])
                if target_dtype is not None and t.is_floating_point():
                    t = t.to(target_dtype)
                t = t.contiguous()
                if t.untyped_storage().nbytes() != t.nbytes:
                    # a view (q/k/v rows of qkv): safetensors refuses tensors that share storage
                    t = t.clone()
                tensors[hf_name] = t
                if out_dtype is None and t.is_floating_point():
                    out_dtype = t.dtype
                weight_map[hf_name] = shard_name
                total += t.nbytes
                bar.update()
            remove_stale_temp_files(output_dir / shard_name)
            tmp = output_dir / f".{shard_name}.tmp{os.getpid()}"
            try:
                save_file(tensors, str(tmp), metadata={"format": "pt"})
                os.replace(tmp, output_dir / shard_name)
            except (OSError, SafetensorError) as e:  # a full disk: one line, and no partial file
                raise LitError(f"cannot write {str(output_dir / shard_name)!r}: {error_reason(e)}") from None
            finally:
                if tmp.exists():
                    tmp.unlink()
            del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_text_atomic(output_dir / "model.safetensors.index.json", json.dumps(index, indent=2))

    if out_dtype is not None:
        hf_config["torch_dtype"] = str(out_dtype).removeprefix("torch.")
    original = checkpoint_dir / "config.json"
    if original.is_file():
        orig = _read_json(original)
        if orig.get("model_type") == "gemma3" and model_type == "gemma3_text":  # the text tower of a multimodal one
            orig = {**(orig.get("text_config") or {}), **orig, "model_type": model_type}
        if orig.get("model_type") == model_type:
            # keep what the lit config does not model (special token ids)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in orig:
                    hf_config[key] = orig[key]
    _write_text_atomic(output_dir / "config.json", json.dumps(hf_config, indent=2))
    if checkpoint_dir.resolve() != output_dir.resolve():
        for name in HF_SIDE_FILES:
            if (checkpoint_dir / name).is_file():
                copy_file_atomic(checkpoint_dir / name, output_dir / name)
    print(f"Saved {n} safetensors file(s) and config.json to {output_dir}", file=sys.stderr)
    return output_dir
