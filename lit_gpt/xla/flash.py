"""Packed rows on XLA without the dense (T, T) document mask (`lit_gpt.packing.document_mask`, T^2 memory per row).

* TPU: torch_xla's Pallas flash attention with segment ids (`q_segment_ids`, `kv_segment_ids`), for the plain causal
  layers (the kernel has no sliding window, soft-capping or sinks: those layers take the blockwise path below).
  Not run here: no TPU in this project's test machines; its plumbing is tested with a dense stand-in of the same
  signature (tests/test_packing.py), its numbers are a TPU check.
* Elsewhere (XLA:CPU, XLA:GPU) and for the TPU's other layers: `blockwise_segment_attention`, the same math in
  query blocks of static shape, each with the mask of its block built from the segment ids (and the window),
  so that the train step stays one graph and no (T, T) mask exists: a block's mask is (block, keys it can see),
  T x block x ... summed over the blocks of a causal layer (half of T^2 over the step, one block at a time), and
  O(T (block + window)) for a sliding-window layer, whose blocks see only their window's keys."""

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from lit_gpt.attention import sink_attention, softcapped_attention

BLOCK = 512
"""Query positions per block of the blockwise path: a row of up to BLOCK positions is one block (the dense math)."""


def tpu_segment_attention(mesh: Any = None, batch_axes: Any = None) -> Callable[..., torch.Tensor]:
    """`attend(q, k, v, segments, scale, **layer)`: the flash kernel on a TPU for plain causal layers (the blockwise
    path for the others), the blockwise path elsewhere or when the kernel is missing."""
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return blockwise_segment_attention()
    try:
        from torch_xla.experimental.custom_kernel import flash_attention
    except ImportError:
        return blockwise_segment_attention()
    return segment_attention(flash_attention, mesh, batch_axes)


def segment_attention(kernel: Callable[..., torch.Tensor], mesh: Any = None, batch_axes: Any = None
                      ) -> Callable[..., torch.Tensor]:
    """Wrap a flash kernel of torch_xla's signature: equal heads for k and v (GQA repeated), causal within each
    document, the batch dimension split over the SPMD mesh like the activations."""
    spec = (batch_axes, None, None, None) if mesh is not None else None
    fallback = blockwise_segment_attention()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float, **layer: Any
               ) -> torch.Tensor:
        if layer:  # a sliding window, soft-capping or sinks: not the kernel's
            return fallback(q, k, v, segments, scale, **layer)
        if k.size(1) != q.size(1):
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        # int32 ids: the collated rows' int64 ids reach the Mosaic kernel as s64 operands, which the TPU compiler
        # refuses ("While rewriting computation to not contain X64 element types ... not implemented": found by
        # compiling a packed step for v5e-8 with xla/scripts/plan.py --packing true)
        segments = segments.to(torch.int32)
        return kernel(q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments, sm_scale=scale,
                      partition_spec=spec, mesh=mesh)

    attend.any_layer = True  # type: ignore[attr-defined]
    return attend


def blockwise_segment_attention(block: int = BLOCK) -> Callable[..., torch.Tensor]:
    """`attend(q, k, v, segments, scale, window=None, softcapping=None, sinks=None)` -> (B, n_head, T, hs): causal
    attention within each document (equal segment ids), in query blocks of `block` positions. Every block's shape is
    fixed by T (a Python int in the traced graph): one graph, whatever the documents. A block sees the keys from
    its window's start (0 without a window) to its own end; its mask comes from the segment ids of those."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float,
               window: Optional[int] = None, softcapping: Optional[float] = None,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = q.size(2)
        pos = torch.arange(T, device=q.device)
        outs = []
        for start in range(0, T, block):
            stop, first = min(start + block, T), 0 if window is None else max(0, start - window + 1)
            diff = pos[start:stop].unsqueeze(-1) - pos[first:stop]
            visible = diff >= 0 if window is None else (diff >= 0) & (diff < window)
            mask = (segments[:, start:stop].unsqueeze(-1) == segments[:, first:stop].unsqueeze(-2)) & visible
            qb, kb, vb, mask = q[:, :, start:stop], k[:, :, first:stop], v[:, :, first:stop], mask.unsqueeze(1)
            if sinks is not None:
                outs.append(sink_attention(qb, kb, vb, mask, scale, sinks))
            elif softcapping is not None:
                outs.append(softcapped_attention(qb, kb, vb, mask, scale, softcapping))
            else:
                outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                                           enable_gqa=k.size(1) != q.size(1)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    attend.any_layer = True  # type: ignore[attr-defined]
    return attend
