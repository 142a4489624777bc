"""The TPU's grouped matmul for the mixture-of-experts dropless dispatch: torch_xla's Pallas `gmm` / `tgmm`
(`torch_xla.experimental.custom_kernel`, megablox's kernels called through jax).

The dropless path (lit_gpt.moe, "dropless") sorts the N*k assignments by expert and pads each expert's group to
whole tiles; without a kernel it multiplies tile by tile with the tile's expert's weights gathered (a batched matmul:
XLA:CPU and GPUs). On a TPU, `use_pallas_gmm` gives every MoE layer `grouped_kernel = pallas_gmm`, which multiplies
the same sorted rows, each expert's group with that expert's weights read in place:
    forward       y = gmm(x, W, sizes, transpose_rhs=True)     x (S, in), W (E, out, in) -> (S, out)
    backward      dx = gmm(dy, W, sizes)                       (S, out) x (E, out, in) -> (S, in)
                  dW = tgmm(dy^T, x, sizes)                    (out, S) x (S, in) -> (E, out, in)
The group sizes are a device tensor (int32): no host read, one graph per shape. XLA:CPU keeps the batched matmuls.
"""

from typing import Any

import torch
import torch.nn as nn


def device_type() -> str:
    """The PJRT device kind ("TPU", "CPU", "CUDA")."""
    import torch_xla.runtime as xr

    return xr.device_type()


class _GMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        from torch_xla.experimental import custom_kernel as ck

        ctx.save_for_backward(x, weight, sizes)
        return ck.gmm(x, weight, sizes, transpose_rhs=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        from torch_xla.experimental import custom_kernel as ck

        x, weight, sizes = ctx.saved_tensors
        grad_x = ck.gmm(grad, weight, sizes) if ctx.needs_input_grad[0] else None
        grad_w = ck.tgmm(grad.t(), x, sizes) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def pallas_gmm(x: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """x (S, in) rows sorted by expert in groups of `sizes` (E,) int32 summing to S, weight (E, out, in) -> (S, out):
    each group times its expert's matrix transposed (`MoE.grouped_kernel`), differentiable in x and weight."""
    return _GMM.apply(x, weight, sizes)


def use_pallas_gmm(model: nn.Module) -> bool:
    """On a TPU (with jax, which torch_xla calls the kernels through), every MoE layer of `model` runs its dropless
    dispatch through `pallas_gmm`; elsewhere nothing changes. Returns whether it was installed."""
    import importlib.util

    from lit_gpt.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers or device_type() != "TPU" or importlib.util.find_spec("jax") is None:
        return False
    for layer in layers:
        layer.grouped_kernel = pallas_gmm
    return True
