"""Benchmark finetune/lora.py and finetune/adapter.py: training tokens/s, MFU and peak memory, on the CPU or a GPU.

    python bench/finetune.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python bench/finetune.py --setting gpu --litgpt_path /tmp/litgpt_pkg --results_file bench/results/finetune_gpu.json

`--setting gpu` is the setting of the GPU finetuning targets: random weights in SmolLM2-1.7B-Instruct's architecture
(written to the work directory; the tokenizer comes from --checkpoint_dir, the same for every SmolLM2), bf16-true,
micro batch 4, global batch 16, max length 512, synthetic Alpaca-style rows of 330-430 tokens, 60 steps. Contenders:
our recipe eager and with `--train.compile true`, LoRA with `--quantize bnb.nf4` (QLoRA; its peak memory against
bf16 LoRA's), and litgpt where --litgpt_path is given. Reported per run: steady padded tokens/s and MFU as the
recipe computes them (compiling and first steps apart), whole-loop padded tokens/s (every step's time counted) and
the peak memory (torch.cuda.max_memory_allocated, as each recipe prints it).

The CPU setting:

Setting (the one litgpt's numbers below were taken with): fp32, micro batch 4 (one iteration = one optimizer
step of 4 samples), max length 128, Alpaca-style samples of 70-100 tokens (prompt template + random words,
synthetic so the benchmark runs offline). Each recipe runs unmodified in its own process (`python
finetune/X.py ...`); its peak RSS comes from `wait4` on that process, its throughput from its metrics.csv:
tokens between the end of the warm-up steps and the last step over the training time between them (the
recipe's own clock, which excludes start-up, data loading and checkpoint writing).

Reference, litgpt 0.5.13 on a quiet 2-core machine: LoRA 194 tokens/s (1.91 s/iteration, 2.35 GiB),
adapter 209 tokens/s (1.76 s/iteration, 2.18 GiB); litgpt counts padded tokens (input_ids.numel()). Machines
differ, so run litgpt here too, alternating with ours on the same data:

    pip install --no-deps --target /tmp/litgpt_pkg litgpt==0.5.13 psutil
    python bench/finetune.py --litgpt_path /tmp/litgpt_pkg --repeats 2

Measured that way on the quiet 2-core development machine (2026-11-22; medians of 2 runs each, 15 iterations),
after the head was restricted to the labelled positions: LoRA 1.80 s/iteration and 2.38 GiB peak RSS vs litgpt's
2.31 s and 2.90 GiB (1.28x, 18% less memory); adapter 1.71 s and 2.21 GiB vs 2.07 s and 2.68 GiB (1.21x, 18%
less). Single runs scatter by +-10% on that machine (LoRA 1.95 and 1.65 s), and its speed drifts between sessions
(litgpt's LoRA took 2.57 s/iteration in an earlier one), so compare within one invocation. Matrix products are ~64%
of our step and run at ~140 GFLOP/s, this CPU's `torch.mm` peak for these shapes: the rest of a step (attention,
norms, RoPE, dropout, the optimizer) is what is left to gain on.
"""

import csv
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Literal, Optional, Sequence

from lit_gpt import data
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
LITGPT = {"lora": (194.0, 1.91, 2.35), "adapter": (209.0, 1.76, 2.18)}  # tokens/s, s/iteration, GiB
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point government"
    " company number group problem fact be have do say get make go know take see come think look want give use find"
    " tell ask seem feel try leave call good new first last long great little own other old right big high different"
    " small large next early young important few public bad same able"
).split()


SETTINGS = {
    "cpu": dict(precision="32-true", micro=4, global_batch=4, max_len=128, lengths=(70, 100), steps=15, model=None),
    "gpu": dict(precision="bf16-true", micro=4, global_batch=16, max_len=512, lengths=(330, 430), steps=60,
                model="SmolLM2-1.7B-Instruct"),
}


def random_checkpoint(work: Path, model: str, tokenizer_dir: Path) -> Path:
    """Random bf16 weights in `model`'s architecture (a `Config.names()` entry) with `tokenizer_dir`'s tokenizer,
    in a folder named after the model (litgpt picks its config by the folder's name)."""
    import shutil

    import torch

    from lit_gpt.config import Config
    from load import make_checkpoint  # bench/load.py

    folder = work / "random" / model
    make_checkpoint(folder / "lit_model.pth", Config.from_name(model), torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_dir / name).is_file() and not (folder / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def synthetic_rows(checkpoint_dir: Path, n: int, seed: int = 0, lengths=(70, 100)) -> List[dict]:
    """`n` instruction rows whose tokenized sample (alpaca prompt + response + EOS) has `lengths` tokens."""
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_name("alpaca")
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        target = rng.randint(*lengths)
        instruction = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))).capitalize() + "."
        prompt_len = tokenizer.encode(style.apply(instruction)).numel()
        words: List[str] = []
        while prompt_len + tokenizer.encode(" ".join(words), bos=False, eos=True).numel() < target:
            words.append(rng.choice(WORDS))
        total = prompt_len + tokenizer.encode(" ".join(words), bos=False, eos=True).numel()
        if words and lengths[0] <= total <= lengths[1]:
            rows.append({"instruction": instruction, "input": "", "output": " ".join(words)})
    return rows


