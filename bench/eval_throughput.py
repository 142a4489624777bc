"""Evaluation throughput: the harness's `loglikelihood` requests on our model (eval/lm_eval.py's `LitLM`) against the
harness's own `--model hf` backend (HFLM) on the same weights (the checkpoint's transformers export), on the CPU:

    python bench/eval_throughput.py --results_file bench/results/eval_throughput_cpu.json

The requests are multiple-choice-like: `--requests` (context, continuation) pairs cut from bench/heldout.txt, a
context of 16 to `--max_context` tokens' worth of words and a continuation of 1 to 8 words, every 4 consecutive
requests sharing a context (as the choices of one question do). Both models get the same requests, `--batch_size`
per forward, float32, one run each (ours first, after one warm-up batch each). Reported: requests/s and tokens/s
(context + continuation tokens per second), the ratio to HFLM, and the largest relative difference of the
log-likelihoods (they must agree: the suite checks 1e-4) and whether every greedy flag agrees.

The generation row: `--gen_requests` `generate_until` requests, prompts of 8 to `--max_context` words cut from the
same text (mixed lengths), greedy, stopped at a blank line or after `--max_gen_toks` tokens; ours runs them as rows
of one continuous batch of `--batch_size` rows (lit_gpt.generate's `Batch`), HFLM as left-padded batches of
`--batch_size`. Reported: requests/s, new tokens/s (the tokens of the texts returned), and how many texts are equal.
"""

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

HELDOUT = Path(__file__).resolve().parent / "heldout.txt"


def make_requests(n: int, max_context_words: int, seed: int = 0) -> List[Tuple[str, str]]:
    words = HELDOUT.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < n:
        start = rng.randrange(0, len(words) - max_context_words - 10)
        context = " ".join(words[start: start + rng.randint(12, max_context_words)])
        for _ in range(min(4, n - len(pairs))):  # 4 choices per context
            s = rng.randrange(0, len(words) - 8)
            pairs.append((context, " " + " ".join(words[s: s + rng.randint(1, 8)])))
    return pairs


def make_prompts(n: int, max_context_words: int, seed: int = 1) -> List[str]:
    words = HELDOUT.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        start = rng.randrange(0, len(words) - max_context_words - 10)
        prompts.append(" ".join(words[start: start + rng.randint(8, max_context_words)]))
    return prompts


def timed_generation(lm: Any, requests: List[Any]) -> Tuple[float, List[str]]:
    lm.generate_until(requests[:2], disable_tqdm=True)  # warm-up
    t0 = time.perf_counter()
    out = lm.generate_until(requests, disable_tqdm=True)
    return time.perf_counter() - t0, out


def timed(lm: Any, requests: List[Any]) -> Tuple[float, List[Tuple[float, bool]]]:
    lm.loglikelihood(requests[:4], disable_tqdm=True)  # warm-up
    t0 = time.perf_counter()
    out = lm.loglikelihood(requests, disable_tqdm=True)
    return time.perf_counter() - t0, out


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    requests: int = 128,
    batch_size: int = 8,
    max_context: int = 192,
    gen_requests: int = 32,
    max_gen_toks: int = 32,
    threads: Optional[int] = None,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, Any]:
    """Loglikelihood requests/s and tokens/s of our harness model against the harness's HF backend (CPU).

    Args:
        checkpoint_dir: The model (a converted checkpoint folder); exported to transformers for HFLM.
        requests: How many (context, continuation) requests.
        batch_size: Requests per forward, for both.
        max_context: The longest context, in words of bench/heldout.txt (about 1.3 tokens each).
        gen_requests: How many generate_until requests (0: no generation row).
        max_gen_toks: New tokens per generation request at most.
        threads: torch threads (default: torch's).
        results_file: Also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from lit_gpt.convert import convert_lit_checkpoint
    from lit_gpt.recipes.evaluate import load_eval_model
    from lit_gpt.recipes.harness import LitLM

    if threads is not None:
        torch.set_num_threads(threads)
    pairs = make_requests(requests, max_context)
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": max_gen_toks, "do_sample": False}
    generations = [Instance("generate_until", {}, (p, gen_kwargs), i)
                   for i, p in enumerate(make_prompts(gen_requests, max_context))]
    loaded = load_eval_model(checkpoint_dir, accelerator="cpu", precision="32-true")
    ours = LitLM(loaded.model, loaded.tokenizer, loaded.runtime, batch_size=batch_size, progress=False)
    tokens = sum(len(ours.tok_encode(c + x)) for c, x in pairs)
    ours_s, ours_out = timed(ours, instances)
    ours_gen_s, ours_texts = timed_generation(ours, generations) if generations else (0.0, [])
    new_tokens = sum(len(ours.tok_encode(t)) for t in ours_texts)
    del ours, loaded
    with tempfile.TemporaryDirectory() as tmp:
        hf = convert_lit_checkpoint(checkpoint_dir, Path(tmp) / "hf")
        theirs = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=batch_size)
        theirs_s, theirs_out = timed(theirs, instances)
        theirs_gen_s, theirs_texts = timed_generation(theirs, generations) if generations else (0.0, [])
    rel = max(abs(a - b) / max(abs(b), 1e-12) for (a, _), (b, _) in zip(ours_out, theirs_out))
    results = {
        "ours_requests_per_s": len(pairs) / ours_s, "ours_tokens_per_s": tokens / ours_s, "ours_seconds": ours_s,
        "hflm_requests_per_s": len(pairs) / theirs_s, "hflm_tokens_per_s": tokens / theirs_s,
        "hflm_seconds": theirs_s, "ours_speedup": theirs_s / ours_s,
        "max_relative_loglikelihood_difference": rel,
        "greedy_flags_agree": all(a[1] == b[1] for a, b in zip(ours_out, theirs_out)),
    }
    if generations:
        results.update({
            "ours_gen_requests_per_s": len(generations) / ours_gen_s, "ours_gen_tokens_per_s": new_tokens / ours_gen_s,
            "ours_gen_seconds": ours_gen_s, "hflm_gen_requests_per_s": len(generations) / theirs_gen_s,
            "hflm_gen_tokens_per_s": new_tokens / theirs_gen_s, "hflm_gen_seconds": theirs_gen_s,
            "ours_gen_speedup": theirs_gen_s / ours_gen_s,
            "gen_texts_equal": sum(a == b for a, b in zip(ours_texts, theirs_texts, strict=True)),
        })
    settings = {"checkpoint": "/".join(Path(checkpoint_dir).parts[-2:]), "requests": len(pairs), "tokens": tokens,
                "batch_size": batch_size, "max_context_words": max_context, "dtype": "float32", "device": "cpu",
                "torch_threads": torch.get_num_threads(), "runs": 1,
                "gen_requests": len(generations), "max_gen_toks": max_gen_toks, "new_tokens": new_tokens}
    for k, v in results.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}", file=sys.stderr)
    result_files.write(results_file, "eval_throughput", settings, results, note)
    return results


if __name__ == "__main__":
    run_cli(setup)
