"""The dispatch paths of lit_gpt.moe against the reference loop ("loop": one matmul per expert's rows), on one
MoE layer (the CPU's "grouped" is torch._grouped_mm in float32, no host read): outputs and gradients on every path, the dropless layout's tile bound under adversarial routings, its
matmul FLOPs against the routed ones (CPU, torch's FLOP counter), which path "auto" takes where, and (slow) the eval
forward of a tiny Qwen3-MoE layout on XLA:CPU: XLA's cost analysis of the traced graph within 2x the routed
computation's (the capacity buffers of C = N, what evaluation ran before, ~8x or more) and the CPU loop's logits.
(The families' parity with transformers on every dispatch is tests/test_moe_parity.py.)"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lit_gpt import Config
from lit_gpt.moe import MoE, dropless_tiling

REPO = Path(__file__).resolve().parents[1]
PATHS = ["loop", "grouped", "dropless", "capacity", "gather", "dense"]
LAYOUTS = {  # (routing, activation, bias): Mixtral / Qwen3-MoE, and gpt-oss
    "softmax_topk": dict(moe_routing="softmax_topk", moe_activation="silu", moe_bias=False),
    "gpt_oss": dict(moe_routing="topk_softmax", moe_activation="clamped_swiglu", moe_bias=True),
}


def moe_layer(n_expert: int, k: int, seed: int = 0, **layout) -> MoE:
    torch.manual_seed(seed)
    config = Config(n_embd=16, n_layer=1, n_head=2, n_expert=n_expert, n_expert_per_token=k,
                    moe_intermediate_size=8, moe_capacity_factor=None, **layout)
    layer = MoE(config)
    if layout.get("moe_bias"):  # biases that matter (nn.init would leave the router's small)
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() <= 2 and p is not layer.router.weight:
                    p.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n_expert, k, n_tokens", [(64, 8, 37), (4, 2, 5), (8, 2, 64), (64, 8, 1)])
def test_every_path_gives_the_loops_outputs_and_gradients(layout, n_expert, k, n_tokens):
    layer = moe_layer(n_expert, k, **LAYOUTS[layout]).train()  # train: gradients; factor None: nothing dropped
    x = torch.randn(n_tokens, 16, generator=torch.Generator().manual_seed(1))
    results = {}
    for path in PATHS:
        layer.dispatch = path
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results[path] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
    ref_y, ref_gx, ref_gw = results["loop"]
    for path, (y, gx, gw) in results.items():
        torch.testing.assert_close(y, ref_y, atol=1e-6, rtol=1e-5, msg=f"{path} outputs")
        torch.testing.assert_close(gx, ref_gx, atol=1e-6, rtol=1e-5, msg=f"{path} input gradient")
        for name, g in gw.items():
            torch.testing.assert_close(g, ref_gw[name], atol=1e-6, rtol=1e-5, msg=f"{path} gradient of {name}")


@pytest.mark.parametrize("n_expert, k, n_tokens", [(64, 8, 9), (64, 8, 256), (128, 8, 1000), (8, 2, 3), (4, 2, 64)])
def test_dropless_tiles_hold_any_routing(n_expert, k, n_tokens):
    """The static tile count bounds the tiles of the worst routings: every expert with a group of 1 (max padding),
    all on one expert, one more than a tile each, and random ones."""
    A = n_tokens * k
    m, tiles = dropless_tiling(A, n_expert)
    assert m * n_expert <= A // 2 + n_expert  # padding under half the assignments (+ rounding)
    g = torch.Generator().manual_seed(0)
    worst = [torch.ones(min(n_expert, A), dtype=torch.long)]
    worst[0][0] += A - worst[0].sum()
    worst.append(torch.tensor([A]))
    if A >= (m + 1) * n_expert:
        rest = torch.full((n_expert,), m + 1)
        rest[0] += A - rest.sum()
        worst.append(rest)
    worst += [torch.bincount(torch.randint(0, n_expert, (A,), generator=g), minlength=n_expert) for _ in range(20)]
    for counts in worst:
        assert int(counts.sum()) == A
        assert int(((counts + m - 1) // m).sum()) <= tiles


def test_the_worst_routing_runs_through_the_dropless_tiles():
    """Every token to the same k experts (8 groups of 300 rows, 56 empty), and a random routing: the loop's outputs."""
    layer = moe_layer(64, 8).eval()
    for bias in (torch.arange(64.0) * 100, torch.zeros(64)):  # a router bias that picks experts 56-63 for all
        layer.router = torch.nn.Linear(16, 64, bias=True)
        with torch.no_grad():
            layer.router.weight.normal_(0, 0.01 if bias.any() else 1.0)
            layer.router.bias.copy_(bias)
        x = torch.randn(300, 16, generator=torch.Generator().manual_seed(2))
        layer.dispatch = "loop"
        ref = layer(x)
        layer.dispatch = "dropless"
        torch.testing.assert_close(layer(x), ref, atol=1e-6, rtol=1e-5)


