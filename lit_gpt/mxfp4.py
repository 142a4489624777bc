"""MXFP4 (OCP microscaling FP4), the format of the expert weights in the Hub's gpt-oss folders, kept as it is by
conversion and decoded to a float dtype on loading (`fit_state`): the model runs the float experts transformers gives
with `Mxfp4Config(dequantize=True)`, or, with --quantize mxfp4, keeps them packed. transformers is not needed at run
time: the decoder is the few lines below.

A Hub folder stores each expert projection as two tensors:
  `<name>_blocks` uint8 (..., G, 16): 32 FP4 (E2M1) values per group, two per byte, the low nibble first;
  `<name>_scales` uint8 (..., G): one E8M0 scale per group, 2**(s - 127).
For gpt-oss the leading dims are (n_expert, out_features) and the G groups of 32 span in_features, so that the
decoded tensor is (n_expert, out, in): gate_up_proj (E, 2I, H) with gate/up rows interleaved, down_proj (E, H, I).
transformers' `integrations.mxfp4.convert_moe_packed_tensors` decodes the same bytes and then transposes the last
two dims into its in-memory (E, in, out) layout; tests/test_moe_parity.py holds the two to bit equality.

Kept packed in memory (`pack_experts_mxfp4`): the experts' weights of a converted gpt-oss model are MXFP4 values (the
Hub's bytes decoded), so `quantize_mxfp4` packs them back without loss, 4.25 bits per weight instead of bf16's 16
(about 3.8x less), and `MXFP4ExpertLinear` decodes one projection's weights per matmul (every dispatch path reads
`weight`; eager CPU inference, which reads the chosen experts by views, decodes only those). Frozen: the packed
weights are buffers, not parameters. With `--quantize mxfp4`: generation (generate/*.py, chat/base.py), evaluation
and serving (eval/lm_eval.py, eval/perplexity.py, serve/base.py: `lit_gpt.recipes.evaluate.EVAL_FLAGS`) load the
experts packed (below), LoRA (finetune/lora.py: the experts frozen packed, LoRA on the other layers, not with
--lora_experts) packs after loading (`lit_gpt.quantize`), on the CPU and CUDA (tests/test_moe_mxfp4.py); on XLA the
staged loader places the packed bytes (`lit_gpt.xla.loader`: xla/generate/*.py, evaluation and serving with
--accelerator xla, xla/finetune/lora.py; tests/xla/test_xla_mxfp4.py), and the decoder runs as one expression of
static shapes.

Kept packed on disk: conversion (`lit_gpt.convert_moe`) writes the Hub's bytes as they are, under the packed module's
own buffer names, `transformer.h.{i}.mlp.experts.{fc_1,fc_2,proj}.{blocks,scales}` (fc_1 / fc_2 the even / odd rows
of the Hub's interleaved gate_up: a row split of whole groups, no byte changes), so a converted gpt-oss reads 3.8x
fewer expert bytes. `fit_state` is the loading hook (`lit_gpt.weights.load_weights`, which every loader calls): for a
model that holds `MXFP4ExpertLinear`s (`packed_shells`, what `lit_gpt.loading.load_model(..., quantize="mxfp4")`
builds) the packed tensors fill its buffers as they are; for any other model they are decoded to `.weight` in the
dtype of the layer's bias (the checkpoint's float dtype), the values the bf16 conversion gave, so every recipe loads
either file. The other way, a decoded checkpoint (converted with --dequantize_mxfp4, or by an earlier version) loads
into a packed model packed on the fly (refused in one line where the weights are not MXFP4 values).
"""

import re
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.moe import ExpertLinear

# the 16 E2M1 codes: sign bit 3, then exponent (2 bits) and mantissa (1 bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"  # the Hub's names
PACKED = ("blocks", "scales")  # lit's: MXFP4ExpertLinear's buffers, and a converted checkpoint's tensor names
# the expert projections a checkpoint may hold packed (state-dict prefix, without .blocks/.scales/.weight)
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.(?:fc_1|fc_2|proj))\.(blocks|scales|weight)$")


