"""The mixture-of-experts tensors of Mixtral, Qwen3-MoE and gpt-oss in both directions (`lit_gpt.convert` calls
this module for them; the layouts of their other tensors are in `lit_gpt.convert_layouts`).

lit holds each MoE layer's experts stacked: `transformer.h.{i}.mlp.experts.{fc_1,fc_2,proj}.weight` (E, out, in)
(fc_1 the gate, fc_2 the up projection, proj the down projection) and `.bias` (E, out) for gpt-oss. The Hub layouts:
  Mixtral     `model.layers.{i}.block_sparse_moe.experts.{e}.w1|w3|w2.weight` (gate, up, down), one per expert;
  Qwen3-MoE   `model.layers.{i}.mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`, one per expert;
  gpt-oss     fused `model.layers.{i}.mlp.experts.gate_up_proj` (E, H, 2I) with gate and up interleaved along the
              last dim (gate 0, up 0, gate 1, ...) and `_bias` (E, 2I); `down_proj` (E, I, H) and `_bias` (E, H);
              the Hub's folders store the two weights as MXFP4 `_blocks` / `_scales` (lit_gpt.mxfp4), kept packed
              here: `experts.{fc_1,fc_2,proj}.{blocks,scales}` (the gate / up rows of gate_up split as whole rows,
              no byte changed); with `keep_mxfp4=False` decoded to `.weight` (to --dtype, else bf16).
transformers 5 keeps Mixtral and Qwen3-MoE experts fused in memory (`mlp.experts.gate_up_proj` (E, 2I, H), gate
rows first, and `down_proj` (E, H, I)): a folder written with those names converts too. Export writes the Hub
layouts (gpt-oss in bf16 / the checkpoint's dtype, never MXFP4).

Import holds the experts of a layer until all E have been read, then stacks them (a layer's experts are the only
tensors held twice, for as long as that takes).
"""

import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from lit_gpt.config import Config
from lit_gpt.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4
from lit_gpt.utils import LitError

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "gpt_oss")
# per-expert HF names: (prefix of the experts inside a layer, {HF projection: lit projection})
_PER_EXPERT = {
    "mixtral": ("block_sparse_moe.experts", {"w1": "fc_1", "w3": "fc_2", "w2": "proj"}),
    "qwen3_moe": ("mlp.experts", {"gate_proj": "fc_1", "up_proj": "fc_2", "down_proj": "proj"}),
}
_EXPERTS = "mlp.experts"  # the lit module (and gpt-oss's HF one)
_SINKS = ("self_attn.sinks", "attn.sinks")  # gpt-oss's per-head sink logits, HF and lit (no .weight suffix)

