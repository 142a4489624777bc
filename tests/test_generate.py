"""Generation: sampling, the static-cache loop against a no-cache reference, padding, stop tokens, the errors, the
runtime it defaults to, the compiled steps and the CPU weight layout. The recipes end to end:
tests/test_generate_recipes.py."""

import pytest
import torch

from lit_gpt import GPT, Config
from lit_gpt.compile_policy import Steps, compile_pays_after, resolve_compile
from lit_gpt.cpu_layout import onednn_available, pack_linear_weights, use_column_major_weights, use_cpu_inference_layout
from lit_gpt.generate import (
    compile_steps,
    decode_one_token,
    generate,
    generate_stream,
    kv_cache_length,
    prefill,
    sample,
    setup_kv_cache,
)
from lit_gpt.runtime import bucket_length
from lit_gpt.utils import LitError
from tiny import tiny_llama_config


def tiny_config(config_cls=Config, **overrides) -> Config:
    """tests/tiny.py's model, narrower (32 wide) over a 320-token vocabulary."""
    return tiny_llama_config(config_cls, **{"vocab_size": 320, "n_embd": 32, "intermediate_size": 64, **overrides})


def tiny_model(seed: int = 0, **overrides) -> GPT:
    """A random model whose greedy continuations vary (the default init makes them repeat one token)."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.4)
    return model.eval()


@torch.no_grad()
def naive_greedy(model: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: the whole sequence through the model without a cache, one new token at a time."""
    model.clear_kv_cache()
    seq = prompt
    for _ in range(n):
        nxt = model(seq.unsqueeze(0))[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1)])
    return seq[prompt.numel() :]


# ---------------------------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------------------------
def test_greedy_is_argmax():
    logits = torch.randn(8, 50)
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(-1))
    assert torch.equal(sample(logits[0]), logits[0].argmax())


def test_top_k_1_and_tiny_top_p_are_greedy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50)
    for _ in range(5):
        assert torch.equal(sample(logits, temperature=1.5, top_k=1, generator=gen), logits.argmax(-1))
        assert torch.equal(sample(logits, temperature=1.5, top_p=1e-6, generator=gen), logits.argmax(-1))


def test_sampling_reproducible_with_generator():
    logits = torch.randn(256, 50)
    a = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(3))
    c = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def frequencies(logits: torch.Tensor, n: int = 40000, **kwargs) -> torch.Tensor:
    draws = sample(logits.expand(n, -1), generator=torch.Generator().manual_seed(0), **kwargs)
    return torch.bincount(draws, minlength=logits.numel()).float() / n


def test_sampling_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log()
    # temperature 1: the model's distribution (4 standard errors of a binomial at n=40000 is about 0.01)
    assert torch.allclose(frequencies(logits, temperature=1.0), p, atol=0.01)
    # temperature 2: p ** (1/2), renormalised
    flat = p.sqrt() / p.sqrt().sum()
    assert torch.allclose(frequencies(logits, temperature=2.0), flat, atol=0.01)
    # top_k 2: the two most likely tokens, renormalised
    assert torch.allclose(frequencies(logits, temperature=1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=0.01)
    # top_p 0.6: token 1 stays (mass before it, 0.5, is below 0.6), token 2 goes (0.8 is not)
    assert torch.allclose(frequencies(logits, temperature=1.0, top_p=0.6), torch.tensor([0.625, 0.375, 0, 0]), atol=0.01)
    # top_p 0.85 keeps three tokens (mass before the 4th is 0.95)
    three = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(frequencies(logits, temperature=1.0, top_p=0.85), three, atol=0.01)


def test_top_p_applies_to_the_tempered_distribution():
    # at temperature 0.5 the probabilities are p^2 renormalised: [0.66, 0.24, 0.11], so top_p 0.6 keeps token 0
    # only (at temperature 1 it keeps two: the mass before token 1 is 0.5)
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert frequencies(logits, n=2000, temperature=0.5, top_p=0.6)[0] == 1.0
    assert frequencies(logits, n=2000, temperature=1.0, top_p=0.6)[0] < 0.7


def test_steps_never_read_device_values():
    """Prefill, decode and sampling on the meta device: any `.item()`, `bool()` or data-dependent Python branch
    would raise, so this shows the steps run without a host synchronisation (what XLA and CUDA need)."""
    with torch.device("meta"):
        model = GPT(tiny_config())
        setup_kv_cache(model, 5, 4, max_seq_length=9)
        prompt = torch.zeros(1, 8, dtype=torch.long)  # 5 tokens right-padded to a bucket of 8
        options = dict(temperature=0.7, top_k=5, top_p=0.9)
        token = prefill(model, prompt, torch.arange(8), torch.tensor([4]), **options)
        assert token.shape == (1,) and token.device.type == "meta"
        token = decode_one_token(model, token, torch.tensor([5]), **options)
        assert token.shape == (1,)


# ---------------------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GQA
        {"n_query_groups": 1},  # MQA
        {"n_query_groups": 4},  # MHA
        {  # a NeoX-style block: parallel residual, LayerNorm, partial RoPE, biases, untied head
            "norm_class_name": "LayerNorm",
            "mlp_class_name": "GptNeoxMLP",
            "parallel_residual": True,
            "rotary_percentage": 0.25,
            "bias": True,
            "tie_embeddings": False,
        },
    ],
)
def test_generate_equals_naive_greedy(overrides):
    model = tiny_model(**overrides)
    prompt = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(1))
    expected = naive_greedy(model, prompt, 20)
    assert len(set(expected.tolist())) > 3, "the reference should not be one repeated token"
    out = generate(model, prompt, 20)
    assert torch.equal(out, expected)
    # the cache is sized to the request, not to block_size
    assert kv_cache_length(model, 1) == 7 + 20 < model.config.block_size


