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
megablox cuts the rows into m-tiles and refuses rows that are not a whole number of them ("3048 must be divisible by
x-dimension tile size (512)": torch_xla's tgmm tiles by 512, and gmm's own default m-tile of 128-384 need not divide
the rows either), while the dispatch's row count is any multiple of its own tile: `pallas_gmm` pads the rows with zeros
to a whole number of 512-row tiles (to a multiple of 8 under 512 rows), counts them in the last group (zero rows give
zero outputs and add nothing to the weights' gradient) and passes that m-tile to both kernels.
"""

from typing import Any, Tuple

import torch
import torch.nn as nn


def device_type() -> str:
    """The PJRT device kind ("TPU", "CPU", "CUDA")."""
    import torch_xla.runtime as xr

    return xr.device_type()


TILE_M = 512  # the kernels' m-tile: tgmm's default and the most gmm picks itself


def _tile_128(dim: int, limit: int = 2048) -> int:
    """torch_xla's k/n tile for gmm: the dimension rounded up to 128, at most `limit` (megablox masks the rest)."""
    return min(-(-dim // 128) * 128, limit)


def _tiling(rows: int, k: int, n: int) -> Tuple[int, int, int]:
    """(tm, tk, tn) for `rows` rows, already a whole number of m-tiles (`_padded_rows`)."""
    return min(TILE_M, rows), _tile_128(k), _tile_128(n)


def _padded_rows(rows: int) -> int:
    """`rows` rounded up to whole m-tiles: a multiple of `TILE_M`, or of 8 (a TPU sublane) for fewer rows."""
    multiple = TILE_M if rows > TILE_M else 8
    return -(-rows // multiple) * multiple


class _GMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        from torch_xla.experimental import custom_kernel as ck

        ctx.save_for_backward(x, weight, sizes)
        tiling = _tiling(x.shape[0], x.shape[1], weight.shape[1])
        return ck.gmm(x, weight, sizes, tiling=tiling, transpose_rhs=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        from torch_xla.experimental import custom_kernel as ck

        x, weight, sizes = ctx.saved_tensors
        rows, out_features, in_features = x.shape[0], weight.shape[1], weight.shape[2]
        grad_x = (ck.gmm(grad, weight, sizes, tiling=_tiling(rows, out_features, in_features))
                  if ctx.needs_input_grad[0] else None)
        grad_w = (ck.tgmm(grad.t(), x, sizes, tiling=(min(TILE_M, rows), TILE_M, TILE_M))
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w, None


def pallas_gmm(x: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """x (S, in) rows sorted by expert in groups of `sizes` (E,) int32 summing to S, weight (E, out, in) -> (S, out):
    each group times its expert's matrix transposed (`MoE.grouped_kernel`), differentiable in x and weight. Rows are
    padded to whole m-tiles for the kernels and cut again (the module docstring says why)."""
    rows = x.shape[0]
    pad = _padded_rows(rows) - rows
    if pad == 0:
        return _GMM.apply(x, weight, sizes)
    last = torch.nn.functional.one_hot(torch.tensor(sizes.shape[0] - 1, device=sizes.device), sizes.shape[0])
    padded = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return _GMM.apply(padded, weight, sizes + (last * pad).to(sizes.dtype))[:rows]


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
