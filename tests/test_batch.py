"""The generation loop's `Batch` (lit_gpt.generate): sequences that join and leave rows of one KV cache between
steps (continuous batching) produce what each would alone, for every attention kind, on the eager path (rows and
cache positions in use only) and the static one (all rows, the whole cache: what XLA and compiled steps run)."""

from typing import Dict, List

import pytest
import torch

from lit_gpt.generate import Batch, RowSampling, generate
from lit_gpt.utils import LitError
from test_generate import naive_greedy, tiny_model

ATTENTION_KINDS = [
    pytest.param({}, id="gqa"),
    pytest.param({"sliding_window_size": 5}, id="sliding-window"),
    pytest.param({"attention_logit_softcapping": 20.0}, id="softcapped"),
    pytest.param({"attention_sinks": True}, id="sinks"),
    pytest.param({"norm_qk": "per_head", "n_query_groups": 4}, id="qk-norm"),
]


def prompts(n: int, seed: int = 3) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g) for _ in range(n)]


@torch.no_grad()
def run_schedule(model, seqs: List[torch.Tensor], budget: List[int], rows: int, static: bool,
                 sampling: Dict[int, RowSampling] = None) -> List[List[int]]:
    """Sequences join as rows free up (staggered: one per step while rows are free), each leaves after its budget."""
    batch = Batch(model, rows, 48, static=static, exact_length=True)
    out: List[List[int]] = [[] for _ in seqs]
    waiting, in_row = list(range(len(seqs))), {}
    while waiting or in_row:
        if waiting and batch.free_rows():
            i, row = waiting.pop(0), batch.free_rows()[-1]  # the highest free row: rows in between stay idle
            first = batch.join([row], seqs[i].view(1, -1), sampling=[(sampling or {}).get(i, RowSampling())])
            in_row[row] = i
            out[i].append(int(first[0]))
        else:
            tokens = batch.step().tolist()
            for row, i in list(in_row.items()):
                if len(out[i]) < budget[i]:
                    out[i].append(tokens[row])
        for row, i in list(in_row.items()):
            if len(out[i]) >= budget[i]:
                batch.leave(row)
                del in_row[row]
    return out


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("overrides", ATTENTION_KINDS)
def test_rows_joining_and_leaving_generate_what_each_would_alone(overrides, static):
    model = tiny_model(**overrides)
    seqs = prompts(7)
    budget = [5 + 3 * (i % 4) for i in range(7)]
    out = run_schedule(model, seqs, budget, rows=3, static=static)
    for i, (seq, n) in enumerate(zip(seqs, budget)):
        assert out[i] == naive_greedy(model, seq, n).tolist(), f"sequence {i}"


def test_a_seeded_row_samples_the_same_whatever_shares_its_batch():
    model = tiny_model()
    seqs = prompts(4)
    seeded = {0: RowSampling(0.9, 0.95, torch.Generator().manual_seed(7))}
    alone = run_schedule(model, seqs[:1], [12], rows=1, static=False, sampling=seeded)[0]
    seeded = {0: RowSampling(0.9, 0.95, torch.Generator().manual_seed(7)),
              2: RowSampling(1.0, 1.0, torch.Generator().manual_seed(1))}
    shared = run_schedule(model, seqs, [12, 9, 12, 6], rows=4, static=False, sampling=seeded)
    assert shared[0] == alone
    assert shared[1] == naive_greedy(model, seqs[1], 9).tolist()  # greedy rows stay greedy beside sampled ones
    assert shared[2] != naive_greedy(model, seqs[2], 12).tolist()  # the sampled row did sample
    static_shared = run_schedule(model, seqs, [12, 9, 12, 6], rows=4, static=True, sampling={
        0: RowSampling(0.9, 0.95, torch.Generator().manual_seed(7))})
    assert static_shared[0] == alone


def test_generate_stream_is_a_batch_all_rows_join_at_once():
    model = tiny_model()
    rows = torch.stack([p[:3] for p in prompts(3)])
    out = generate(model, rows, 10)
    with torch.no_grad():
        batch = Batch(model, 3, 13, exact_length=True)
        steps = [batch.join(range(3), rows)] + [batch.step() for _ in range(9)]
    assert torch.equal(out, torch.stack(steps, dim=1))


@torch.no_grad()
def test_eager_steps_run_the_rows_and_positions_in_use_only(monkeypatch):
    model = tiny_model(block_size=256)
    batch = Batch(model, 4, 200, exact_length=True)
    seen = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda idx, *a, **kw: seen.append((idx.shape, kw.get("cache_length")))
                        or real(idx, *a, **kw))
    batch.join([1], prompts(1)[0][:4].view(1, -1))
    batch.step()
    assert seen[-1] == ((2, 1), Batch.VISIBLE_MULTIPLE)  # rows 0..1 (row 0 idle), 64 of the 200 positions
    static = Batch(model, 4, 200, static=True, exact_length=True)
    static.join([1], prompts(1)[0][:4].view(1, -1))
    static.step()
    assert seen[-1] == ((4, 1), None)  # every row over the whole cache: one shape for every step


@torch.no_grad()
def test_misuse_is_refused():
    model = tiny_model()
    batch = Batch(model, 2, 16, exact_length=True)
    with pytest.raises(ValueError, match="no row is in use"):
        batch.step()
    batch.join([0], torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="rows in use: \\[0\\]"):
        batch.join([0], torch.tensor([[1, 2, 3]]))
    with pytest.raises(LitError, match="does not fit the KV cache of 16"):
        batch.join([1], torch.ones(1, 17, dtype=torch.long))
    batch.leave(0)
    assert batch.free_rows() == [0, 1]


def test_per_row_draws_sample_each_token_with_its_probability():
    """The per-row race's Exp(1) draws (`_exponential`, -log of uniforms: cheaper than `exponential_` on the CPU) are
    positive, and argmax(p / E) picks each token with its probability p (temperature 1, no nucleus)."""
    from lit_gpt.generate import _exponential
    from lit_gpt.sampling import sample

    n, p = 20000, torch.tensor([0.5, 0.3, 0.15, 0.05])
    noise = _exponential(4 * n, torch.Generator().manual_seed(0)).view(n, 4)
    assert bool((noise > 0).all()) and abs(float(noise.mean()) - 1) < 0.02
    picked = sample(p.log().expand(n, 4), temperature=torch.ones(n), top_p=1.0, noise=noise)
    freq = torch.bincount(picked, minlength=4).float() / n
    assert torch.allclose(freq, p, atol=0.015), freq