def test_generate_batch_equals_single_rows():
    model = tiny_model()
    prompts = torch.randint(0, 320, (3, 6), generator=torch.Generator().manual_seed(2))
    out = generate(model, prompts, 12)
    assert out.shape == (3, 12)
    for row, prompt in zip(out, prompts):
        assert torch.equal(row, naive_greedy(model, prompt, 12))


@pytest.mark.parametrize("pad_to", [8, 16, 30])
def test_bucket_padding_gives_identical_tokens(pad_to):
    """Right-padding the prompt writes garbage keys/values at positions >= T; the causal mask hides them from the
    last prompt position and each decode step overwrites its position before attending to it. Fill the cache
    with noise first so that nothing depends on it starting at zero."""
    model = tiny_model()
    prompt = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(1))
    expected = naive_greedy(model, prompt, 10)
    setup_kv_cache(model, 7, 10, max_seq_length=40)
    for block in model.transformer.h:
        block.attn.kv_cache.k.normal_(std=100.0)
        block.attn.kv_cache.v.normal_(std=100.0)
    out = generate(model, prompt, 10, pad_to=pad_to, pad_id=5)
    assert torch.equal(out, expected)
    assert kv_cache_length(model, 1) == 40  # an existing cache that fits is reused


def test_prefill_logits_do_not_depend_on_padding():
    model = tiny_model()
    prompt = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(1))
    last = torch.tensor([6])
    with torch.no_grad():
        setup_kv_cache(model, 7, 25)
        plain = model(prompt, torch.arange(7), last_only=last)
        padded_prompt = torch.nn.functional.pad(prompt, (0, 25), value=9)
        padded = model(padded_prompt, torch.arange(32), last_only=last)
    torch.testing.assert_close(padded, plain)


def test_bucket_length():
    assert bucket_length(3, limit=100) == 16
    assert bucket_length(17, limit=100) == 32
    assert bucket_length(64, limit=100) == 64
    assert bucket_length(65, limit=100) == 100


def test_stop_token_ends_generation():
    model = tiny_model()
    prompt = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(1))
    full = naive_greedy(model, prompt, 20).tolist()
    stop = full[5]
    first = full.index(stop)
    for chunk_size in (1, 3, 8, 64):
        out = generate(model, prompt, 20, stop_ids=[stop], chunk_size=chunk_size)
        assert out.tolist() == full[:first], chunk_size
    # an int works too, and a stop id that never comes changes nothing
    assert generate(model, prompt, 20, stop_ids=stop).tolist() == full[:first]
    unused = next(i for i in range(320) if i not in full)
    assert generate(model, prompt, 20, stop_ids=[unused, 319 if 319 not in full else unused]).tolist() == full


def test_stop_token_in_a_batch():
    model = tiny_model()
    prompts = torch.randint(0, 320, (2, 6), generator=torch.Generator().manual_seed(2))
    rows = [naive_greedy(model, p, 16).tolist() for p in prompts]
    stop = rows[0][3]
    ends = [r.index(stop) if stop in r else 16 for r in rows]
    out = generate(model, prompts, 16, stop_ids=[stop], chunk_size=4)
    assert out.size(1) == max(ends)
    for row, ref, end in zip(out.tolist(), rows, ends):
        assert row[:end] == ref[:end]
        assert all(t == stop for t in row[end:])  # a finished row holds stop ids until the batch ends


