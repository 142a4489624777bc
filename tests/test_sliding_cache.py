"""Sliding-window layers' KV caches hold their window (a ring, lit_gpt.kv_cache): greedy tokens equal transformers'
`generate` across prompts longer than the window, in `generate` (with and without prompt padding) and in the
continuous-batching `Batch` (rows at different positions, some past the window, rows reused); a prompt fed in
chunks equals the whole prompt; the caches' sizes are the window (sliding layers) and the sequence (global ones).
The tiny configs: tests/tiny_hf.py (Gemma 3: five sliding layers to one global, window 4; Mistral v0.1: every
layer slides, window 4)."""

from functools import lru_cache

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_hf import VOCAB, hf_to_lit  # noqa: E402

from lit_gpt.generate import Batch, generate  # noqa: E402

WINDOW = 4  # both tiny configs' sliding_window


@lru_cache(maxsize=None)
def models(family: str, tmp_root: str):
    from pathlib import Path

    return hf_to_lit(family, Path(tmp_root), seed=3)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sliding"))


def hf_greedy(hf_model, prompt: torch.Tensor, n: int) -> list:
    out = hf_model.generate(prompt.view(1, -1), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, prompt.numel():].tolist()


def prompt_of(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def cache_sizes(model):
    return [(b.attn.sliding_window, b.attn.kv_cache.k.size(2), b.attn.kv_cache.v.size(2)) for b in model.transformer.h]


@pytest.mark.parametrize("family", ["gemma3", "mistral-v0.1"])
@torch.no_grad()
def test_generate_across_the_window_matches_transformers_with_window_sized_caches(family, tmp_root):
    hf_model, model = models(family, tmp_root)
    prompt, new = prompt_of(7, 2), 9  # the prompt crosses the window, and so does every decode step
    expected = hf_greedy(hf_model, prompt, new)
    assert generate(model, prompt, new).tolist() == expected
    for window, k, v in cache_sizes(model):  # global layers: prompt + new tokens; sliding ones: the window
        assert k == v == (WINDOW if window is not None else 7 + new)
    assert any(w is not None for w, _, _ in cache_sizes(model))
    # a prompt right-padded to a bucket (what XLA and compiled steps run): the padding never evicts the prompt's window
    assert generate(model, prompt, new, pad_to=16).tolist() == expected
    # a prompt shorter than the window, in a cache longer than it
    short = prompt_of(3, 5)
    assert generate(model, short, 8, max_seq_length=20).tolist() == hf_greedy(hf_model, short, 8)


@torch.no_grad()
def test_batch_rows_at_different_positions_match_transformers(tmp_root):
    """Rows join at different steps with prompts shorter and longer than the window, one row is reused after its
    sequence left (its ring holds the earlier sequence's entries), on the eager path and the static one (all rows,
    the whole cache, prompts padded)."""
    hf_model, model = models("gemma3", tmp_root)
    seqs = [prompt_of(n, 10 + n) for n in (9, 2, 6, 3)]
    budget = [10, 8, 7, 9]
    expected = [hf_greedy(hf_model, s, n) for s, n in zip(seqs, budget)]
    for static in (False, True):
        batch = Batch(model, 3, 24, static=static, exact_length=True)
        assert {k for w, k, _ in cache_sizes(model) if w is not None} == {WINDOW}
        out = [[] for _ in seqs]
        in_row, waiting = {}, list(range(len(seqs)))
        while waiting or in_row:
            if waiting and batch.free_rows():
                i, row = waiting.pop(0), batch.free_rows()[0]
                pad = 12 if static else None
                out[i].append(int(batch.join([row], seqs[i].view(1, -1), pad_to=pad)[0]))
                in_row[row] = i
            else:
                tokens = batch.step().tolist()
                for row, i in in_row.items():
                    out[i].append(tokens[row])
            for row, i in list(in_row.items()):
                if len(out[i]) >= budget[i]:
                    batch.leave(row)
                    del in_row[row]
        assert out == expected, f"static={static}"


@torch.no_grad()
def test_a_prompt_in_chunks_equals_the_whole_prompt(tmp_root):
    """Chunked prefill (chunks shorter and longer than the window, each attending over the ring and itself) gives
    the logits of one whole-prompt forward, and the decode steps after it those of transformers."""
    hf_model, model = models("mistral-v0.1", tmp_root)
    idx = prompt_of(14, 7).view(1, -1)
    expected = hf_model(idx).logits
    model.set_kv_cache(batch_size=1, max_seq_length=16)
    chunks = [(0, 3), (3, 9), (9, 11), (11, 12)]  # 3, 6 (> window), 2 and 1 tokens
    got = [model(idx[:, a:b], input_pos=torch.arange(a, b)) for a, b in chunks]
    got += [model(idx[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(12, 14)]
    torch.testing.assert_close(torch.cat(got, dim=1), expected, atol=1e-4, rtol=0)
    assert {k for w, k, _ in cache_sizes(model)} == {WINDOW}
    model.clear_kv_cache()