def dequantized_shape(blocks_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return (*blocks_shape[:-2], blocks_shape[-2] * blocks_shape[-1] * 2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(..., G, B) packed bytes and (..., G) exponents -> (..., G * 2B) values in `dtype`, decoded one slice of
    the first dim (one expert) at a time, so that the float32 intermediates stay one expert's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 scales of shape {tuple(scales.shape)} do not match blocks of shape {tuple(blocks.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    if blocks.device.type not in ("cpu", "cuda", "meta"):
        # a traced backend (XLA): one expression of static shapes (the loop below would be one graph op per slice;
        # XLA fuses the float32 intermediates into the matmul's operand instead of holding them)
        packed = blocks.to(torch.int32)
        values = torch.stack((lut[packed & 0x0F], lut[packed >> 4]), dim=-1).flatten(-2)
        scale = torch.exp2(scales.to(torch.float32) - 127.0).unsqueeze(-1)  # 2**(s-127): exact in float32
        return (values * scale).to(dtype).flatten(-2)
    out = torch.empty(dequantized_shape(tuple(blocks.shape)), dtype=dtype, device=blocks.device)
    group_bytes = blocks.shape[-1]
    rows_b = blocks.reshape(-1, *blocks.shape[-2:]) if blocks.dim() > 2 else blocks.unsqueeze(0)
    rows_s = scales.reshape(-1, scales.shape[-1]) if blocks.dim() > 2 else scales.unsqueeze(0)
    n_slices = blocks.shape[0] if blocks.dim() > 2 else 1
    per_slice = rows_b.shape[0] // n_slices
    out_rows = out.view(rows_b.shape[0], rows_b.shape[1], 2 * group_bytes)
    for j in range(n_slices):
        sl = slice(j * per_slice, (j + 1) * per_slice)
        packed = rows_b[sl].to(torch.int64)
        values = torch.stack((lut[packed & 0x0F], lut[packed >> 4]), dim=-1)  # low nibble first
        exponent = rows_s[sl].to(torch.int32).sub(127).unsqueeze(-1)
        out_rows[sl] = torch.ldexp(values.flatten(-2), exponent).to(dtype)
    return out


def quantize_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float (..., K) -> MXFP4 blocks (..., K/32, 16) and scales (..., K/32), uint8: per group of 32 the smallest
    power of two that brings its largest magnitude to at most 6, each value the nearest E2M1 code, two codes per
    byte (the even element in the low nibble). Exact on values an MXFP4 tensor decodes to (a coarser scale of such a
    group only doubles codes <= 3, which stay codes). Encoded one slice of the first dim (one expert) at a time: the
    nearest-code search holds 16 float32 copies of what it encodes, which for a whole gpt-oss-120b projection
    would be over 100 GB."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 groups {GROUP} values along the last dim; {w.shape[-1]} is not a multiple")
    if w.dim() > 2:
        pairs = [quantize_mxfp4(w[j]) for j in range(w.shape[0])]
        return torch.stack([b for b, _ in pairs]), torch.stack([s for _, s in pairs])
    g = w.float().reshape(*w.shape[:-1], -1, GROUP)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    q = g / torch.exp2(e).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES, device=w.device)
    codes = (q.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e + 127).to(torch.uint8)


