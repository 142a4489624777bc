"""The server's paged KV cache (lit_gpt.kv_cache.PagedKVCache, lit_gpt/recipes/kv_blocks.py): the block allocator's
rules, the engine in this process on the tiny checkpoint (greedy tokens equal to each prompt generated alone with the
generation loop's per-row cache, short requests served together in a cache of few tokens while a long one waits for
blocks, shared prefixes held once), and a real server driven with the real `openai` client (--kv_cache_tokens: the
long request waits rather than failing, one that can never fit gets a 400, the blocks in /health and /metrics)."""

import threading
import time
from typing import Any, List

import httpx
import openai
import pytest
import torch

from lit_gpt.recipes.kv_blocks import BlockAllocator


# ------------------------------------------------------------------------------------------------ the allocator
def test_allocator_reserves_shares_by_hash_and_tokens_and_evicts_least_recently_released_first():
    kv = BlockAllocator(blocks=5, block_size=2, rows=3, columns=4)  # 4 blocks besides scratch
    assert kv.admit(0, tokens=5) == 0 and kv.rows[0] == [1, 2, 3] and kv.in_use() == 3
    assert kv.admit(1, tokens=3) is None and kv.rows[1] == []  # 2 blocks wanted, 1 free: nothing taken
    kv.publish(0)
    assert kv.dirty and kv.table[0].tolist() == [1, 2, 3, 0]
    ids = [7, 8, 9, 10, 11]
    kv.register(0, [101, 102], ids)  # its first two blocks computed
    kv.release(0)
    assert kv.table[0].tolist() == [0, 0, 0, 0] and kv.in_use() == 0 and list(kv.cached) == [2, 1]  # last first
    # a prompt continuing the same tokens shares both registered blocks (never trusting the hash alone)
    assert kv.admit(1, tokens=6, hashes=[101, 102], ids=[7, 8, 9, 99], reuse=2) == 1  # block 2's tokens differ
    assert kv.rows[1][0] == 1 and kv.refs[1] == 1 and kv.in_use() == 3
    assert kv.admit(2, tokens=2, hashes=[101], ids=ids, reuse=1) == 1 and kv.refs[1] == 2  # shared, counted once
    assert kv.in_use() == 3
    # the free blocks went first; the next allocation evicts the cached block 2 (its hash is forgotten)
    kv.release(2)
    assert kv.admit(2, tokens=2) == 0 and 102 not in kv.by_hash and kv.cached == {}
    kv.release(1)
    kv.release(2)
    assert kv.in_use() == 0 and kv.row_limit == 4 and kv.blocks_for(5) == 3


# ------------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from lit_gpt.recipes.evaluate import load_eval_model

    return load_eval_model(tiny_dir, accelerator="cpu", precision="32-true")


def job(ids: List[int], max_tokens: int, **kwargs: Any) -> Any:
    from lit_gpt.recipes.serving import Job

    events: List[Any] = []
    j = Job(list(ids), max_tokens=max_tokens, emit=lambda *e: events.append(e), **kwargs)
    j.events = events
    return j


def alone(loaded: Any, ids: List[int], max_tokens: int) -> List[int]:
    """The generation loop's greedy tokens for one prompt (its own per-row KV cache), cut after a stop id."""
    from lit_gpt.generate import generate

    out = generate(loaded.model, torch.tensor(ids), max_tokens, stop_ids=loaded.tokenizer.stop_ids).tolist()
    return out


