"""How long the serving engine's step boundaries take while long prompts come in, by prefill chunk size: what
`--prefill_chunk`'s default (lit_gpt.recipes.serving.DEFAULT_PREFILL_CHUNK) was chosen from.

    python bench/prefill_chunk.py --results_file bench/results/serve_prefill_chunk_cpu.json

In this process (no HTTP: the engine's own loop, `Engine.iterate`), for each chunk size: 4 greedy streams decode
alone (their boundaries' times: a decode step), then 2 prompts of `prompt_tokens` tokens arrive and are prefilled
in chunks while the streams decode, then the streams decode alone again (a decode step: the median of both). The
boundaries alternate between the two ways a chunk can go: riding along in the decode step's forward
(`--prefill_with_decode true`, the default) and a prefill call of its own before it, so both see the same machine.
Reported per way: the boundaries' p50 and p90 (ms) and their ratio to a decode step alone (the burst scenario of
bench/serve.py asks for at most 3x), and prompt tokens per second of boundary time.
"""

import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from lit_gpt.utils import run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

DEFAULT_CHECKPOINT_DIR = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_size(loaded: Any, chunk: int, prompt_tokens: int, streams: int, alone_steps: int) -> Dict[str, Any]:
    from lit_gpt.recipes.serving import Engine, Job

    engine = Engine(loaded, slots=streams + 2, max_seq_length=prompt_tokens + 64, max_queue=8, prefill_chunk=chunk)
    tokenizer, gen = loaded.tokenizer, torch.Generator().manual_seed(0)

    def job(ids: List[int], n: int) -> Any:
        return Job(list(ids), max_tokens=n, emit=lambda *a: None)

    times: Dict[Any, List[float]] = {"alone": [], True: [], False: []}
    computed = {True: 0, False: 0}
    with torch.inference_mode():
        # the streams run through the whole burst (at most 2 x prompt_tokens / chunk boundaries)
        engine.submit([job(tokenizer.encode(f"Once upon a time, story {i}:").tolist(), prompt_tokens)
                       for i in range(streams)])
        for i in range(alone_steps + 5):  # the first 5: the streams' prompts, warming up
            t = time.perf_counter()
            engine.iterate()
            if i >= 5:
                times["alone"].append(time.perf_counter() - t)
        longs = [job(torch.randint(100, 40_000, (prompt_tokens,), generator=gen).tolist(), 4) for _ in range(2)]
        engine.submit(longs)
        i = 0
        while any(j.prefilling or j.row is None for j in longs):
            ride = engine.ride_along = i % 2 == 0
            before = engine.stats["prefill_tokens"]
            t = time.perf_counter()
            engine.iterate()
            times[ride].append(time.perf_counter() - t)
            computed[ride] += engine.stats["prefill_tokens"] - before
            i += 1
        while any(x is j for x in engine.jobs for j in longs):  # their last tokens
            engine.iterate()
        for _ in range(alone_steps):  # the streams alone again: the machine's pace after the burst too
            t = time.perf_counter()
            engine.iterate()
            times["alone"].append(time.perf_counter() - t)
    alone = percentile(times["alone"], 0.5)
    out: Dict[str, Any] = {"chunk": chunk, "decode_step_p50_ms": 1000 * alone}
    for ride, name in ((True, "riding"), (False, "own_call")):
        p50, p90 = percentile(times[ride], 0.5), percentile(times[ride], 0.9)
        out[name] = {"boundaries": len(times[ride]), "p50_ms": 1000 * p50, "p90_ms": 1000 * p90,
                     "p50_x_decode": p50 / alone, "p90_x_decode": p90 / alone,
                     "prompt_tokens_per_s": computed[ride] / sum(times[ride])}
    return out


def main(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    chunks: List[int] = [16, 24, 32, 48, 64],
    prompt_tokens: int = 2000,
    streams: int = 4,
    alone_steps: int = 30,
    threads: Optional[int] = None,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, Any]:
    """Step boundary times by prefill chunk size (CPU, fp32).

    Args:
        checkpoint_dir: The model served (a converted checkpoint folder).
        chunks: The chunk sizes (prompt tokens per step boundary) measured.
        prompt_tokens: Tokens of each of the 2 long prompts.
        streams: Greedy streams decoding throughout.
        alone_steps: Decode steps timed before the long prompts arrive.
        threads: CPU threads (default: the usable cores).
        results_file: Also write the results to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    import os

    from lit_gpt.recipes.evaluate import load_eval_model

    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    loaded = load_eval_model(checkpoint_dir, accelerator="cpu", precision="32-true")
    rows = []
    for chunk in chunks:
        row = one_size(loaded, chunk, prompt_tokens, streams, alone_steps)
        r, o = row["riding"], row["own_call"]
        print(f"chunk {chunk:3d}: decode step {row['decode_step_p50_ms']:.0f} ms; riding p50 {r['p50_ms']:.0f} ms"
              f" (x{r['p50_x_decode']:.2f}) p90 {r['p90_ms']:.0f} (x{r['p90_x_decode']:.2f})"
              f" {r['prompt_tokens_per_s']:.0f} prompt tokens/s; own call p50 {o['p50_ms']:.0f} ms"
              f" (x{o['p50_x_decode']:.2f}) p90 {o['p90_ms']:.0f} (x{o['p90_x_decode']:.2f})"
              f" {o['prompt_tokens_per_s']:.0f} prompt tokens/s", flush=True)
        rows.append(row)
    settings = dict(checkpoint=f"{checkpoint_dir.parent.name}/{checkpoint_dir.name}", device="cpu", dtype="float32",
                    threads=threads, prompt_tokens=prompt_tokens, streams=streams, chunks=chunks)
    result_files.write(results_file, "prefill_chunk", settings, rows, note)
    return {"rows": rows}


if __name__ == "__main__":
    run_cli(main)