def run_recipe(method: str, checkpoint_dir: Path, data_dir: Path, out_dir: Path, steps: int, setting: dict,
               extra: Sequence[str] = ()) -> Dict[str, float]:
    cmd = [
        sys.executable, str(ROOT / "finetune" / f"{method}.py"),
        "--checkpoint_dir", str(checkpoint_dir), "--data.data_dir", str(data_dir), "--out_dir", str(out_dir),
        "--precision", setting["precision"], "--devices", "1", "--train.max_steps", str(steps),
        "--train.micro_batch_size", str(setting["micro"]), "--train.global_batch_size", str(setting["global_batch"]),
        "--train.max_seq_length", str(setting["max_len"]), "--train.lr_warmup_steps", "2",
        "--train.save_interval", "null", "--train.log_interval", "1", "--eval.interval", "1000000",
        "--eval.final_validation", "false", "--eval.max_new_tokens", "0", *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    usage, stdout = _wait(proc, f"finetune/{method}.py")
    rows = list(csv.DictReader(open(next((out_dir / "logs" / "csv").glob("version_*/metrics.csv")))))
    rows = [r for r in rows if r.get("loss")]
    result = _steady(rows, usage)
    warm = min(3, len(rows) - 2)
    dt = float(rows[-1]["time"]) - float(rows[warm]["time"])
    result["tokens_per_s"] = (float(rows[-1]["tokens"]) - float(rows[warm]["tokens"])) / dt
    result["loss_first"], result["loss_last"] = float(rows[0]["loss"]), float(rows[-1]["loss"])
    # the recipe's own steady numbers (compiling and first steps apart) and the whole loop's
    last = rows[-1]
    result["recipe_padded_tokens_per_s"] = float(last["padded_tokens_per_sec"]) if last.get("padded_tokens_per_sec") else None
    result["mfu"] = float(last["mfu"]) if last.get("mfu") else None
    result.update(_whole_loop(rows), **_printed(stdout))
    return result


def _whole_loop(rows: List[dict]) -> Dict[str, float]:
    """Padded tokens/s over every step, the compiling and first ones included (cumulative columns)."""
    return {"whole_loop_padded_tokens_per_s": float(rows[-1]["lengths"]) / float(rows[-1]["time"])}


def _printed(stdout: str) -> Dict[str, Optional[float]]:
    """What a recipe prints at its end: the peak GPU memory ("Memory used: X GB") and our compilation count."""
    memory = re.findall(r"Memory used: ([0-9.]+) GB", stdout)
    compiles = re.findall(r"compilations: train step (\d+)", stdout)
    return {"peak_memory_gb": float(memory[-1]) if memory else None,
            "train_compiles": int(compiles[-1]) if compiles else None}


def _wait(proc: subprocess.Popen, what: str):
    """Wait for `proc` (draining its stderr) and return its resource usage; LitError if it failed."""
    # both pipes drained (stderr by a thread: progress bars) so that the child never blocks on a full pipe
    import threading

    stderr_lines: List[str] = []
    drain = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)
    drain.start()
    stdout = proc.stdout.read() if proc.stdout is not None else ""
    drain.join()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise LitError(f"{what} failed: {''.join(stderr_lines)[-2000:]}")
    return usage, stdout


def _steady(rows: List[dict], usage) -> Dict[str, float]:
    """Throughput between the end of the warm-up iterations and the last one (columns time, lengths, step)."""
    warm = min(3, len(rows) - 2)  # the first iterations include one-time costs (allocator growth, first kernels)
    a, b = rows[warm], rows[-1]
    dt = float(b["time"]) - float(a["time"])
    iterations = int(float(b["step"])) - int(float(a["step"]))
    return {
        "padded_tokens_per_s": (float(b["lengths"]) - float(a["lengths"])) / dt,
        "s_per_iteration": dt / iterations,
        "peak_rss_gib": usage.ru_maxrss * 1024 / 2**30,  # Linux reports KiB
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "iterations_timed": iterations,
    }


