"""Packed rows' attention without a (T, T) mask (lit_gpt.packing.document_attention, `GPT.packed_attention =
"documents"`, what the default "auto" takes on the CPU; CUDA's FlexAttention: tests/test_flex_attention.py): one
document at a time, equal in outputs and gradients to SDPA with the
dense document mask (`packed_attention = "mask"`, the old path) within float32's rounding (tests/tolerance.py), and
so is XLA's blockwise path (lit_gpt.xla.flash.blockwise_segment_attention, run eagerly here), for
plain causal, sliding-window (documents longer than the window: query chunks), soft-capped and attention-sink
layers; equal at the model level for the dense, sliding-window, soft-capped, no-RoPE-layer and sink families; and no
tensor of T x T elements anywhere in a packed forward and backward (the old path has one)."""

from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lit_gpt import GPT
from lit_gpt.attention import sink_attention, softcapped_attention
from lit_gpt.losses import loss_sum
from lit_gpt.packing import DocumentSpans, collate_packed, document_attention, document_mask, document_spans
from lit_gpt.xla.flash import blockwise_segment_attention
from test_packing import samples_of
from tolerance import fp32_tolerance
from variants import randomize_, tiny_config


def test_document_spans_are_the_runs_of_equal_ids_padding_included():
    segments = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    assert document_spans(segments) == (((0, 3), (3, 5), (5, 6)), ((0, 6),))


def dense(q, k, v, segments, scale, window, cap, sinks):
    """The old path: the (B, 1, T, T) document mask into SDPA or the eager soft-cap / sink attention."""
    mask = document_mask(segments, None, window)
    if sinks is not None:
        return sink_attention(q, k, v, mask, scale, sinks)
    if cap is not None:
        return softcapped_attention(q, k, v, mask, scale, cap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.size(1) != q.size(1))


@pytest.mark.parametrize("window", [None, 3, 8], ids=["causal", "window3", "window8"])
@pytest.mark.parametrize("kind", ["sdpa", "softcap", "sinks"])
def test_document_attention_equals_the_dense_mask_with_gradients(kind, window):
    torch.manual_seed(0)
    # two rows: documents shorter and longer than the windows, a one-token document, padding at the end
    lengths = [[5, 1, 17, 9], [20, 7, 5]]
    T = 32
    segments = torch.zeros(2, T, dtype=torch.long)
    for b, row in enumerate(lengths):
        at = 0
        for d, n in enumerate(row, start=1):
            segments[b, at : at + n] = d
            at += n
    B, H, G, hs = 2, 4, 2, 16
    q, k, v = (torch.randn(B, n, T, hs, requires_grad=True) for n in (H, G, G))
    sinks = torch.randn(H, requires_grad=True) if kind == "sinks" else None
    cap = 2.0 if kind == "softcap" else None
    scale = hs**-0.5
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    weight = torch.randn(B, H, T, hs)  # a loss that weighs every output differently

    def run(fn):
        out = fn()
        grads = torch.autograd.grad((out * weight).sum(), inputs)
        return out.detach(), grads

    old, old_grads = run(lambda: dense(q, k, v, segments, scale, window, cap, sinks))
    layer = {n: x for n, x in dict(window=window, softcapping=cap, sinks=sinks).items() if x is not None}
    tol = fp32_tolerance(T, old.abs().max())
    for new, new_grads in (  # by document (eager backends), and XLA's blockwise path in blocks of 8 queries
        run(lambda: document_attention(q, k, v, DocumentSpans(document_spans(segments), window), scale, cap, sinks)),
        run(lambda: blockwise_segment_attention(8)(q, k, v, segments, scale, **layer)),
    ):
        assert (new - old).abs().max() <= tol
        for a, b in zip(new_grads, old_grads):
            assert (a - b).abs().max() <= fp32_tolerance(T * hs, b.abs().max())
    # a wrong window (or none) is far outside that tolerance: the comparison can fail
    wrong = document_attention(q, k, v, DocumentSpans(document_spans(segments), 2 if window else 4), scale, cap, sinks)
    assert (wrong - old).abs().max() > 100 * tol


def packed_loss_and_grads(model: GPT, batch: Dict[str, torch.Tensor], path: str):
    model.packed_attention = path
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, batch["input_ids"], batch["labels"], targets_only=False, positions=batch["positions"],
                    segments=batch["segments"])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,extra", [
    ("TinyLlama-1.1B-Chat-v1.0", {}),  # dense, GQA
    ("Mistral-7B-v0.1", {}),  # every layer sliding (window 4 < the documents)
    ("gemma-2-2b", {}),  # soft-capping, alternating sliding / global layers
    ("gemma-3-4b-it", {}),  # sliding layers with their own RoPE base
    ("SmolLM3-3B", {}),  # a layer without RoPE
    ("Mistral-7B-v0.1", {"attention_sinks": True}),  # gpt-oss's attention: sinks on sliding layers
], ids=["dense", "sliding", "softcap", "gemma3", "norope", "sinks"])
def test_the_documents_path_equals_the_mask_path_in_a_model(family, extra):
    torch.manual_seed(0)
    model = GPT(tiny_config(family, **extra))
    randomize_(model)
    model.float().train()
    assert all(b.attn.sinks is not None for b in model.transformer.h) == bool(extra)
    samples = samples_of([5, 9, 13, 3, 20, 7, 11], seed=4)
    batch = collate_packed([samples[:3], samples[3:6], samples[6:]], 32)
    old_loss, old_grads = packed_loss_and_grads(model, batch, "mask")
    runs = [packed_loss_and_grads(model, batch, "documents")]
    model.segment_attention = blockwise_segment_attention(8)  # XLA's path (on every layer), here in eager CPU
    runs.append(packed_loss_and_grads(model, batch, "documents"))
    for new_loss, new_grads in runs:
        assert abs(new_loss - old_loss) <= fp32_tolerance(64 * 32, old_loss.abs())
        assert new_grads.keys() == old_grads.keys() and new_grads
        for name, g in old_grads.items():
            assert (new_grads[name] - g).abs().max() <= fp32_tolerance(64 * 32, g.abs().max()) * 10, name


