"""Packed rows through FlexAttention (lit_gpt.attention: the CUDA path, `GPT.packed_attention = "auto"` on a CUDA
device): its mask_mod (document + causal + sliding window), score_mod (soft-capping) and sinks (from the
log-sum-exp) equal SDPA with the dense document mask (the old path) in outputs and gradients within float32's
rounding (tests/tolerance.py), at the kernel and the model level.

Run on the CPU only (no GPU in this project's test machines): compiled with Inductor, the CPU has no backward of
FlexAttention in torch 2.9 (lit_gpt.attention's docstring), so these compile with the "eager" backend: dynamo's
capture and guards, as on CUDA (the last test counts the graphs of a second batch), run by the unfused reference of the same mask
and score functions. The Triton kernels themselves are a CUDA check."""

from typing import Optional

import pytest
import torch

from lit_gpt import GPT
from lit_gpt.attention import FlexMask, flex_attention_packed, flex_available, flex_mask, packed_path
from lit_gpt.packing import collate_packed
from test_packed_attention import dense, packed_loss_and_grads
from test_packing import samples_of
from tolerance import fp32_tolerance
from variants import randomize_, tiny_config

pytestmark = pytest.mark.skipif(not flex_available(), reason="this torch has no torch.nn.attention.flex_attention")


def test_packed_rows_take_flexattention_on_cuda_only_and_it_can_be_turned_off():
    assert packed_path("auto", "cuda") == "flex"
    assert packed_path("auto", "cpu") == "documents"
    assert packed_path("auto", "xla") == "documents"  # XLA installs its own kernel (lit_gpt.xla.flash)
    # turned off on CUDA: the per-document path or the old dense mask, as set
    assert packed_path("documents", "cuda") == "documents"
    assert packed_path("mask", "cuda") == "mask"
    assert packed_path("flex", "cpu") == "flex"  # asked for by name (the tests below): taken as asked
    assert GPT(tiny_config("TinyLlama-1.1B-Chat-v1.0")).packed_attention == "auto"


def rows(lengths, T: int) -> torch.Tensor:
    segments = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, row in enumerate(lengths):
        at = 0
        for d, n in enumerate(row, start=1):
            segments[b, at : at + n] = d
            at += n
    return segments


# the default suite runs the sinks on a sliding layer (mask_mod with a window, the log-sum-exp), the rest is slow:
# each flex call is captured by dynamo (seconds per new shape or layer kind on a small CPU)
@pytest.mark.parametrize("kind,window", [
    pytest.param("sdpa", None, marks=pytest.mark.slow), pytest.param("sdpa", 3, marks=pytest.mark.slow),
    pytest.param("softcap", None, marks=pytest.mark.slow), ("sinks", 8),
], ids=["causal", "window3", "softcap", "sinks_window8"])
def test_flex_attention_equals_the_dense_mask_with_gradients(kind, window):
    torch.manual_seed(0)
    # documents shorter and longer than the windows, a one-token document, padding at the end of the second row
    T = 32
    segments = rows([[5, 1, 17, 9], [20, 7, 5 - 1]], T)
    B, H, G, hs = 2, 4, 2, 16
    q, k, v = (torch.randn(B, n, T, hs, requires_grad=True) for n in (H, G, G))
    sinks = torch.randn(H, requires_grad=True) if kind == "sinks" else None
    cap: Optional[float] = 2.0 if kind == "softcap" else None
    scale = hs**-0.5
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    weight = torch.randn(B, H, T, hs)  # a loss that weighs every output differently

    def run(fn):
        out = fn()
        return out.detach(), torch.autograd.grad((out * weight).sum(), inputs)

    old, old_grads = run(lambda: dense(q, k, v, segments, scale, window, cap, sinks))
    mask = flex_mask(segments, window, backend="eager")
    assert isinstance(mask, FlexMask) and mask.window == window
    new, new_grads = run(lambda: flex_attention_packed(q, k, v, mask, scale, cap, sinks))
    tol = fp32_tolerance(T, old.abs().max())
    assert (new - old).abs().max() <= tol
    for a, b in zip(new_grads, old_grads):
        assert (a - b).abs().max() <= fp32_tolerance(T * hs, b.abs().max())
    # the comparison can fail: the old path with another window (or none) is far outside the tolerance
    wrong = dense(q, k, v, segments, scale, 2 if window else 4, cap, sinks)
    assert (wrong - new).abs().max() > 100 * tol


