"""Packed rows on TPUs: torch_xla's Pallas flash attention with segment ids (`q_segment_ids`, `kv_segment_ids`), in
place of the dense (T, T) document mask (`lit_gpt.packing.document_mask`), which costs T^2 memory per row and
head-less but full attention FLOPs. Installed as `GPT.segment_attention` by the XLA strategy when the device is a
TPU and the kernel imports; XLA:CPU and XLA:GPU keep the dense mask (the kernel is TPU-only).

Not run here: no TPU in this project's test machines; the dense path is what the tests check on XLA:CPU, and the
kernel's equality with it is a TPU check (tests/xla/test_xla_packing.py says so)."""

from typing import Any, Callable, Optional

import torch


def tpu_segment_attention(mesh: Any = None, batch_axes: Any = None) -> Optional[Callable[..., torch.Tensor]]:
    """`attend(q, k, v, segments, scale)` on a TPU, None elsewhere (or when the kernel is missing)."""
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return None
    try:
        from torch_xla.experimental.custom_kernel import flash_attention
    except ImportError:
        return None
    return segment_attention(flash_attention, mesh, batch_axes)


def segment_attention(kernel: Callable[..., torch.Tensor], mesh: Any = None, batch_axes: Any = None
                      ) -> Callable[..., torch.Tensor]:
    """Wrap a flash kernel of torch_xla's signature: equal heads for k and v (GQA repeated), causal within each
    document, the batch dimension split over the SPMD mesh like the activations."""
    spec = (batch_axes, None, None, None) if mesh is not None else None

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float
               ) -> torch.Tensor:
        if k.size(1) != q.size(1):
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        return kernel(q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments, sm_scale=scale,
                      partition_spec=spec, mesh=mesh)

    return attend
