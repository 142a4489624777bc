"""serve/base.py's accelerator flags off XLA: --weights (XLA only) and --compile (the decode step compiled as
generate/base.py's: CUDA graphs on a GPU). The flags are refused in one line where they cannot apply, before any
weights are read; on the CPU the compiled path (torch.compile, Inductor) gives the eager engine's greedy tokens and
compiles nothing after the warm-up. CUDA graphs themselves need a GPU and are not run here."""

import pytest

from lit_gpt.recipes.evaluate import load_eval_model, serve_compile_mode
from lit_gpt.utils import LitError
from tolerance import fp32_tolerance


@pytest.mark.parametrize("kwargs, message", [
    (dict(weights="replicated"),
     "--weights replicated places the weights over XLA devices: it needs --accelerator xla"),
    (dict(weights="sharded"), "--weights must be auto, replicated or tensor_parallel (got 'sharded')"),
    (dict(compile="reduce-overhead"), "--compile reduce-overhead records CUDA graphs and needs a CUDA GPU"),
    (dict(compile="fast"), "--compile must be one of auto, none, default, reduce-overhead, max-autotune"),
    (dict(compile="default", accelerator="xla"), "--compile default is for CPUs and CUDA GPUs"),
])
def test_accelerator_flags_are_refused_in_one_line_before_loading(tiny_dir, kwargs, message):
    kwargs = {"accelerator": "cpu", **kwargs}
    with pytest.raises(LitError) as e:
        load_eval_model(tiny_dir, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_compile_auto_is_eager_on_the_cpu_and_cuda_graphs_on_a_gpu():
    assert serve_compile_mode("auto", "cpu") is None
    assert serve_compile_mode("none", "cpu") is None
    assert serve_compile_mode(None, "cpu") is None  # the evaluation recipes: eager
    assert serve_compile_mode("auto", "xla") is None
    assert serve_compile_mode("default", "cpu") == "default"
    from lit_gpt.compile_policy import resolve_compile

    assert resolve_compile("auto", "cuda", 1 << 30) == "reduce-overhead"  # what the server resolves on a GPU


def _greedy(loaded, prompts):
    from lit_gpt.recipes.serving import Engine, Job

    engine = Engine(loaded, slots=2, max_seq_length=64, max_queue=4, prefill_chunk=16)
    engine.warm_up()
    jobs = [Job(list(p), max_tokens=6, emit=lambda *a: None) for p in prompts]
    engine.submit(jobs)
    with loaded.runtime.inference_context():
        while engine.busy():
            engine.iterate()
    return [job.generated_ids for job in jobs], engine.compiles_since_warm_up(), engine.static


@pytest.mark.slow  # Inductor compiles three graphs on the CPU (~1 minute on 2 cores)
def test_compiled_forward_on_the_cpu_gives_the_eager_greedy_tokens(tiny_dir):
    prompts = [[1, 5, 9, 13, 200, 7], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314,
                                       315, 316, 317, 40]]
    eager, _, static = _greedy(load_eval_model(tiny_dir, accelerator="cpu"), prompts)
    assert not static
    compiled_model = load_eval_model(tiny_dir, accelerator="cpu", compile="default")
    compiled, after_warm_up, static = _greedy(compiled_model, prompts)
    assert static  # fixed rows and cache: the shapes the graphs were compiled for
    assert compiled == eager and all(len(ids) == 6 for ids in eager)
    assert after_warm_up == 0
    assert compiled_model.runtime.compile_count() >= 2  # the prefill call and the decode step at least


@pytest.mark.parametrize("mask_kind", ["shared", "per_row", "causal"])
def test_grouped_attention_equals_sdpa(mask_kind):
    """lit_gpt.xla.serve_placement's attention for tensor-parallel serving (per KV head group, einsums that keep the
    group dimension) computes what the model's SDPA with GQA does, for the masks a served forward passes."""
    import torch
    import torch.nn.functional as F

    from lit_gpt.xla.serve_placement import grouped_attention

    torch.manual_seed(0)
    B, H, G, T, S, D = 3, 6, 2, 4, 9, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    if mask_kind == "causal":
        k, v = k[:, :, :T], v[:, :, :T]
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
        got = grouped_attention(q, k, v, None, 0.3, None)
    else:
        pos = torch.tensor([2, 3, 4, 5]) if mask_kind == "shared" else torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8],
                                                                                      [1, 2, 3, 4]])
        mask = pos.unsqueeze(-1) >= torch.arange(S)
        mask = mask.unsqueeze(1) if pos.dim() == 2 else mask
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        got = grouped_attention(q, k, v, mask, 0.3, None)
    # fp32 bound (tests/tolerance.py): the scores' rounding (a sum over D, of magnitude scale x D x |q| |k|) moves the
    # softmax weights by that much relatively, and the output sums S of them times |v|
    scores = 0.3 * D * q.abs().max() * k.abs().max()
    torch.testing.assert_close(got, expected, rtol=0,
                               atol=fp32_tolerance(max(S, D), float(v.abs().max() * max(1.0, float(scores)))))