def run_litgpt(method: str, litgpt_path: Path, checkpoint_dir: Path, rows_file: Path, work: Path,
               steps: int, setting: dict) -> Dict[str, float]:
    """The same benchmark with litgpt's own recipe (`litgpt finetune_lora` / `finetune_adapter`), importable from
    `litgpt_path` (e.g. `pip install --no-deps --target DIR litgpt==0.5.13 psutil`). Its checkpoint directory
    links our converted weights (the state-dict names are the same) and gets litgpt's model_config.yaml."""
    env = {**os.environ, "PYTHONPATH": f"{litgpt_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ckpt = work / "litgpt_checkpoint" / "HuggingFaceTB" / checkpoint_dir.name
    if not (ckpt / "model_config.yaml").is_file():
        ckpt.mkdir(parents=True, exist_ok=True)
        if not (checkpoint_dir / "lit_model.pth").is_file():
            # litgpt reads torch.save files only: the same tensors (same state-dict names) in its format
            import torch

            from lit_gpt.weights import find_weights, load_weights

            torch.save(load_weights(find_weights(checkpoint_dir)), ckpt / "lit_model.pth")
        for name in ("lit_model.pth", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                     "config.json"):
            if (checkpoint_dir / name).is_file() and not (ckpt / name).exists():
                (ckpt / name).symlink_to((checkpoint_dir / name).resolve())
        code = ("import sys; from pathlib import Path; from litgpt import Config; from litgpt.utils import save_config;"
                " save_config(Config.from_name(sys.argv[1]), Path(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", code, checkpoint_dir.name, str(ckpt)], env=env, check=True)
    out = work / f"litgpt_{method}_{len(list(work.glob(f'litgpt_{method}_*')))}"
    cmd = [
        sys.executable, "-m", "litgpt", f"finetune_{method}", str(ckpt), "--data", "JSON",
        "--data.json_path", str(rows_file), "--data.val_split_fraction", "0.05", "--data.mask_prompt", "true",
        "--out_dir", str(out), "--precision", setting["precision"], "--devices", "1",
        "--train.max_steps", str(steps), "--train.micro_batch_size", str(setting["micro"]),
        "--train.global_batch_size", str(setting["global_batch"]), "--train.max_seq_length", str(setting["max_len"]),
        "--train.lr_warmup_steps", "2", "--train.save_interval", "1000000",
        "--train.log_interval", "1", "--eval.interval", "1000000", "--eval.final_validation", "false",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    usage, stdout = _wait(proc, f"litgpt finetune_{method}")
    rows = list(csv.DictReader(open(next((out / "logs" / "csv").glob("version_*/metrics.csv")))))
    rows = [{**r, "step": r["batches"]} for r in rows if r.get("lengths") and r.get("time")]
    return {**_steady(rows, usage), **_whole_loop(rows), **_printed(stdout)}


def main(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    setting: Literal["cpu", "gpu"] = "cpu",
    methods: List[str] = ["lora", "adapter"],
    steps: Optional[int] = None,
    repeats: int = 1,
    compile: Optional[bool] = None,
    qlora: Optional[bool] = None,
    litgpt_path: Optional[Path] = None,
    work_dir: Optional[Path] = None,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, Dict[str, float]]:
    """Benchmark the recipes (and, with `litgpt_path`, litgpt's on the same data, alternating run by run, so that
    a machine shared with other work slows all alike; the medians over `repeats` are reported).

    Args:
        checkpoint_dir: SmolLM2-135M(-Instruct) as a converted lit checkpoint: the model of the CPU setting, the
            tokenizer of the GPU one.
        setting: "cpu" (fp32, SmolLM2-135M, micro batch 4, max length 128, 15 steps) or "gpu" (the GPU finetuning
            targets' setting; see the top of this file).
        methods: Which recipes to run.
        steps: Iterations per run (default: the setting's; the first 3 are not timed).
        repeats: Runs per recipe.
        compile: Also run our recipe with --train.compile true (default: on in the GPU setting).
        qlora: Also run LoRA with --quantize bnb.nf4 (default: on in the GPU setting; needs bitsandbytes).
        litgpt_path: A directory from which litgpt 0.5.13 imports, to run it side by side.
        work_dir: Where the data and the runs go (default: a temporary directory).
        results_file: Also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    import statistics

    cfg = SETTINGS[setting]
    steps = steps or cfg["steps"]
    compile = setting == "gpu" if compile is None else compile
    qlora = setting == "gpu" if qlora is None else qlora
    if steps < 5:
        raise LitError("--steps must be >= 5 (3 warm-up steps are not timed)")
    checkpoint_dir = Path(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(work_dir) if work_dir is not None else Path(tmp)
        src = work / "rows.json"
        work.mkdir(parents=True, exist_ok=True)
        model_dir = random_checkpoint(work, cfg["model"], checkpoint_dir) if cfg["model"] else checkpoint_dir
        rows_needed = cfg["global_batch"] * steps + 8
        src.write_text(json.dumps(synthetic_rows(checkpoint_dir, rows_needed, lengths=cfg["lengths"])))
        records, bad = data.read_records(src)
        rows, bad_fields = data.records_to_rows(records, data.instruction_rows())
        meta = data.prepare(rows, bad + bad_fields, checkpoint_dir=model_dir, destination=work / "data",
                            source=str(src), max_seq_length=cfg["max_len"], val_split_fraction=0.05, seed=0)
        print(f"{setting} setting, {model_dir.name}: {meta['counts']['train']} samples, mean"
              f" {meta['counts']['mean_length']} tokens, longest {meta['counts']['longest']}", flush=True)
        results: Dict[str, Dict[str, float]] = {}
        for method in methods:
            contenders: Dict[str, Sequence[str]] = {"ours": ()}
            if compile:
                contenders["ours_compiled"] = ("--train.compile", "true")
            if qlora and method == "lora":
                contenders["ours_qlora"] = ("--quantize", "bnb.nf4")
            runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in [*contenders, "litgpt"]}
            for i in range(repeats):
                for name, extra in contenders.items():
                    r = run_recipe(method, model_dir, work / "data", work / f"out_{method}_{name}_{i}", steps, cfg,
                                   extra)
                    runs[name].append(r)
                    print(f"  {method} {name} run {i + 1}: {_describe(r)}", flush=True)
                if litgpt_path is not None:
                    r = run_litgpt(method, Path(litgpt_path), model_dir, src, work, steps, cfg)
                    runs["litgpt"].append(r)
                    print(f"  {method} litgpt run {i + 1}: {_describe(r)}", flush=True)
            for who, rs in runs.items():
                if rs:
                    results[f"{method}/{who}"] = {k: _median([r[k] for r in rs]) for k in rs[0]}
            r = results[f"{method}/ours"]
            line = f"{method}: {_describe(r)}, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
            ref = LITGPT.get(method)
            if ref and setting == "cpu":
                line += f" | published litgpt 0.5.13: {ref[1]:.2f} s/it, {ref[2]:.2f} GiB -> {ref[1] / r['s_per_iteration']:.2f}x"
            for name in contenders:
                if name != "ours":
                    o = results[f"{method}/{name}"]
                    line += f" | {name}: {r['s_per_iteration'] / o['s_per_iteration']:.2f}x speed"
                    if o.get("peak_memory_gb") and r.get("peak_memory_gb"):
                        line += f", {o['peak_memory_gb'] / r['peak_memory_gb']:.2f}x peak memory"
            if runs["litgpt"]:
                lg = results[f"{method}/litgpt"]
                line += (f" | litgpt here: {lg['s_per_iteration']:.2f} s/it -> {lg['s_per_iteration'] / r['s_per_iteration']:.2f}x,"
                         f" whole loop {r['whole_loop_padded_tokens_per_s'] / lg['whole_loop_padded_tokens_per_s']:.2f}x")
            print(line, flush=True)
    settings = {"setting": setting, "checkpoint": model_dir.name, "methods": list(methods), "steps": steps,
                "timed_from_step": 4, "repeats": repeats, "micro_batch_size": cfg["micro"],
                "global_batch_size": cfg["global_batch"], "max_seq_length": cfg["max_len"],
                "sample_tokens": list(cfg["lengths"]), "precision": cfg["precision"], "compile": compile,
                "qlora": qlora, "litgpt": litgpt_path is not None}
    result_files.write(results_file, "finetune", settings, results, note)
    return results


def _median(values: list):
    """The median of numbers; the first value when some are missing (None)."""
    import statistics

    return statistics.median(values) if all(isinstance(v, (int, float)) for v in values) else values[0]


def _describe(r: Dict[str, float]) -> str:
    text = f"{r['s_per_iteration']:.2f} s/it, {r['padded_tokens_per_s']:.0f} padded tokens/s steady"
    if r.get("whole_loop_padded_tokens_per_s"):
        text += f", {r['whole_loop_padded_tokens_per_s']:.0f} whole loop"
    if r.get("mfu"):
        text += f", MFU {r['mfu'] * 100:.1f}%"
    if r.get("peak_memory_gb"):
        text += f", peak {r['peak_memory_gb']:.2f} GB"
    if r.get("train_compiles"):
        text += f", {r['train_compiles']} compilations"
    return text + f", peak RSS {r['peak_rss_gib']:.2f} GiB"


if __name__ == "__main__":
    run_cli(main)
