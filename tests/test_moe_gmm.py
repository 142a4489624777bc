"""The TPU's Pallas grouped matmul (`lit_gpt.xla.moe_gmm`, torch_xla's `gmm`/`tgmm`) as the dropless dispatch's
kernel, wired without a TPU: the device kind is made "TPU" and the two kernels are replaced by references with their
signatures (torch's grouped matmul on the CPU; tgmm a loop over the groups). `use_pallas_gmm` installs the kernel;
the dropless layer then calls gmm with the sorted, padded rows (S, in), the experts' (E, out, in) weights with
transpose_rhs, and int32 group sizes summing to S, and its outputs and gradients (tgmm for the weights) equal the
batched-matmul fallback's. Off a TPU nothing is installed."""

import pytest
import torch

from lit_gpt import Config
from lit_gpt.moe import MoE, dropless_tiling
from tolerance import fp32_tolerance

ck = pytest.importorskip("torch_xla.experimental.custom_kernel")


def megablox_m_tile(rows, tiling):
    """The m-tile megablox cuts the rows into (torch_xla passes min(tm, rows)); it raises "... must be divisible by
    x-dimension tile size" unless the rows are a whole number of tiles."""
    assert tiling is not None, "pass the tiling: gmm's own m-tile (128-384) need not divide the rows"
    tm = min(tiling[0], rows)
    assert rows % tm == 0, f"{rows} must be divisible by x-dimension tile size ({tm})"
    return tm


def gmm_reference(lhs, rhs, group_sizes, tiling=None, group_offset=None, transpose_rhs=False):
    """torch_xla's gmm: lhs[sizes[i-1]:sizes[i]] @ rhs[i] (rhs[i].T with transpose_rhs)."""
    assert lhs.dim() == 2 and rhs.dim() == 3 and group_sizes.dtype == torch.int32
    assert int(group_sizes.sum()) == lhs.size(0)  # megablox's groups cover the rows
    megablox_m_tile(lhs.size(0), tiling)
    rhs = rhs.transpose(1, 2) if transpose_rhs else rhs
    return torch._grouped_mm(lhs, rhs.contiguous(), offs=group_sizes.cumsum(0).to(torch.int32))


def tgmm_reference(lhs, rhs, group_sizes, tiling=(512, 512, 512), group_offset=None, num_actual_groups=None):
    """torch_xla's tgmm: lhs[:, sizes[i-1]:sizes[i]] @ rhs[sizes[i-1]:sizes[i]] -> (groups, k, n)."""
    megablox_m_tile(rhs.size(0), tiling)
    ends = group_sizes.cumsum(0).tolist()
    starts = [0] + ends[:-1]
    return torch.stack([lhs[:, s:t] @ rhs[s:t] for s, t in zip(starts, ends)])


@pytest.mark.parametrize("bias", [False, True])
def test_tpu_dropless_dispatch_runs_gmm_and_equals_the_fallback(monkeypatch, bias):
    import lit_gpt.xla.moe_gmm as moe_gmm

    calls = []

    def gmm(lhs, rhs, group_sizes, *args, **kwargs):
        calls.append((tuple(lhs.shape), tuple(rhs.shape), kwargs.get("transpose_rhs", False), group_sizes.clone()))
        return gmm_reference(lhs, rhs, group_sizes, *args, **kwargs)

    monkeypatch.setattr(ck, "gmm", gmm)
    monkeypatch.setattr(ck, "tgmm", tgmm_reference)
    torch.manual_seed(0)
    E, k, n, H, inter = 8, 2, 24, 16, 8
    config = Config(n_embd=H, n_layer=1, n_head=2, n_expert=E, n_expert_per_token=k, moe_intermediate_size=inter,
                    moe_capacity_factor=None, moe_dispatch="dropless", moe_bias=bias)
    layer = MoE(config).train()
    if bias:
        with torch.no_grad():
            for lin in (layer.experts.fc_1, layer.experts.fc_2, layer.experts.proj):
                lin.bias.normal_(0, 0.5)
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(1))

    def run():
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return y.detach(), xi.grad, {name: p.grad.clone() for name, p in layer.named_parameters()}

    fallback = run()
    monkeypatch.setattr(moe_gmm, "device_type", lambda: "CPU")
    assert not moe_gmm.use_pallas_gmm(layer) and layer.grouped_kernel is None  # XLA:CPU keeps the batched path
    monkeypatch.setattr(moe_gmm, "device_type", lambda: "TPU")
    assert moe_gmm.use_pallas_gmm(layer) and layer.grouped_kernel is moe_gmm.pallas_gmm
    kernel = run()
    m, tiles = dropless_tiling(n * k, E)
    # forward: fc_1, fc_2 (S, H) x (E, inter, H), proj (S, inter) x (E, H, inter); backward: the input gradients
    forward = [c for c in calls if c[2]]
    rows = moe_gmm._padded_rows(tiles * m)  # the dispatch's rows, padded to whole m-tiles of the kernel
    assert tiles * m <= rows < tiles * m + 8
    assert [c[:2] for c in forward] == [((rows, H), (E, inter, H))] * 2 + [((rows, inter), (E, H, inter))]
    assert len(calls) == 6  # + gmm(dy, W) for each projection's input gradient
    sizes = forward[0][3]
    assert sizes.dtype == torch.int32 and int(sizes.sum()) == rows and bool((sizes[:-1] % m == 0).all())
    torch.testing.assert_close(kernel[0], fallback[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernel[1], fallback[1], rtol=1e-5, atol=1e-6)
    for name in fallback[2]:
        torch.testing.assert_close(kernel[2][name], fallback[2][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("rows", [600, 3048, 1024, 13])
def test_rows_that_are_not_whole_kernel_tiles_are_padded_and_cut(monkeypatch, rows):
    """A dispatch's row count need not be a whole number of the kernels' 512-row tiles (3048 rows: a 2-layer
    Qwen3-MoE-shaped plan at 8 x 128 tokens, which megablox refused): `pallas_gmm` pads with zero rows counted in the
    last group and cuts them off again; outputs and gradients equal each group's matmul."""
    import lit_gpt.xla.moe_gmm as moe_gmm

    monkeypatch.setattr(ck, "gmm", gmm_reference)
    monkeypatch.setattr(ck, "tgmm", tgmm_reference)
    g = torch.Generator().manual_seed(0)
    E, k, n = 4, 16, 8
    x = torch.randn(rows, k, generator=g, requires_grad=True)
    w = torch.randn(E, n, k, generator=g, requires_grad=True)
    sizes = torch.tensor([rows // 3, 0, rows - rows // 3 - rows // 4, rows // 4], dtype=torch.int32)
    y = moe_gmm.pallas_gmm(x, w, sizes)
    dy = torch.randn(rows, n, generator=g)
    (y * dy).sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ends = sizes.cumsum(0).tolist()
    y_ref = torch.cat([x_ref[s:t] @ w_ref[e].T for e, (s, t) in enumerate(zip([0] + ends[:-1], ends))])
    (y_ref * dy).sum().backward()
    assert y.shape == (rows, n)
    # float32 both ways, summed in other orders (torch's grouped matmul against a matmul per group): the fp32 bound
    for got, want, reduction in ((y, y_ref, k), (x.grad, x_ref.grad, n), (w.grad, w_ref.grad, rows)):
        torch.testing.assert_close(got, want, rtol=0, atol=fp32_tolerance(reduction, want.abs().max()))
