"""The serving engine's scheduling (lit_gpt/recipes/serving.py), in this process on the tiny checkpoint: chunked
prefill between decode steps, several prompts in one prefill call, and the prefix cache, each against the engine
that prefills whole prompts and shares nothing (the same greedy tokens, the same scores). The same behaviours
through the real `openai` client on the real SmolLM2 server: tests/test_serve.py (`test_shared_prefix_...`,
`test_long_prompt_...`); on XLA: tests/xla/test_xla_serve_chunked.py."""

from typing import Any, Dict, List, Optional

import pytest
import torch


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from lit_gpt.recipes.evaluate import load_eval_model

    return load_eval_model(tiny_dir, accelerator="cpu", precision="32-true")


def engine(loaded: Any, **kwargs: Any) -> Any:
    from lit_gpt.recipes.serving import Engine

    return Engine(loaded, **{"slots": 4, "max_seq_length": 128, "max_queue": 64, **kwargs})


def job(ids: List[int], max_tokens: int = 6, **kwargs: Any) -> Any:
    from lit_gpt.recipes.serving import Job

    events: List[Any] = []
    j = Job(list(ids), max_tokens=max_tokens, emit=lambda *e: events.append(e), **kwargs)
    j.events = events  # what the HTTP layer would receive
    return j


def drain(eng: Any, jobs: List[Any]) -> List[str]:
    eng.submit(jobs)
    with torch.inference_mode():
        while eng.busy():
            eng.iterate()
    return ["".join(e[1] for e in j.events if e[0] == "text") + "|" + j.events[-1][1] for j in jobs]


def prompts(loaded: Any) -> List[Dict[str, Any]]:
    """Five prompts sharing a 40-token prefix (two of them equal: a request's `n` choices), two others, one scored
    (echo with logprobs) and one with logprobs."""
    tok = loaded.tokenizer
    system = tok.encode("You are a careful assistant who answers in one short sentence. " * 3).tolist()[:40]
    out = [dict(ids=system + tok.encode(f"Question {i}: what is {i} plus {i}?").tolist()) for i in range(4)]
    out.append(dict(ids=out[0]["ids"]))
    out.append(dict(ids=tok.encode("Once upon a time").tolist(), logprobs=2))
    out.append(dict(ids=system + tok.encode("Score me.").tolist(), max_tokens=0, logprobs=1, echo_scores=True))
    out.append(dict(ids=tok.encode("The capital of France is " * 12).tolist(), max_tokens=10))
    return out


def run(loaded: Any, **flags: Any) -> Any:
    eng = engine(loaded, **flags)
    jobs = [job(**p) for p in prompts(loaded)]
    return eng, jobs, drain(eng, jobs)


def test_chunked_prefill_and_the_prefix_cache_keep_the_greedy_tokens_and_scores(loaded):
    whole, whole_jobs, expected = run(loaded, prefill_chunk=0, prefix_cache=False)
    eng, jobs, got = run(loaded, prefill_chunk=8, prefix_cache=True)
    assert got == expected
    for a, b in zip(jobs, whole_jobs):
        assert a.generated_ids == b.generated_ids
        for mine, ref in ((a.scores, b.scores), (a.prompt_scores or [], b.prompt_scores or [])):
            assert len(mine) == len(ref), (a, b)
            assert [s[0] for s in mine] == pytest.approx([s[0] for s in ref], abs=1e-4)
            assert [[i for i, _ in s[1]] for s in mine][:3] == [[i for i, _ in s[1]] for s in ref][:3]
    assert len(jobs[6].prompt_scores) == len(jobs[6].prompt_ids) - 1  # every prompt token after the first
    total = sum(len(p["ids"]) for p in prompts(loaded))
    assert whole.stats["prefill_tokens"] == total and whole.stats["cached_tokens"] == 0
    # the shared 32 tokens (two blocks of 16) computed once, the equal prompt reused but for its last token
    assert eng.stats["prefill_tokens"] + eng.stats["cached_tokens"] == total
    assert eng.stats["cached_tokens"] >= 4 * 32 + 16, eng.stats
    # 8-token chunks: the long prompt alone takes several calls
    assert eng.stats["prefill_calls"] > len(prompts(loaded)[-1]["ids"]) // 8