@pytest.mark.slow  # dynamo captures each layer kind's flex call: 3-10 s per model on a small CPU
@pytest.mark.parametrize("family,extra", [
    ("TinyLlama-1.1B-Chat-v1.0", {}),  # dense, GQA
    ("gemma-2-2b", {}),  # soft-capping, alternating sliding / global layers
    ("Mistral-7B-v0.1", {"attention_sinks": True}),  # gpt-oss's attention: sinks on sliding layers
], ids=["dense", "softcap_sliding", "sinks"])
def test_the_flex_path_equals_the_mask_path_in_a_model(family, extra):
    torch.manual_seed(0)
    model = GPT(tiny_config(family, **extra))
    randomize_(model)
    model.float().train()
    model.flex_compile = "eager"  # the CPU: the unfused reference (Inductor has no CPU backward of FlexAttention)
    samples = samples_of([5, 9, 13, 3, 20, 7, 11], seed=4)
    batch = collate_packed([samples[:3], samples[3:6], samples[6:]], 32)
    old_loss, old_grads = packed_loss_and_grads(model, batch, "mask")
    new_loss, new_grads = packed_loss_and_grads(model, batch, "flex")
    assert abs(new_loss - old_loss) <= fp32_tolerance(64 * 32, old_loss.abs())
    assert new_grads.keys() == old_grads.keys() and new_grads
    for name, g in old_grads.items():
        assert (new_grads[name] - g).abs().max() <= fp32_tolerance(64 * 32, g.abs().max()) * 10, name


@pytest.mark.slow  # dynamo captures the blocks (aot_eager) with the flex call inside
def test_the_flex_path_runs_inside_the_compiled_blocks_of_a_train_step(monkeypatch):
    """`--compile` on CUDA compiles the blocks as whole graphs (`Runtime.compile_blocks`, fullgraph): the block mask
    and the flex call go into those graphs. Here with "aot_eager" (the capture without Inductor's kernels): the same
    loss and gradients as the old path's, and a second batch of other documents compiles nothing more."""
    import torch._dynamo

    from lit_gpt.runtime import Runtime

    monkeypatch.setattr(Runtime, "compile_backend", "aot_eager")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(tiny_config("TinyLlama-1.1B-Chat-v1.0"))  # one kind of block: one graph (the kinds: the tests above)
    randomize_(model)
    model.float().train()
    model.flex_compile = "eager"
    samples = samples_of([5, 9, 13, 3, 20, 7, 11], seed=4)
    batch = collate_packed([samples[:3], samples[3:6], samples[6:]], 32)
    old_loss, old_grads = packed_loss_and_grads(model, batch, "mask")
    runtime = Runtime(device=torch.device("cpu"))
    runtime.compile_blocks(model)
    new_loss, new_grads = packed_loss_and_grads(model, batch, "flex")
    assert abs(new_loss - old_loss) <= fp32_tolerance(64 * 32, old_loss.abs())
    for name, g in old_grads.items():
        assert (new_grads[name] - g).abs().max() <= fp32_tolerance(64 * 32, g.abs().max()) * 10, name
    compiled = runtime.compile_count()
    assert compiled > 0
    other = collate_packed([[samples[2], samples[4]], [samples[i] for i in (0, 1, 3, 5)], samples[6:]], 32)
    packed_loss_and_grads(model, other, "flex")
    assert runtime.compile_count() == compiled
