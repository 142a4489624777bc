"""Benchmark finetune/lora.py and finetune/adapter.py on the CPU: training tokens/s and peak RSS.

    python bench/finetune.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

Setting (the one litgpt's numbers below were taken with): fp32, micro batch 4 (one iteration = one optimizer
step of 4 samples), max length 128, Alpaca-style samples of 70-100 tokens (prompt template + random words,
synthetic so the benchmark runs offline). Each recipe runs unmodified in its own process (`python
finetune/X.py ...`); its peak RSS comes from `wait4` on that process, its throughput from its metrics.csv:
tokens between the end of the warm-up steps and the last step over the training time between them (the
recipe's own clock, which excludes start-up, data loading and checkpoint writing).

Reference, litgpt 0.5.13 on a quiet 2-core machine: LoRA 194 tokens/s (1.91 s/iteration, 2.35 GiB),
adapter 209 tokens/s (1.76 s/iteration, 2.18 GiB); litgpt counts padded tokens (input_ids.numel()).
"""

import csv
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from lit_gpt import data
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

ROOT = Path(__file__).resolve().parents[1]
LITGPT = {"lora": (194.0, 1.91, 2.35), "adapter": (209.0, 1.76, 2.18)}  # tokens/s, s/iteration, GiB
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point government"
    " company number group problem fact be have do say get make go know take see come think look want give use find"
    " tell ask seem feel try leave call good new first last long great little own other old right big high different"
    " small large next early young important few public bad same able"
).split()


def synthetic_rows(checkpoint_dir: Path, n: int, seed: int = 0) -> List[dict]:
    """`n` instruction rows whose tokenized sample (alpaca prompt + response + EOS) has 70-100 tokens."""
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_name("alpaca")
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        target = rng.randint(70, 100)
        instruction = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))).capitalize() + "."
        prompt_len = tokenizer.encode(style.apply(instruction)).numel()
        words: List[str] = []
        while prompt_len + tokenizer.encode(" ".join(words), bos=False, eos=True).numel() < target:
            words.append(rng.choice(WORDS))
        total = prompt_len + tokenizer.encode(" ".join(words), bos=False, eos=True).numel()
        if words and 70 <= total <= 100:
            rows.append({"instruction": instruction, "input": "", "output": " ".join(words)})
    return rows


def run_recipe(method: str, checkpoint_dir: Path, data_dir: Path, out_dir: Path, steps: int) -> Dict[str, float]:
    cmd = [
        sys.executable, str(ROOT / "finetune" / f"{method}.py"),
        "--checkpoint_dir", str(checkpoint_dir), "--data.data_dir", str(data_dir), "--out_dir", str(out_dir),
        "--precision", "32-true", "--devices", "1",
        "--train.max_steps", str(steps), "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
        "--train.max_seq_length", "128", "--train.lr_warmup_steps", "2", "--train.save_interval", "null",
        "--train.log_interval", "1", "--eval.interval", "1000000", "--eval.final_validation", "false",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr_lines = []
    for line in proc.stderr:  # drain stderr (the progress bar) so the child never blocks on a full pipe
        stderr_lines.append(line)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise LitError(f"finetune/{method}.py failed: {''.join(stderr_lines)[-2000:]}")
    rows = list(csv.DictReader(open(next((out_dir / "logs" / "csv").glob("version_*/metrics.csv")))))
    rows = [r for r in rows if r.get("loss")]
    warm = min(3, len(rows) - 2)  # the first steps include one-time costs (allocator growth, first kernels)
    a, b = rows[warm], rows[-1]
    dt = float(b["time"]) - float(a["time"])
    iterations = int(float(b["step"])) - int(float(a["step"]))
    return {
        "padded_tokens_per_s": (float(b["lengths"]) - float(a["lengths"])) / dt,
        "tokens_per_s": (float(b["tokens"]) - float(a["tokens"])) / dt,
        "s_per_iteration": dt / iterations,
        "peak_rss_gib": usage.ru_maxrss * 1024 / 2**30,  # Linux reports KiB
        "iterations_timed": iterations,
        "loss_first": float(rows[0]["loss"]),
        "loss_last": float(b["loss"]),
    }


def main(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    methods: List[str] = ["lora", "adapter"],
    steps: int = 15,
    work_dir: Optional[Path] = None,
    json_out: Optional[Path] = None,
) -> Dict[str, Dict[str, float]]:
    """Benchmark the recipes.

    Args:
        checkpoint_dir: SmolLM2-135M(-Instruct) as a converted lit checkpoint.
        methods: Which recipes to run.
        steps: Iterations per recipe (the first 3 are not timed).
        work_dir: Where the data and the runs go (default: a temporary directory).
        json_out: Also write the results to this JSON file.
    """
    if steps < 5:
        raise LitError("--steps must be >= 5 (3 warm-up steps are not timed)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(work_dir) if work_dir is not None else Path(tmp)
        src = work / "rows.json"
        work.mkdir(parents=True, exist_ok=True)
        src.write_text(json.dumps(synthetic_rows(checkpoint_dir, 4 * steps + 8)))
        records, bad = data.read_records(src)
        rows, bad_fields = data.records_to_rows(records, data.instruction_rows())
        meta = data.prepare(rows, bad + bad_fields, checkpoint_dir=checkpoint_dir, destination=work / "data",
                            source=str(src), max_seq_length=128, val_split_fraction=0.05, seed=0)
        print(f"data: {meta['counts']['train']} samples, mean {meta['counts']['mean_length']} tokens,"
              f" longest {meta['counts']['longest']}", flush=True)
        results = {}
        for method in methods:
            r = run_recipe(method, checkpoint_dir, work / "data", work / f"out_{method}", steps)
            results[method] = r
            ref = LITGPT.get(method)
            vs = ""
            if ref:
                vs = (f" | litgpt 0.5.13: {ref[0]:.0f} tokens/s, {ref[1]:.2f} s/it, {ref[2]:.2f} GiB"
                      f" -> {r['padded_tokens_per_s'] / ref[0]:.2f}x")
            print(f"{method}: {r['padded_tokens_per_s']:.0f} tokens/s padded ({r['tokens_per_s']:.0f} real),"
                  f" {r['s_per_iteration']:.2f} s/iteration, peak RSS {r['peak_rss_gib']:.2f} GiB,"
                  f" loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}{vs}", flush=True)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    run_cli(main)