@pytest.mark.parametrize("ride_along", [True, False], ids=["riding", "own-call"])
def test_a_long_prompt_is_prefilled_between_the_decode_steps_of_the_streams_in_flight(loaded, ride_along):
    """A chunk per step boundary while a stream decodes; on eager backends the chunk rides along in the decode
    step's forward (one forward per boundary), else it is a prefill call of its own (two)."""
    eng = engine(loaded, prefill_chunk=8, prefix_cache=False)
    eng.ride_along = ride_along
    forwards: List[int] = []
    eng.batch.gpt.register_forward_pre_hook(lambda *args: forwards.append(1))
    short = job(loaded.tokenizer.encode("Hello").tolist(), max_tokens=40)
    eng.submit([short])
    with torch.inference_mode():
        eng.iterate()
        assert short.generated == 2  # prefill's token and one decode step
        long = job(loaded.tokenizer.encode("A long story. " * 20).tolist(), max_tokens=3)
        eng.submit([long])
        steps = 0
        while long.prefilling or long.row is None:
            before, calls = short.generated, len(forwards)
            eng.iterate()
            steps += 1
            assert short.generated == before + 1  # the stream got its token at every step boundary
            assert len(forwards) - calls == (1 if ride_along else 2)
        # its last chunk gave its first token; a prefill call of its own comes before the decode step, which then
        # takes its row too
        assert long.generated == (1 if ride_along else 2)
    assert steps == -(-len(long.prompt_ids) // 8)  # one chunk of 8 per step boundary
    assert eng.stats["prefill_tokens"] == len(short.prompt_ids) + len(long.prompt_ids)


def test_chunks_ride_along_on_eager_backends_unless_turned_off(loaded):
    """`--prefill_with_decode` (default true) sets whether an eager engine's chunks ride along in the decode step."""
    import inspect

    from lit_gpt.recipes.serve import serve

    assert engine(loaded).ride_along and not engine(loaded, prefill_with_decode=False).ride_along
    assert inspect.signature(serve).parameters["prefill_with_decode"].default is True


def test_sampled_rows_draw_the_same_tokens_whether_chunks_ride_along_or_not(loaded):
    """Seeded sampled requests (each row's draws from its own generator) get the same tokens when their prompts'
    chunks ride along in decode steps as when they are prefill calls of their own, and as with whole prompts."""
    from lit_gpt.generate import RowSampling

    tok = loaded.tokenizer
    texts = ["Hello there", "A long story about a fox. " * 6, "Once upon a time", "The rain in Spain " * 4]

    def sampled(ride_along: bool, chunk: int) -> List[List[int]]:
        eng = engine(loaded, prefill_chunk=chunk, prefix_cache=False)
        eng.ride_along = ride_along
        jobs = [job(tok.encode(t).tolist(), max_tokens=12,
                    sampling=RowSampling(0.9, 0.95, torch.Generator().manual_seed(i))) for i, t in enumerate(texts)]
        eng.submit(jobs[:1])
        with torch.inference_mode():
            eng.iterate()  # the first row decodes: the others' prompts come in chunks between its steps
        drain(eng, jobs[1:])
        return [j.generated_ids for j in jobs]

    riding = sampled(True, 8)
    assert riding == sampled(False, 8) == sampled(True, 0)
    assert len({tuple(r) for r in riding}) == len(texts)


def test_waiting_prompts_share_one_prefill_call(loaded):
    """With nothing decoding, the waiting prompts are prefilled whole in one call; while rows decode, one call
    of `prefill_chunk` tokens per step boundary, shared first come first served."""
    tok = loaded.tokenizer
    eng = engine(loaded, prefill_chunk=8, prefix_cache=False)
    first = [job(tok.encode(f"Prompt number {i} is here").tolist(), max_tokens=30) for i in range(3)]
    eng.submit(first)
    with torch.inference_mode():
        eng.iterate()
        assert eng.stats["prefill_calls"] == 1 and all(not j.prefilling for j in first)
        late = [job(list(range(100, 120)), max_tokens=2)]  # 20 tokens
        eng.submit(late)
        eng.iterate()
        assert eng.stats["prefill_calls"] == 2 and late[0].done_pos == 8  # one chunk of 8 while rows decode


def test_a_negative_prefill_chunk_is_one_line():
    from lit_gpt.recipes.serve import check_serve_args
    from lit_gpt.utils import LitError

    with pytest.raises(LitError, match=r"^--prefill_chunk must be >= 0 \(0: whole prompts\), got -1$"):
        check_serve_args(prefill_chunk=-1)


class _SilentDecoder:
    """The engine streams text through its tokenizer's decoder; the tiny transformers model has no tokenizer (the
    test compares token ids)."""

    def step(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@torch.inference_mode()  # as the engine's thread runs (its caches are inference tensors)
def test_a_sliding_window_model_is_prefilled_in_chunks_with_the_tokens_of_transformers(tmp_path):
    """Tiny Gemma 3 (five sliding layers of window 4 to one global, tests/tiny_hf.py): its ring caches are prefilled
    in chunks of 3 tokens between decode steps, prompts shorter and longer than the window and than a chunk, some
    sitting through decode steps between their chunks while other rows decode, some waiting for a free row; every
    answer equals transformers' greedy `generate`, and prefix caching is off."""
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")  # noqa: F841
    from tiny_hf import VOCAB, hf_to_lit

    from lit_gpt.recipes.serving import Engine
    from lit_gpt.runtime import Runtime

    hf_model, model = hf_to_lit("gemma3", tmp_path, seed=3)
    tokenizer = SimpleNamespace(stream_decoder=lambda skip_special_tokens: _SilentDecoder())
    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, runtime=Runtime(None, torch.device("cpu")),
                             block_size=model.config.block_size)
    lines: List[str] = []
    eng = Engine(loaded, slots=3, max_seq_length=40, max_queue=8, prefill_chunk=3, log=lines.append)
    assert eng.ring and not eng.prefix_cache and eng.chunk == 3, lines
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (2, 13, 9, 5, 11)]
    budget = [12, 6, 9, 7, 5]
    expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, budget)]
    jobs = [job(p, max_tokens=n) for p, n in zip(prompts, budget)]
    eng.submit(jobs[:1])
    eng.iterate()  # the first row decodes from here on: the next prompts come in chunks of 3 between its steps
    eng.submit(jobs[1:])  # two join now (the 13- and 9-token prompts: several steps each), two when rows free up
    held = 0
    while eng.busy():
        held += sum(j.prefilling and j.row is not None and j.done_pos > 0 for j in jobs)
        eng.iterate()
    assert held > 0  # some row sat through decode steps between its chunks
    assert [j.generated_ids for j in jobs] == expected
    assert eng.stats["prefill_calls"] > len(prompts) and eng.stats["cached_tokens"] == 0


def test_the_prefill_chunk_bench_runs_both_ways(tiny_dir, monkeypatch):
    """bench/prefill_chunk.py (what --prefill_chunk's default was chosen from) on the tiny checkpoint, small sizes:
    both ways of a chunk timed, the prompts prefilled in chunks while the streams decode."""
    import importlib.util
    import sys

    from child_env import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_prefill_chunk", ROOT / "bench" / "prefill_chunk.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_prefill_chunk", bench)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        (row,) = bench.main(checkpoint_dir=tiny_dir, chunks=[8], prompt_tokens=40, streams=2, alone_steps=3)["rows"]
    finally:
        torch.set_num_threads(threads)
    assert row["chunk"] == 8 and row["decode_step_p50_ms"] > 0
    for way in ("riding", "own_call"):  # 2 prompts of 40 tokens in chunks of 8: 10 boundaries, alternating
        assert row[way]["boundaries"] == 5 and row[way]["p90_ms"] >= row[way]["p50_ms"] > 0, row