def test_a_small_paged_cache_serves_short_requests_together_and_a_long_one_after_them(loaded):
    from lit_gpt.recipes.serving import Engine

    tok = loaded.tokenizer
    eng = Engine(loaded, slots=4, max_seq_length=128, max_queue=8, kv_cache_tokens=96, prefill_chunk=8)  # 6 blocks
    assert eng.request_tokens == 96 and eng.kv_blocks() == {"kv_blocks": 6, "kv_blocks_in_use": 0,
                                                            "kv_blocks_cached": 0}
    short = [job(tok.encode(f"Story {i}: once upon a time").tolist(), 6) for i in range(3)]  # a block each
    long = job(tok.encode("The capital of France is " * 12).tolist(), 20)  # 5 blocks: waits for the short ones
    assert len(long.prompt_ids) + 20 > 64
    eng.submit(short + [long])
    together, in_use = 0, []
    with torch.inference_mode():
        while eng.busy():
            eng.iterate()
            together = max(together, sum(j is not None for j in eng.jobs))
            in_use.append(eng.kv_blocks()["kv_blocks_in_use"])
            if long.row is None:  # still queued: the blocks it needs are held
                assert all(j.row is not None for j in short) and eng.waiting[0] is long
    assert together == 3 and max(in_use) <= 6 and in_use[-1] == 0
    for j in short + [long]:
        assert j.events[-1][0] == "end"
        assert j.generated_ids == alone(loaded, j.prompt_ids, j.max_tokens)[: len(j.generated_ids)]
        assert j.generated_ids == alone(loaded, j.prompt_ids, j.max_tokens)
    # a request that no row can ever hold is refused at once, in one line
    from lit_gpt.utils import LitError

    with pytest.raises(LitError, match=r"more than this server's KV cache holds for one request \(96 tokens\)"):
        eng.submit([job([1] * 90, 10)])


def test_shared_prefix_blocks_are_held_once_and_give_the_same_tokens(loaded):
    from lit_gpt.recipes.serving import Engine

    tok = loaded.tokenizer
    system = tok.encode("You are a careful assistant who answers in one short sentence. " * 6).tolist()[:48]
    assert len(system) == 48
    jobs = [job(system + tok.encode(f" Question {i}?").tolist(), 5) for i in range(3)]
    jobs.append(job(jobs[0].prompt_ids, 5))  # a second choice of the first prompt
    eng = Engine(loaded, slots=4, max_seq_length=96, max_queue=8, prefill_chunk=16)
    eng.submit(jobs)
    decoding = []  # blocks in use while all four decode
    with torch.inference_mode():
        while eng.busy():
            eng.iterate()
            if all(j is not None and not j.prefilling for j in eng.jobs):
                decoding.append(eng.kv_blocks()["kv_blocks_in_use"])
    for j in jobs:
        assert j.generated_ids == alone(loaded, j.prompt_ids, 5)
    # the 3 blocks of the system prompt computed once, shared by the 3 others
    assert eng.stats["cached_tokens"] >= 3 * 48, eng.stats
    need = [eng.kv.blocks_for(len(j.prompt_ids) + 5) for j in jobs]  # each alone
    assert decoding and set(decoding) == {sum(need) - 3 * 3}, (decoding, need)
    assert eng.kv_blocks()["kv_blocks_in_use"] == 0 and eng.kv_blocks()["kv_blocks_cached"] > 0


def test_decode_steps_of_rows_of_very_different_lengths_gather_by_group_and_give_the_same_tokens(loaded, monkeypatch):
    """Short rows decoding beside a long one: each decode step gathers the short rows' blocks only as far as they
    reach and the long row's as far as it does (`PagedDecode`, two groups), not every row as far as the longest; the
    greedy tokens are those of each prompt generated alone."""
    from lit_gpt import kv_cache
    from lit_gpt.recipes.serving import Engine

    monkeypatch.setattr(kv_cache.PagedDecode, "MIN_SAVED", 64)  # the tiny model's lengths: group from 64 positions
    grouped = []
    real = kv_cache.PagedDecode.attend

    def spy(self, *args):
        grouped.append([(rows.tolist(), length) for rows, length in self.groups] if self.pools else None)
        return real(self, *args)

    monkeypatch.setattr(kv_cache.PagedDecode, "attend", spy)
    tok = loaded.tokenizer
    long = job(tok.encode("The capital of France is Paris. " * 14).tolist()[:100], 6)
    short = [job(tok.encode(f"Story {i}: once").tolist(), 6) for i in range(3)]
    eng = Engine(loaded, slots=4, max_seq_length=128, max_queue=8)
    eng.submit(short + [long])
    with torch.inference_mode():
        while eng.busy():
            eng.iterate()
    for j in short + [long]:
        assert j.generated_ids == alone(loaded, j.prompt_ids, j.max_tokens)
    steps = [g for g in grouped if g is not None]
    assert steps and all(len(g) == 2 for g in steps), grouped
    (rows, length), (long_rows, long_length) = steps[0]
    assert sorted(rows) == [0, 1, 2] and long_rows == [3] and length == 16 and long_length == 112, steps[0]