def test_stream_chunks():
    model = tiny_model()
    prompt = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(1))
    from lit_gpt.runtime import Runtime

    calls = []

    class Counting(Runtime):
        def end_step(self) -> None:
            calls.append(1)

    chunks = list(generate_stream(model, prompt, 10, chunk_size=4, runtime=Counting(device=torch.device("cpu"))))
    # the first token and the first decode step alone (time to first token; the steady steps timed apart), then
    # chunks of chunk_size steps
    assert [c.numel() for c in chunks] == [1, 1, 4, 4]
    assert torch.equal(torch.cat(chunks), naive_greedy(model, prompt, 10))
    assert len(calls) == 10  # one end_step per step: where the XLA runtime cuts the graph


def test_sampled_generation_reproducible():
    model = tiny_model()
    prompt = torch.randint(0, 320, (5,), generator=torch.Generator().manual_seed(1))
    kwargs = dict(temperature=1.0, top_k=50, top_p=0.9)
    a = generate(model, prompt, 15, generator=torch.Generator().manual_seed(7), **kwargs)
    b = generate(model, prompt, 15, generator=torch.Generator().manual_seed(7), **kwargs)
    assert torch.equal(a, b)


def test_length_errors():
    model = tiny_model()  # block_size 64
    prompt = torch.zeros(10, dtype=torch.long)
    with pytest.raises(LitError, match="max_new_tokens must be > 0"):
        generate(model, prompt, 0)
    with pytest.raises(LitError, match="max_new_tokens must be > 0"):
        generate(model, prompt, -3)
    with pytest.raises(LitError, match=r"70 tokens .*block_size\) is 64: shorten the prompt by at least 6"):
        generate(model, torch.zeros(70, dtype=torch.long), 1)
    with pytest.raises(LitError, match=r"exceeds .* by 6: set max_new_tokens <= 54"):
        generate(model, prompt, 60)
    with pytest.raises(LitError, match="empty"):
        generate(model, torch.zeros(0, dtype=torch.long), 5)
    with pytest.raises(LitError, match="pad_to"):
        generate(model, prompt, 5, pad_to=4)
    # the largest request that fits works
    assert generate(model, prompt, 54).numel() == 54


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1.0, top_k=0), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_argument_errors(kwargs, message):
    with pytest.raises(LitError, match=message):
        generate(tiny_model(), torch.zeros(3, dtype=torch.long), 5, **kwargs)


def test_an_xla_model_without_its_runtime_is_a_clear_error(monkeypatch):
    """The loop defaults to the CPU/CUDA runtime; on XLA that would trace a new graph per step, so it asks for
    XLARuntime instead of choosing a backend itself."""
    import types

    import lit_gpt.generate
    from lit_gpt.generate import default_runtime

    weight = types.SimpleNamespace(device=torch.device("xla"))
    on_xla = types.SimpleNamespace(transformer=types.SimpleNamespace(wte=types.SimpleNamespace(weight=weight)),
                                   config=types.SimpleNamespace(block_size=64))
    monkeypatch.setattr(lit_gpt.generate, "unwrap", lambda model: on_xla)
    for call in (lambda: default_runtime(on_xla), lambda: generate(on_xla, torch.zeros(3, dtype=torch.long), 2),
                 lambda: setup_kv_cache(on_xla, 3, 2)):
        with pytest.raises(ValueError, match=r"XLA device: pass runtime=XLARuntime\(fabric\)"):
            call()
    monkeypatch.undo()
    assert default_runtime(tiny_model()).device == torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# Compiled steps (--compile)