class LargestTensor(TorchDispatchMode):
    """The largest tensor (in elements) any operation creates, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("family", ["TinyLlama-1.1B-Chat-v1.0", "gemma-2-2b"], ids=["dense", "softcap_sliding"])
def test_no_tensor_of_t_by_t_elements_in_a_packed_step(family):
    """A row of 1024 positions holding documents of 100 tokens: the documents path's largest tensor is a per-position
    projection (T x 256 here, a quarter of T x T; the soft-capped eager attention holds one document's scores at
    a time), while the old path's mask is T x T."""
    T = 1024
    config = tiny_config(family, block_size=T)
    model = GPT(config)
    lengths: List[int] = [101] * 10 + [15]  # ten documents of 100 inputs, then 14, then padding
    batch = collate_packed([samples_of(lengths)], T)
    sizes = {}
    # the old path once (on the cheaper family): it is what the bound tells apart
    for path in ("documents", "mask") if family.startswith("Tiny") else ("documents",):
        model.packed_attention = path
        with LargestTensor() as mode:
            loss_sum(model, batch["input_ids"], batch["labels"], targets_only=False, positions=batch["positions"],
                     segments=batch["segments"]).backward()
        sizes[path] = mode.largest
    assert sizes.get("mask", T * T) >= T * T
    # the documents path's largest are per-position projections (T x 256 here: qkv), far from T x T
    assert sizes["documents"] <= T * 256 < T * T // 2, sizes


XLA_WORKER = """
import json, re, sys, torch, torch_xla, torch_xla.debug.metrics as met
from lit_gpt import GPT
from lit_gpt.losses import loss_sum
from lit_gpt.packing import collate_packed
from lit_gpt.xla.flash import blockwise_segment_attention, tpu_segment_attention
from test_packing import samples_of
from variants import randomize_, tiny_config

torch.manual_seed(0)
cpu = GPT(tiny_config("gemma-2-2b", block_size=64))  # soft-capping, alternating sliding / global layers
randomize_(cpu)
installed = tpu_segment_attention()  # what the XLA strategy installs: off a TPU, the blockwise path
device = torch_xla.device()
model = GPT(tiny_config("gemma-2-2b", block_size=64)).to(device)
model.load_state_dict({k: v.to(device) for k, v in cpu.state_dict().items()})
model.segment_attention = blockwise_segment_attention(16)  # four blocks of a 64-position row
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
out = {"any_layer": getattr(installed, "any_layer", False), "compiles": [], "rel": []}
for step, lengths in enumerate([[20, 30, 9, 8], [60, 5], [7, 7, 7, 7, 7, 7, 7, 7, 7]]):
    batch = collate_packed([samples_of(lengths, seed=step)] * 2, 64)
    expected = loss_sum(cpu, batch["input_ids"], batch["labels"], targets_only=False, positions=batch["positions"],
                        segments=batch["segments"]).item()
    dev = {k: batch[k].to(device) for k in ("input_ids", "labels", "positions", "segments")}
    loss = loss_sum(model, dev["input_ids"], dev["labels"], targets_only=False, positions=dev["positions"],
                    segments=dev["segments"])
    if step == 0:  # the step's graph: no (64, 64) mask in it (a block's mask is (16, keys))
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
        out["hlo_has_t_by_t_mask"] = re.search(r"pred\\[[0-9,]*64,64\\]", hlo) is not None
        out["hlo_has_block_masks"] = re.search(r"pred\\[2,1,16,[0-9]+\\]", hlo) is not None
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_xla.sync()
    out["rel"].append(abs(loss.item() - expected) / abs(expected))
    out["compiles"].append(met.metric_data("CompileTime")[0])
    # the CPU model takes the same SGD step, so that every step compares equal weights
    with torch.no_grad():
        for (n, p), (_, q) in zip(cpu.named_parameters(), model.named_parameters()):
            p.copy_(q.cpu())
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.slow  # an XLA:CPU process (compiles two train steps)
def test_the_xla_train_step_with_packed_rows_is_one_graph_without_a_t_by_t_mask(tmp_path, xla_forks):
    """Three packed train steps of a soft-capped, sliding-window model on XLA:CPU through the blockwise path, each
    row packed differently: the first two steps compile, the third reuses their graph; the graph holds no (T, T) mask;
    each step's loss is the eager CPU model's (same weights) within 1e-5."""
    import json
    import os
    from pathlib import Path

    from child_env import python_path
    from fork_server import run_captured

    tests = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_"))}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS="--xla_backend_optimization_level=0", PYTHONPATH=f"{python_path()}:{tests}")
    result = tmp_path / "out.json"
    # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
    proc = run_captured(xla_forks, ["-c", XLA_WORKER, str(result)], tests.parent, env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["any_layer"]
    assert out["hlo_has_block_masks"] and not out["hlo_has_t_by_t_mask"]
    # the first step compiles, the second once more (its weights are the first step's outputs, no longer fresh
    # transfers: as tests/xla/test_xla_packing.py counts), the third, with other documents, nothing
    assert out["compiles"][0] >= 1 and out["compiles"][1] <= 2 and out["compiles"][2] == out["compiles"][1], out
    assert max(out["rel"]) <= 1e-5, out["rel"]
