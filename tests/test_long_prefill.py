"""A prompt over the KV cache without the dense (T, S) mask (lit_gpt.kv_cache.Prefill, eager backends): the same
logits as the masked path (`model.cache_prefill = "mask"`, the path before) for a first prompt, a prompt after a
prefix, per-row positions with reused rows, and the decode steps after them, on plain, GQA, q/k-normed, sliding
(ring caches), soft-capped and sink layers; which path each layer kind takes; no (T, S) mask is built. The models:
tests/tiny_hf.py's configs with random weights (no checkpoint: a lit model from the HF config alone)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiny_hf  # noqa: E402

import lit_gpt.kv_cache as kv_cache  # noqa: E402
import lit_gpt.model as lit_model  # noqa: E402
from lit_gpt import GPT, Config  # noqa: E402

FAMILIES = ["tinyllama", "qwen3", "gemma3", "gemma2", "mistral-v0.1", "gpt_oss"]  # gemma2: soft-cap; gpt_oss: sinks


def lit_model_of(family: str) -> GPT:
    cls_name, kwargs = tiny_hf.FAMILIES[family]
    model = GPT(Config.from_hf_config(getattr(transformers, cls_name)(**kwargs).to_dict()))
    tiny_hf.randomize_(model, 0)
    return model.eval()


def run_steps(model: GPT, mode: str) -> list:
    """A first prompt of 13 (past every window of 4), a second prompt after it (6 positions), per-row positions with a
    reused row (row 1 restarts at 0 over its earlier sequence's ring) and a decode step; the logits of each."""
    model.cache_prefill = mode
    model.set_kv_cache(2, 24)
    prompt = torch.randint(0, tiny_hf.VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = [model(prompt, torch.arange(13)), model(prompt[:, 3:9], torch.arange(13, 19))]
        per_row = torch.stack((torch.arange(19, 24), torch.arange(0, 5)))
        out.append(model(prompt[:, :5], per_row, slots=torch.tensor([0, 1]), cache_length=24))
        out.append(model(prompt[:, :1], torch.tensor([[23], [5]]), slots=torch.tensor([0, 1]), cache_length=24))
    model.clear_kv_cache()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_without_the_mask_equals_the_masked_path(family, monkeypatch):
    model = lit_model_of(family)
    expected = run_steps(model, "mask")
    shapes = []
    real_mask = kv_cache.KVCache.mask

    def recording_mask(self, input_pos, length=None):
        shapes.append(tuple(input_pos.shape))
        return real_mask(self, input_pos, length)

    monkeypatch.setattr(kv_cache.KVCache, "mask", recording_mask)
    for chunk_entries in (kv_cache.PREFILL_MASK_ENTRIES, 40):  # the default; 40: chunks of 1 to 2 queries
        monkeypatch.setattr(kv_cache, "PREFILL_MASK_ENTRIES", chunk_entries)
        got = run_steps(model, "chunks")
        assert shapes and all(s[-1] == 1 for s in shapes), shapes  # the dense mask only for one-token steps
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=5e-5)
            assert torch.equal(g.argmax(-1), e.argmax(-1))


def plans_of(model: GPT, monkeypatch, *calls) -> list:
    """The Prefill plans `GPT.forward` makes for each call ((idx, input_pos)), by window kind."""
    plans = []

    class Recording(kv_cache.Prefill):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            plans.append(self)

    monkeypatch.setattr(lit_model, "Prefill", Recording)
    model.set_kv_cache(1, 40)
    with torch.no_grad():
        for idx, pos in calls:
            model(idx, pos)
    return plans


def test_each_layer_kind_takes_its_path(monkeypatch):
    """Gemma 3 (window 4 sliding layers with ring caches, one global layer): a first prompt is plain causal SDPA over
    the prompt's own keys on the global layer (no mask at all), and on the sliding layers while it fits the window;
    past the window, or after a prefix, chunks over the keys each chunk can see; soft-capped layers (Gemma 2) always
    go by chunks (their eager attention would build the (T, T) mask for `None`)."""
    monkeypatch.setattr(kv_cache, "PREFILL_MASK_ENTRIES", 8 * 34)  # 8 queries per chunk over a ring's 4 + 30 keys
    gemma3 = lit_model_of("gemma3")
    ids = torch.zeros(1, 30, dtype=torch.long)
    sliding, glob = plans_of(gemma3, monkeypatch, (ids[:, :3], torch.arange(3)))
    assert sliding.window == 4 and sliding.causal is not None and glob.window is None and glob.causal == (0, 3)
    sliding, glob = plans_of(gemma3, monkeypatch, (ids, torch.arange(30)))
    assert glob.causal == (0, 30) and sliding.causal is None
    # a ring: 4 old entries then the 30 own keys; each chunk of 8 sees its own 8 keys and the 3 before them at most
    assert all(hi - lo <= (b - a) + 3 for a, b, lo, hi in sliding.chunks)
    assert sum(b - a for a, b, _, _ in sliding.chunks) == 30
    sliding, glob = plans_of(gemma3, monkeypatch, (ids[:, :20], torch.arange(20)),
                             (ids[:, :10], torch.arange(20, 30)))[2:]
    assert sliding.causal is None and glob.causal is None  # after a prefix: the cache's old keys plus its own
    # the plain cache's chunks (8 queries over 40 positions: 6 each) see positions 0 to their last
    assert [(lo, hi) for _, _, lo, hi in glob.chunks] == [(0, 26), (0, 30)]
    # the ring's 4 old entries hold positions 16 to 19, then the 10 own keys: position 16 is out of every window
    assert [(lo, hi) for _, _, lo, hi in sliding.chunks] == [(1, 14)]
    gemma2 = lit_model_of("gemma2")
    assert all(p.causal is None for p in plans_of(gemma2, monkeypatch, (ids[:, :3], torch.arange(3))))


def test_a_long_prompt_builds_no_dense_mask(monkeypatch):
    """A 2,048-token prompt over a 2,112-position cache: the masks built are the chunks' (each under the entry
    budget), never (T, S); greedy tokens after it equal the masked path's."""
    from lit_gpt.generate import generate

    model = lit_model_of("mistral-v0.1")  # every layer slides (window 4): a ring cache of 4 entries
    model.transformer.h[1].attn.sliding_window = None  # the global case too: one layer each way
    prompt = torch.randint(0, tiny_hf.VOCAB, (2048,), generator=torch.Generator().manual_seed(2))
    model.cache_prefill = "mask"
    expected = generate(model, prompt, 4, max_seq_length=2112)
    largest = []
    real = kv_cache.Prefill.mask

    def recording(self, q_pos, lo, hi):
        m = real(self, q_pos, lo, hi)
        largest.append(m.numel())
        return m

    monkeypatch.setattr(kv_cache.Prefill, "mask", recording)
    model.cache_prefill = "chunks"
    assert generate(model, prompt, 4, max_seq_length=2112).tolist() == expected.tolist()
    # the sliding layer's chunks of 256 queries over 260 keys at most (the global layer's prompt is plain causal: no
    # mask); the dense mask would be 2048 x 2052 (the ring's) and 2048 x 2112 entries
    assert largest and max(largest) <= 256 * 260 and sum(largest) <= 2048 * 260