def _matmul_flops(layer: MoE, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(x)
    return counter.get_total_flops()


def test_dropless_computes_about_the_routed_flops_and_capacity_every_expert_on_every_token():
    """A Qwen3-MoE layout (64 experts, top 8), 256 tokens: the dropless tiles' matmuls cost <= 1.6x the routed
    ones (router + k experts per token); the capacity buffers of evaluation (C = N) cost 8x (E / k)."""
    E, k, n, h, inter = 64, 8, 256, 16, 8
    layer = moe_layer(E, k).eval()
    x = torch.randn(n, h)
    router = 2 * n * h * E
    routed = router + 2 * n * k * 3 * h * inter
    flops = {}
    for path in ("dropless", "capacity", "gather"):
        layer.dispatch = path
        flops[path] = _matmul_flops(layer, x)
    assert flops["gather"] == routed  # the gather path computes exactly the routed rows
    assert flops["dropless"] <= 1.6 * routed, flops
    assert flops["capacity"] - router == 2 * n * E * 3 * h * inter  # C = N rows per expert: E / k x the routed


def test_grouped_takes_torch_grouped_mm_without_a_host_read(monkeypatch):
    """On the CPU in float32 "grouped" is one torch._grouped_mm per projection, the group ends a tensor: the loop's
    host read of the group sizes (`group_bounds`) never runs; in bf16 (rows of 32 bytes here) it falls back to it."""
    import lit_gpt.moe as moe

    layer = moe_layer(8, 2).eval()
    layer.dispatch = "grouped"
    calls = {"grouped_mm": 0, "bounds": 0}
    real_mm, real_bounds = torch._grouped_mm, moe.group_bounds
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: (calls.__setitem__("grouped_mm", calls["grouped_mm"] + 1),
                                                                real_mm(*a, **kw))[1])
    monkeypatch.setattr(moe, "group_bounds", lambda *a: (calls.__setitem__("bounds", calls["bounds"] + 1),
                                                         real_bounds(*a))[1])
    layer(torch.randn(32, 16))
    assert calls == {"grouped_mm": 3, "bounds": 0}
    layer.to(torch.bfloat16)(torch.randn(32, 16, dtype=torch.bfloat16))
    assert calls == {"grouped_mm": 3, "bounds": 1}


@pytest.mark.parametrize("training, factor, compiling, n_tokens, expected", [
    (False, 2.0, True, 64, "dropless"),  # a traced graph in evaluation (XLA, torch.compile): never drops
    (True, None, True, 64, "dropless"),  # training with --moe.capacity_factor none
    (True, 2.0, True, 64, "capacity"),  # training in a traced graph: the capacity buffers
    (False, 2.0, False, 64, "grouped"),  # eager CPU
    (True, 2.0, False, 64, "grouped"),
    (False, 2.0, True, 2, "gather"),  # a decode step (N * k <= E)
])
def test_auto_picks_the_path(monkeypatch, training, factor, compiling, n_tokens, expected):
    layer = moe_layer(16, 2).train(training)
    layer.capacity_factor = factor
    taken = []
    for path in ("grouped", "loop", "dropless", "capacity", "gather"):
        method = getattr(layer, f"_{path}")
        monkeypatch.setattr(layer, f"_{path}", lambda *a, _m=method, _p=path: (taken.append(_p), _m(*a))[1])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    layer(torch.randn(n_tokens, 16))
    assert taken == [expected]


# ----------------------------------------------------------------------------------------------- XLA:CPU (slow)

def xla_probe(out: str) -> None:
    """Run in a process of its own (PJRT_DEVICE=CPU): the eval forward of a tiny Qwen3-MoE layout (2 MoE layers, 64
    experts, top 8, 4 x 64 tokens) on XLA with each path; XLA's cost analysis of each traced graph, and its logits
    against the CPU loop's."""
    import _XLAC
    import jax
    import torch_xla
    import torch_xla.debug.metrics as met
    from jax._src.lib import xla_client

    from lit_gpt import GPT

    config = Config.from_name("Qwen3-30B-A3B", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                              vocab_size=256, block_size=64, n_expert=64, n_expert_per_token=8,
                              moe_intermediate_size=32)
    torch.manual_seed(0)
    model = GPT(config).eval()
    model.apply(model._init_weights)
    idx = torch.randint(0, 256, (4, 64))
    for m in model.modules():
        if isinstance(m, MoE):
            m.dispatch = "loop"
    with torch.no_grad():
        reference = model(idx)
    client = jax.devices("cpu")[0].client
    model = model.to(torch_xla.device())
    x = idx.to(torch_xla.device())
    result = {}
    for path in ("auto", "gather", "dropless", "capacity"):
        for m in model.modules():
            if isinstance(m, MoE):
                m.dispatch = path
        met.clear_all()
        with torch.no_grad():
            logits = model(x)
        proto = _XLAC._get_xla_tensors_hlo_proto([logits])
        module = xla_client.XlaComputation(proto).get_hlo_module()
        flops = xla_client._xla.hlo_module_cost_analysis(client, module)["flops"]
        error = float((logits.cpu() - reference).abs().max())
        fallbacks = [name for name in met.counter_names() if name.startswith("aten::")]
        result[path] = {"flops": flops, "max_error": error, "fallbacks": fallbacks}
    expert = 2 * 4 * 64 * 8 * 3 * 64 * 32 * 2  # the routed experts' matmuls: tokens x k x 3 matmuls x 2 layers
    result["routed_expert_flops"] = expert
    Path(out).write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_xla_eval_forward_costs_within_2x_the_routed_flops_and_equals_the_cpu_loop(tmp_path):
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_"))}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS="--xla_backend_optimization_level=0",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO), env.get("PYTHONPATH", "")]))
    code = f"import test_moe_dispatch as t; t.xla_probe({str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    routed = r["gather"]["flops"]  # the whole forward with each token through its k experts only, as XLA counts it
    assert r["auto"]["flops"] == r["dropless"]["flops"]  # evaluation on XLA takes the dropless tiles
    assert r["dropless"]["flops"] <= 2 * routed, r
    assert r["dropless"]["flops"] - routed <= r["routed_expert_flops"]  # the padding: under one more routed pass
    assert r["capacity"]["flops"] >= 4 * routed, r  # what evaluation on XLA ran before (C = N)
    for path in ("auto", "gather", "dropless", "capacity"):
        assert r[path]["max_error"] < 1e-4, (path, r[path])
        assert not r[path]["fallbacks"], (path, r[path])  # no op fell back to the CPU