Pairs = List[Tuple[str, torch.Tensor]]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """A tensor of its own storage (safetensors writes a view's whole storage)."""
    t = t.contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def _deinterleave(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's gate/up interleaved along the last dim -> (gate, up)."""
    return t[..., 0::2], t[..., 1::2]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack((gate, up), dim=-1).flatten(-2)


class MoEImport:
    """Turns one layer's HF MoE tensors (and gpt-oss's sinks) into lit tensors; `take` returns None for any other
    tensor, [] while a layer's experts (or an MXFP4 pair) are still incomplete."""

    def __init__(self, model_type: str, config: Config, mxfp4_dtype: Optional[torch.dtype] = None,
                 keep_mxfp4: bool = True) -> None:
        self.model_type, self.config = model_type, config
        self.keep_mxfp4 = keep_mxfp4
        self.mxfp4_dtype = mxfp4_dtype or torch.bfloat16
        self.pending: Dict[Tuple[int, str], Dict[object, torch.Tensor]] = {}
        prefix, projections = _PER_EXPERT.get(model_type, ("", {}))
        names = "|".join(map(re.escape, projections)) or "(?!)"
        self.per_expert = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.({names})\.(weight)$") if prefix else None
        self.projections = projections
        self.fused_prefix = f"{prefix}." if prefix else f"{_EXPERTS}."

    def take(self, i: int, sub: str, tensor: torch.Tensor) -> Optional[Pairs]:
        lit = f"transformer.h.{i}.{_EXPERTS}"
        if sub == _SINKS[0] and self.model_type == "gpt_oss":
            return [(f"transformer.h.{i}.{_SINKS[1]}", tensor)]
        if self.per_expert is not None:
            m = self.per_expert.match(sub)
            if m is not None:
                return self._expert(i, int(m.group(1)), f"{lit}.{self.projections[m.group(2)]}.weight", tensor)
        if not sub.startswith(self.fused_prefix):
            return None
        name = sub[len(self.fused_prefix):]
        if self.model_type == "gpt_oss":
            return self._gpt_oss(i, lit, name, tensor)
        # transformers 5's in-memory names for Mixtral / Qwen3-MoE: gate rows, then up rows
        if name == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            return [(f"{lit}.fc_1.weight", _contiguous(gate)), (f"{lit}.fc_2.weight", _contiguous(up))]
        if name == "down_proj":
            return [(f"{lit}.proj.weight", tensor)]
        return None

    def _expert(self, i: int, e: int, lit_name: str, tensor: torch.Tensor) -> Pairs:
        n = self.config.n_expert
        if not self.config.is_moe_layer(i) or e >= n:
            what = f"expert {e} of {n}" if self.config.is_moe_layer(i) else "experts in a dense layer"
            raise LitError(f"the checkpoint has {what} (layer {i}): the weights do not match config.json")
        parts = self.pending.setdefault((i, lit_name), {})
        parts[e] = tensor
        if len(parts) < n:
            return []
        del self.pending[(i, lit_name)]
        return [(lit_name, torch.stack([parts.pop(k) for k in range(n)]))]

    def _gpt_oss(self, i: int, lit: str, name: str, tensor: torch.Tensor) -> Optional[Pairs]:
        for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX):  # MXFP4: wait for the other half, then decode
            if name.endswith(suffix):
                proj = name[: -len(suffix)]
                if proj not in ("gate_up_proj", "down_proj"):
                    return None
                parts = self.pending.setdefault((i, proj), {})
                parts[suffix] = tensor
                if len(parts) < 2:
                    return []
                del self.pending[(i, proj)]
                if self.keep_mxfp4:
                    return self._packed(i, lit, proj, parts[BLOCKS_SUFFIX], parts[SCALES_SUFFIX])
                try:
                    w = dequantize_mxfp4(parts[BLOCKS_SUFFIX], parts[SCALES_SUFFIX], self.mxfp4_dtype)  # (E, out, in)
                except ValueError as e:
                    raise LitError(f"layer {i} {proj}: {e}; download the checkpoint again") from e
                if proj == "down_proj":
                    return [(f"{lit}.proj.weight", w)]
                gate, up = w[:, 0::2], w[:, 1::2]  # interleaved rows
                return [(f"{lit}.fc_1.weight", _contiguous(gate)), (f"{lit}.fc_2.weight", _contiguous(up))]
        if name == "gate_up_proj":  # (E, H, 2I)
            gate, up = _deinterleave(tensor)
            return [(f"{lit}.fc_1.weight", _contiguous(gate.transpose(1, 2))),
                    (f"{lit}.fc_2.weight", _contiguous(up.transpose(1, 2)))]
        if name == "gate_up_proj_bias":  # (E, 2I)
            gate, up = _deinterleave(tensor)
            return [(f"{lit}.fc_1.bias", _contiguous(gate)), (f"{lit}.fc_2.bias", _contiguous(up))]
        if name == "down_proj":  # (E, I, H)
            return [(f"{lit}.proj.weight", _contiguous(tensor.transpose(1, 2)))]
        if name == "down_proj_bias":
            return [(f"{lit}.proj.bias", tensor)]
        return None

    def _packed(self, i: int, lit: str, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> Pairs:
        """The Hub's MXFP4 bytes as they are, under MXFP4ExpertLinear's buffer names."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1] \
                or blocks.dim() != 4:
            raise LitError(f"layer {i} {proj}: MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales"
                           f" {scales.dtype} {tuple(scales.shape)} do not match; download the checkpoint again")
        if proj == "down_proj":
            return [(f"{lit}.proj.blocks", blocks), (f"{lit}.proj.scales", scales)]
        # (E, 2I, G, 16): gate and up rows interleaved; each row's groups span the input dim, so a row split is exact
        return [(f"{lit}.{fc}.{what}", _contiguous(t[:, row::2])) for fc, row in (("fc_1", 0), ("fc_2", 1))
                for what, t in (("blocks", blocks), ("scales", scales))]

    def finish(self) -> None:
        if self.pending:
            (i, what), parts = next(iter(self.pending.items()))
            if isinstance(next(iter(parts)), str):
                raise LitError(f"layer {i} has only {sorted(parts)} of its MXFP4 {what}: the checkpoint is incomplete")
            raise LitError(
                f"layer {i} has only {len(parts)} of {self.config.n_expert} experts' {what.split('.')[-2]} weights:"
                " the checkpoint is incomplete"
            )


def moe_export(
    name: str, config: Config, model_type: str, hf_layers: str, state: Dict[str, torch.Tensor]
) -> Optional[List[Tuple[str, Callable[[torch.Tensor], torch.Tensor]]]]:
    """HF names for one lit MoE tensor (or gpt-oss sink), each with the function that makes it from the lit tensor;
    None for any other tensor. `state` gives gpt-oss's up projection, fused with the gate (on the meta device when
    only the shapes are asked for)."""
    m = re.match(rf"^transformer\.h\.(\d+)\.({re.escape(_EXPERTS)}\.(fc_1|fc_2|proj)|{re.escape(_SINKS[1])})"
                 r"(?:\.(weight|bias))?$", name)
    if m is None or model_type not in MOE_MODEL_TYPES:
        return None
    i, proj, param = m.group(1), m.group(3), m.group(4)
    prefix = f"{hf_layers}.{i}"
    if proj is None:
        return [(f"{prefix}.{_SINKS[0]}", lambda t: t)]
    if model_type in _PER_EXPERT:
        hf_prefix, projections = _PER_EXPERT[model_type]
        hf_proj = {v: k for k, v in projections.items()}[proj]
        return [
            (f"{prefix}.{hf_prefix}.{e}.{hf_proj}.{param}", lambda t, e=e: t[e]) for e in range(config.n_expert)
        ]
    suffix = "" if param == "weight" else "_bias"
    hf = f"{prefix}.{_EXPERTS}"
    if proj == "fc_2":
        return []  # written with the gate
    if proj == "proj":
        return [(f"{hf}.down_proj{suffix}", (lambda t: t.transpose(1, 2)) if param == "weight" else (lambda t: t))]
    up = state[f"transformer.h.{i}.{_EXPERTS}.fc_2.{param}"]
    if param == "weight":  # (E, I, H) twice -> (E, H, 2I)
        return [(f"{hf}.gate_up_proj", lambda t: _interleave(t.transpose(1, 2), up.to(t.dtype).transpose(1, 2)))]
    return [(f"{hf}.gate_up_proj_bias", lambda t: _interleave(t, up.to(t.dtype)))]