def test_past_the_queue_bound_while_blocks_are_short_is_queue_full(loaded):
    from lit_gpt.recipes.serving import Engine, QueueFull

    eng = Engine(loaded, slots=4, max_seq_length=64, max_queue=1, kv_cache_tokens=64)
    with torch.inference_mode():
        eng.submit([job([5] * 40, 24)])  # every block
        eng.iterate()
        eng.submit([job([6] * 40, 24)])  # waits for the blocks (3 rows are free)
        eng.iterate()
        with pytest.raises(QueueFull, match="--max_queue 1"):
            eng.submit([job([7] * 4, 2)])


def test_sliding_window_rings_refuse_kv_cache_tokens_in_one_line():
    from types import SimpleNamespace

    from lit_gpt.config import Config
    from lit_gpt.model import GPT
    from lit_gpt.recipes.serving import Engine
    from lit_gpt.runtime import Runtime
    from lit_gpt.utils import LitError

    config = Config(block_size=64, vocab_size=64, n_layer=2, n_head=2, n_embd=16, sliding_window_size=8)
    # what Engine reads before it allocates the cache: a ring model is refused before anything is allocated
    loaded = SimpleNamespace(model=GPT(config), block_size=64, tokenizer=None,
                             runtime=Runtime(None, torch.device("cpu")))
    with pytest.raises(LitError, match="sliding-window layers keep a ring .* leave --kv_cache_tokens unset"):
        Engine(loaded, slots=2, max_seq_length=32, max_queue=1, kv_cache_tokens=64)


# ------------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def paged_server(tiny_dir, forks):
    from serve_client import ServerProcess

    # forked from the tests' fork server: without a fresh interpreter's imports
    server = ServerProcess(tiny_dir, "--slots", "4", "--max_seq_length", "128", "--kv_cache_tokens", "64",
                           "--max_queue", "4", forks=forks).start()
    try:
        yield server.ready()
    finally:
        server.stop()


def test_server_with_kv_cache_tokens_queues_what_does_not_fit_yet_and_refuses_what_never_fits(paged_server):
    client = paged_server.client()
    health = paged_server.health()
    assert (health["kv_blocks"], health["kv_blocks_in_use"]) == (4, 0), health
    # prompt + max_tokens beyond the 64 tokens the cache can give one request: 400 naming the flag
    with pytest.raises(openai.BadRequestError, match="--kv_cache_tokens"):
        client.completions.create(model=paged_server.model, prompt="Hello there", max_tokens=100, temperature=0)
    # four requests that each need every block: served one after the other, none refused
    prompt = "The capital of France is " * 6
    n = len(client.completions.create(model=paged_server.model, prompt=prompt, max_tokens=1, echo=True,
                                      logprobs=0, temperature=0).choices[0].logprobs.tokens) - 1
    results: List[Any] = [None] * 4
    seen_in_use: List[int] = []

    def ask(i: int) -> None:
        results[i] = client.completions.create(model=paged_server.model, prompt=prompt, max_tokens=64 - n,
                                               temperature=0, stop=None)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen_in_use.append(paged_server.health()["kv_blocks_in_use"])
        time.sleep(0.01)
    for t in threads:
        t.join()
    texts = {r.choices[0].text for r in results}
    assert len(texts) == 1 and all(r.usage.completion_tokens >= 1 for r in results)
    assert max(seen_in_use) <= 4
    metrics = httpx.get(paged_server.root + "/metrics", timeout=10, trust_env=False).text
    assert "lit_gpt_kv_cache_blocks 4.0" in metrics and "lit_gpt_kv_cache_blocks_in_use 0.0" in metrics


def test_a_kv_cache_of_less_than_one_block_is_one_line_before_loading():
    from lit_gpt.recipes.serve import check_serve_args
    from lit_gpt.utils import LitError

    with pytest.raises(LitError) as e:
        check_serve_args(kv_cache_tokens=8)
    assert str(e.value) == "--kv_cache_tokens must be >= 16 (one block of the KV cache), got 8"