# ---------------------------------------------------------------------------------------------------------------
def test_resolve_compile():
    pays_cuda = compile_pays_after("cuda")
    assert compile_pays_after("cpu") is None  # measured: no reliable gain on the CPU (see its docstring)
    assert resolve_compile("auto", "cpu", 10**6) is None
    assert resolve_compile("auto", "cuda", pays_cuda - 1) is None
    assert resolve_compile("auto", "cuda", pays_cuda) == "reduce-overhead"
    assert resolve_compile("auto", "xla", 10**6) is None  # XLA compiles its graphs itself
    assert resolve_compile("none", "cuda", 10**6) is None
    assert resolve_compile("max-autotune", "cuda", 1) == "max-autotune"
    assert resolve_compile("default", "cpu", 1) == "default"
    # the former bool flag
    assert resolve_compile(False, "cuda", 10**6) is None
    assert resolve_compile(True, "cpu", 1) == "default"
    assert resolve_compile(True, "cuda", 1) == "reduce-overhead"
    assert resolve_compile(True, "xla", 1) is None
    for bad, device, message in [("fast", "cpu", "must be one of"), ("reduce-overhead", "cpu", "needs a CUDA GPU"),
                                 ("default", "xla", "leave --compile at auto")]:
        with pytest.raises(LitError, match=message):
            resolve_compile(bad, device, 100)


def test_compiled_steps_shapes():
    assert compile_steps(None).shapes(5, 10, 64) == (None, None)  # eager: exact lengths
    steps = Steps(prefill, decode_one_token, "default", True)
    assert steps.shapes(5, 10, 64) == (16, 26) and steps.shapes(13, 10, 64) == (16, 26)  # one bucket, one shape
    assert steps.shapes(17, 10, 64) == (32, 42)
    assert steps.shapes(40, 24, 64) == (64, 64)  # the cache never exceeds the context


def compiled_run(model: GPT, steps: Steps, prompts, max_new_tokens: int, **kwargs):
    """(compiled tokens, eager tokens, new compiled graphs) per prompt, the prompts padded as `steps.shapes` says."""
    from torch._dynamo.utils import counters

    results = []
    for p in prompts:
        pad_to, cache = steps.shapes(p.size(-1), max_new_tokens, model.config.block_size)
        graphs = counters["stats"]["unique_graphs"]
        with torch.inference_mode():
            out = generate(model, p, max_new_tokens, decode_fn=steps.decode, prefill_fn=steps.prefill, pad_to=pad_to,
                           max_seq_length=cache, **kwargs)
            new_graphs = counters["stats"]["unique_graphs"] - graphs
            ref = generate(model, p, max_new_tokens, **kwargs)
        results.append((out.tolist(), ref.tolist(), new_graphs))
    return results


@pytest.mark.slow  # Inductor compiles C++ kernels for both steps: ~10 s alone, ~40 s beside another worker
def test_compiled_steps_on_cpu_equal_eager_and_compile_once_per_bucket():
    """--compile default on the CPU: the compiled prefill and decode step give the eager loop's greedy tokens, and
    three prompt lengths of one bucket compile the two steps once (the later prompts reuse both graphs)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model(n_layer=1)
    steps = compile_steps("default", compile_prefill=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (n,), generator=g) for n in (5, 9, 13)]
    results = compiled_run(model, steps, prompts, 8)
    for out, ref, _ in results:
        assert out == ref
    assert results[0][2] == 2  # prefill + decode step
    assert [new for *_, new in results[1:]] == [0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (--compile reduce-overhead) need a CUDA GPU")
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_decode_equals_eager(mode):
    """The decode step replayed as a CUDA graph: greedy tokens identical to eager for prompts of one bucket and a
    batch, no recompilation within the bucket, and the tokens held in a 16-step chunk across replays intact (the
    step's output is copied before the next replay overwrites it), also with stop tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model().cuda()
    steps = compile_steps(mode, compile_prefill=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (n,), generator=g).cuda() for n in (5, 9, 13)]
    results = compiled_run(model, steps, prompts, 40, chunk_size=16)
    for out, ref, _ in results:
        assert out == ref
    assert results[0][2] >= 2
    assert [new for *_, new in results[1:]] == [0, 0]
    batch = torch.randint(0, 320, (2, 7), generator=g).cuda()
    (out, ref, _), = compiled_run(model, steps, [batch], 40, chunk_size=16)
    assert out == ref
    stop = results[0][1][10]  # a token the first prompt generates: it ends there
    (out, ref, _), = compiled_run(model, steps, prompts[:1], 40, chunk_size=16, stop_ids=[stop])
    assert out == ref and len(out) <= 10