class MXFP4ExpertLinear(ExpertLinear):
    """An `ExpertLinear` whose (n_expert, out, in) weight stays MXFP4 in memory (`blocks`, `scales` buffers, frozen)
    and is decoded to `dtype` each time a matmul reads `weight`; the bias (gpt-oss's) stays as it was. `device`:
    where the packed buffers are made (the float weight is copied there one projection at a time)."""

    def __init__(self, linear: ExpertLinear, device: Optional[torch.device] = None) -> None:
        nn.Module.__init__(self)
        self.n_expert, self.in_features, self.out_features = linear.n_expert, linear.in_features, linear.out_features
        self.by_views = False
        self._dtype = linear.weight.dtype
        if linear.weight.device.type == "meta":  # a shell (`packed_shells`): the buffers come from the checkpoint
            shape = (self.n_expert, self.out_features, self.in_features // GROUP)
            blocks = torch.empty(*shape, GROUP // 2, dtype=torch.uint8, device="meta")
            scales = torch.empty(shape, dtype=torch.uint8, device="meta")
        else:
            blocks, scales = quantize_mxfp4(linear.weight.detach().to(device))
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)
        self.bias = linear.bias

    @property
    def dtype(self) -> torch.dtype:
        """What `weight` decodes to: the model's float dtype, followed through its casts (`_apply`: `model.to(dtype)`
        leaves the uint8 buffers alone); at first the float weight's it was packed from (or built as)."""
        return self.bias.dtype if self.bias is not None else self._dtype

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # the cast `fn` applies to float tensors (`.to(dtype)`, `.half()`, ...), seen on an empty one: a module
        # without a bias has no float tensor of its own to carry its dtype
        self._dtype = fn(torch.empty(0, dtype=self._dtype, device="cpu")).dtype
        return super()._apply(fn, recurse)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return dequantize_mxfp4(self.blocks, self.scales, self.dtype)

    def forward_selected(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if not self.by_views:
            return super().forward_selected(x, experts)
        # eager CPU inference (`lit_gpt.cpu_layout`): the parent reads `weight[e]` per row, which would decode every
        # expert once per row; decode only the chosen experts, once each (the same values, the same products)
        ids = experts.tolist()
        chosen = {e: dequantize_mxfp4(self.blocks[e: e + 1], self.scales[e: e + 1], self.dtype)[0] for e in set(ids)}
        rows = [F.linear(x[m], chosen[e], None if self.bias is None else self.bias[e]) for m, e in enumerate(ids)]
        return torch.stack(rows)

    def reset_parameters(self) -> None:  # the packed values are the weights; nothing to initialise
        pass


def pack_experts_mxfp4(model: nn.Module, device: Optional[torch.device] = None) -> int:
    """Every expert projection of `model` (`lit_gpt.moe.ExpertLinear`, not a LoRA one) packed as MXFP4 in place;
    returns the bytes of weights freed. Refused (ValueError, nothing changed) where a weight is not exactly MXFP4
    values: packing must not change the model (a gpt-oss checkpoint converted from the Hub holds such values).
    `device`: where the packed buffers go (default: where each weight is); the float weights stay where they are
    until they are dropped, so a GPU never holds more than one projection of them."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is ExpertLinear]
    packed = []
    for parent, name, child in targets:
        new = MXFP4ExpertLinear(child, device)
        if not torch.equal(new.weight, child.weight.detach().to(new.blocks.device)):
            raise ValueError(f"the expert weights of {name} are not MXFP4 values: packing them would change the model"
                             " (only experts converted from an MXFP4 checkpoint, gpt-oss's, pack without loss)")
        packed.append((parent, name, child, new))
    freed = 0
    for parent, name, child, new in packed:
        freed += child.weight.numel() * child.weight.element_size() - new.blocks.numel() - new.scales.numel()
        setattr(parent, name, new)
    return freed


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the MXFP4 experts' packed buffers in `model`."""
    return sum(m.blocks.numel() + m.scales.numel() for m in model.modules() if isinstance(m, MXFP4ExpertLinear))


def packed_shells(model: nn.Module) -> int:
    """Every expert projection of `model` (built on the meta device, not yet loaded) made an `MXFP4ExpertLinear`
    whose buffers the checkpoint fills as they are (`fit_state`): a packed run never holds the float experts.
    Returns how many; 0 for a model without experts."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is ExpertLinear]
    for parent, name, child in targets:
        if child.weight.device.type != "meta":
            raise ValueError("packed_shells takes a model on the meta device (before its weights are loaded)")
        setattr(parent, name, MXFP4ExpertLinear(child))
    return len(targets)


def holds_packed(model: nn.Module) -> bool:
    return any(isinstance(m, MXFP4ExpertLinear) for m in model.modules())


def packed_prefixes(state: Dict[str, torch.Tensor]) -> List[str]:
    """The expert projections `state` holds packed (`<prefix>.blocks` / `.scales`)."""
    return [m.group(1) for m in map(_EXPERT_RE.match, state) if m is not None and m.group(2) == "blocks"]


def fit_state(state: Dict[str, torch.Tensor], packed: bool = False, where: str = "the checkpoint"
              ) -> Dict[str, torch.Tensor]:
    """The loading hook (`lit_gpt.weights.load_weights`), in place: the experts of `state` in the form the model to
    load them takes. `packed=False` (a model of float experts): each packed projection decoded to `.weight`, in its
    bias's dtype (the checkpoint's float dtype; bf16 without a bias): the values and dtype the bf16 conversion gave.
    `packed=True` (a model of `MXFP4ExpertLinear`s, `packed_shells`): packed tensors are kept as they are; a decoded
    projection (an earlier version's conversion) is packed, refused in one line unless it is exactly MXFP4 values.
    A checkpoint without experts is returned as it is."""
    from lit_gpt.utils import LitError

    for prefix in packed_prefixes(state):
        blocks, scales = state[f"{prefix}.blocks"], state.get(f"{prefix}.scales")
        if scales is None:
            raise LitError(f"{where} has {prefix}.blocks without its .scales: it is incomplete, convert it again")
        if packed:  # kept: the shapes and dtypes checked here, as the decoder checks them
            if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
                raise LitError(f"{where}: {prefix}: MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales"
                               f" {scales.dtype} {tuple(scales.shape)} do not match; convert it again")
            continue
        bias = state.get(f"{prefix}.bias")
        dtype = bias.dtype if bias is not None and bias.is_floating_point() else torch.bfloat16
        try:
            state[f"{prefix}.weight"] = dequantize_mxfp4(blocks, scales, dtype)
        except ValueError as e:
            raise LitError(f"{where}: {prefix}: {e}; convert it again") from None
        del state[f"{prefix}.blocks"], state[f"{prefix}.scales"]
    if packed:
        for m in [m for m in map(_EXPERT_RE.match, list(state)) if m is not None and m.group(2) == "weight"]:
            weight = state[m.group(0)]
            if weight.dim() != 3 or not weight.is_floating_point():
                continue
            blocks, scales = quantize_mxfp4(weight)
            if not torch.equal(dequantize_mxfp4(blocks, scales, weight.dtype), weight):
                raise LitError("--quantize mxfp4: the experts of this checkpoint are not MXFP4 values (only a gpt-oss"
                               " checkpoint converted from the Hub's MXFP4 weights packs without loss): run without it")
            del state[m.group(0)]
            state[f"{m.group(1)}.blocks"], state[f"{m.group(1)}.scales"] = blocks, scales
    return state