def test_column_major_weights_change_layout_only():
    model = tiny_model(n_embd=32, intermediate_size=96)
    prompt = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(1))
    expected = naive_greedy(model, prompt, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # tall or square: qkv (64x32), fc_1/fc_2 (96x32), the tied head/embedding (320x32); wide: proj (32x32 is
    # square, so it changes too), mlp.proj (32x96) stays row-major
    changed = use_column_major_weights(model)
    assert changed == 1 + 2 * 4  # the tied matrix once, then qkv, attn.proj, fc_1, fc_2 per layer
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.stride() == (1, 320)
    assert model.transformer.h[0].attn.qkv.weight.stride() == (1, 64)
    assert model.transformer.h[0].mlp.proj.weight.is_contiguous()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert use_column_major_weights(model) == 0  # idempotent
    assert torch.equal(generate(model, prompt, 16), expected)

    untied = tiny_model(n_embd=32, intermediate_size=96, tie_embeddings=False)
    assert use_column_major_weights(untied) == 1 + 2 * 4  # the head and the blocks' tall matrices
    assert untied.lm_head.weight.stride() == (1, 320)
    assert untied.transformer.wte.weight.is_contiguous()  # an embedding of its own: lookups read rows


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN (mkldnn) to pack weights for")
@pytest.mark.parametrize(("tied", "memory"), [(False, "plenty"), (True, "plenty"), (True, "short"), (True, "unknown")])
def test_packed_linear_weights_generate_the_same(tied, memory, monkeypatch):
    import lit_gpt.cpu_layout

    model = tiny_model(n_embd=32, intermediate_size=96, tie_embeddings=tied)
    head_bytes = model.lm_head.weight.numel() * 4
    available = {"plenty": 100 * head_bytes, "short": 4 * head_bytes, "unknown": None}[memory]
    monkeypatch.setattr(lit_gpt.cpu_layout, "meminfo_bytes",
                        lambda field: available if field == "MemAvailable" else None)
    prompt = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(1))
    expected = naive_greedy(model, prompt, 16)
    with torch.no_grad():
        reference_logits = model(prompt.unsqueeze(0))
    n_layer = model.config.n_layer
    embedding = model.transformer.wte.weight
    use_cpu_inference_layout(model, packed=True)
    packed = [m for m in model.modules() if type(m).__name__ == "PackedLinear"]
    # qkv, attn.proj, fc_1, fc_2 and mlp.proj of every block; the head too unless it is the embedding and a second
    # copy of it would take more than 1/8 of the available memory (or that is unknown)
    head_packed = not tied or memory == "plenty"
    assert len(packed) == 5 * n_layer + head_packed
    assert not any(type(m) is torch.nn.Linear for m in model.transformer.h.modules())
    if head_packed:
        assert model.transformer.wte.weight is embedding and embedding.is_contiguous()  # untouched: no copy
    else:
        assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.transformer.wte.weight
        assert model.lm_head.weight.stride() == (1, 320)  # column-major instead: no second copy of the matrix
    assert pack_linear_weights(model) == 0  # idempotent
    with torch.no_grad():
        torch.testing.assert_close(model(prompt.unsqueeze(0)), reference_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(generate(model, prompt, 16), expected)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN (mkldnn) to pack weights for")
def test_merged_lora_layers_are_packed_and_unmerged_ones_are_not():
    from lit_gpt import lora

    torch.manual_seed(0)
    config = tiny_config(lora.Config, intermediate_size=96, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True,
                         lora_mlp=True)
    model = lora.GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(std=0.4 if p.dim() > 1 and "lora" not in name else 0.1)
    prompt = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(1))
    assert pack_linear_weights(model, tied_head=False) == 2  # unmerged: only the plain attn.proj layers
    lora.merge_lora_weights(model)
    expected = naive_greedy(model, prompt, 16)
    with torch.no_grad():
        reference_logits = model(prompt.unsqueeze(0))
    # merged qkv, fc_1, fc_2, mlp.proj of both layers; the tied head only with tied_head=True
    assert pack_linear_weights(model, tied_head=False) == 4 * config.n_layer
    assert pack_linear_weights(model, tied_head=True) == 1
    with torch.no_grad():
        torch.testing.assert_close(model(prompt.unsqueeze(0)), reference_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(generate(model, prompt, 16), expected)


def test_packing_skips_what_it_must_not_touch():
    model = tiny_model(n_embd=32, intermediate_size=96, tie_embeddings=False).to(torch.bfloat16)
    assert pack_linear_weights(model) == 0  # float32 only
    model = tiny_model(n_embd=32, intermediate_size=96, tie_embeddings=False)
    model.transformer.h[0].mlp.fc_2.weight = model.transformer.h[0].mlp.fc_1.weight  # shared: not copied
    if onednn_available():
        assert pack_linear_weights(model, tied_head=True) == 5 * model.config.n_layer + 1 - 2
