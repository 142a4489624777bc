"""Benchmark: the DPO step against the SFT step on the same data, same model, same settings (one invocation).

    python bench/dpo.py --results_file bench/results/dpo_cpu.json                        # CPU, eager (finetune/*.py)
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python bench/dpo.py --backend xla --results_file bench/results/xla_dpo_cpu1.json

Three LoRA runs of the one training loop on the same prepared preference folder (a preference sample is also an
SFT sample of its chosen reply), each recipe unmodified in its own process, interleaved `--repeats` times:

* `sft`: finetune/lora.py (xla/finetune/lora.py): cross-entropy on the chosen replies, B samples per step;
* `dpo_adapters_off`: finetune/dpo.py with `--dpo.reference adapters_off`: B pairs = 2B rows per step, plus one
  forward of those 2B rows without gradient, adapters switched off (the reference);
* `dpo_precomputed`: finetune/dpo.py with `--dpo.reference precomputed`: 2B rows per step, the reference
  log-probabilities computed once before training (that one-off pass is timed apart: `precompute_s`).

Expected cost in forward-pass units over B rows (F): a LoRA step is ~2F (the forward, and a backward that computes
the activations' gradients but no weight gradient of the frozen base: ~1F; the LoRA matrices are small); full
finetuning's is ~3F. So DPO precomputed = 2 x SFT (2B rows), DPO adapters_off = (2 x 2F + 2F) / 2F = 3 x SFT for
LoRA; the optimizer step and fixed per-step costs do not double, so measured ratios sit a little below.

The model is a random Llama in SmolLM2's layout shrunk to `--n_layer` layers of width `--n_embd` with SmolLM2's
tokenizer (from --checkpoint_dir), fp32; the rows are synthetic Alpaca-style prompts with two replies of similar
length (prompt + reply `--lengths` tokens). Reported per run: the median of the steady step times (steps that
compiled nothing, from the third on), from the loop's own per-step clock (`fit`'s summary `step_times`); per variant
the median over the repeats and the ratio to SFT per step (B pairs against B samples) and per padded token.
"""

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)
from finetune import WORDS  # bench/finetune.py: the same synthetic rows' words

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("sft", "dpo_adapters_off", "dpo_precomputed")
EXPECTED = {"sft": 1.0, "dpo_adapters_off": 3.0, "dpo_precomputed": 2.0}  # LoRA, forward units (see above)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def make_model(folder: Path, tokenizer_dir: Path, n_layer: int, n_embd: int) -> Path:
    """Random fp32 weights in SmolLM2-135M-Instruct's layout with n_layer layers of width n_embd (64-wide heads)."""
    import shutil

    import torch

    from lit_gpt import GPT, Config

    if not any((tokenizer_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise LitError(f"no tokenizer in {tokenizer_dir}: --checkpoint_dir must be a SmolLM2 checkpoint (its tokenizer"
                       " is used), e.g. checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")
    from lit_gpt.weights import save_weights

    n_head = max(1, n_embd // 64)
    config = Config.from_name("SmolLM2-135M-Instruct", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                              n_query_groups=n_head, head_size=n_embd // n_head, intermediate_size=4 * n_embd)
    torch.manual_seed(0)
    model = GPT(config)
    model.apply(model._init_weights)
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(model.state_dict(), folder)
    config.save(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def preference_rows(checkpoint_dir: Path, n: int, lengths=(90, 120), seed: int = 0) -> List[dict]:
    """`n` rows {prompt, chosen, rejected}: an Alpaca-style instruction and two replies of random words, each
    prompt + reply + EOS of `lengths` tokens."""
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_name("alpaca")
    rng = random.Random(seed)

    def reply(prompt_len: int) -> str:
        target = rng.randint(*lengths)
        words: List[str] = []
        while prompt_len + tokenizer.encode(" ".join(words), bos=False, eos=True).numel() < target:
            words.append(rng.choice(WORDS))
        return " ".join(words)

    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))).capitalize() + "."
        prompt_len = tokenizer.encode(style.apply(prompt)).numel()
        chosen, rejected = reply(prompt_len), reply(prompt_len)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def lora_run(script: str, backend: str, checkpoint_dir: Path, data_dir: Path, out_dir: Path, steps: int,
             micro: int, rows: int, max_len: int) -> List[str]:
    """A finetune recipe's timed run (finetune/SCRIPT or xla/finetune/SCRIPT): LoRA r=8 on every layer's attention
    and MLP, no dropout, one micro-batch of `rows` per step, no validation, no checkpoints (bench/packing.py too)."""
    folder = "xla/finetune" if backend == "xla" else "finetune"
    args = [f"{folder}/{script}", "--checkpoint_dir", str(checkpoint_dir), "--data.data_dir", str(data_dir),
            "--out_dir", str(out_dir), "--precision", "32-true", "--train.max_steps", str(steps),
            "--train.micro_batch_size", str(micro), "--train.global_batch_size", str(rows),
            "--train.max_seq_length", str(max_len), "--train.lr_warmup_steps", "2", "--train.learning_rate", "1e-4",
            "--train.save_interval", "null", "--train.log_interval", "1", "--train.seed", "3",
            "--eval.interval", "1000000", "--eval.final_validation", "false", "--eval.max_new_tokens", "0",
            "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0", "--lora_mlp", "true",
            "--lora_projection", "true"]
    if backend == "cpu":
        args += ["--accelerator", "cpu", "--devices", "1"]
    return args


def backend_devices(backend: str, bench: str) -> int:
    """Devices of the run: 1 on the CPU; on XLA PJRT_DEVICE's (CPU_NUM_DEVICES on XLA:CPU), one line without it."""
    if backend != "xla":
        return 1
    if os.environ.get("PJRT_DEVICE") is None:
        raise LitError(f"--backend xla needs PJRT_DEVICE (e.g. PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python {bench}"
                       " --backend xla)")
    return int(os.environ.get("CPU_NUM_DEVICES", "1")) if os.environ["PJRT_DEVICE"] == "CPU" else 1


def work_folder(work_dir: Optional[Path]) -> Any:
    """(folder, temporary directory or None): `work_dir`, or a temporary directory removed at the end."""
    tmp = tempfile.TemporaryDirectory() if work_dir is None else None
    work = Path(tmp.name) if tmp else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    return work, tmp


def command(variant: str, backend: str, checkpoint_dir: Path, data_dir: Path, out_dir: Path, steps: int,
            micro: int, rows: int, max_len: int) -> List[str]:
    """The recipe's command line for one variant."""
    args = lora_run("lora.py" if variant == "sft" else "dpo.py", backend, checkpoint_dir, data_dir, out_dir, steps,
                    micro, rows, max_len)
    if variant != "sft":
        args += ["--method", "lora", "--dpo.reference", variant[len("dpo_"):], "--dpo.beta", "0.1"]
    return args


def worker(argv: List[str], result_path: Path) -> None:
    """Run one recipe in this process (through jsonargparse, as its command line does) and write its summary; the
    precomputed reference's one-off pass is timed by wrapping the recipe's `with_reference`."""
    import importlib.util

    from jsonargparse import CLI

    spec = importlib.util.spec_from_file_location("bench_recipe", ROOT / argv[0])
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    timing: Dict[str, float] = {}
    if hasattr(recipe, "with_reference"):
        original = recipe.with_reference

        def timed(*a, **kw):
            t0 = time.perf_counter()
            original(*a, **kw)
            timing["precompute_s"] = time.perf_counter() - t0

        recipe.with_reference = timed
    t0 = time.perf_counter()
    summary = CLI(recipe.setup, args=argv[1:]) or {}
    keep = ("step_times", "tokens_per_sec", "padded_tokens_per_sec", "steady_steps", "train_compiles", "mfu")
    out = {k: summary.get(k) for k in keep if k in summary}
    out.update(timing, wall_s=time.perf_counter() - t0)
    result_path.write_text(json.dumps(out, default=float))


def run_one(argv: List[str], work: Path, tag: str) -> Dict[str, Any]:
    result_path = work / f"{tag}.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_worker", json.dumps(argv),
                           "--_result", str(result_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise LitError(f"{argv[0]} ({tag}) failed: {proc.stderr[-3000:]}")
    r = json.loads(result_path.read_text())
    steady = [(t, n) for t, compiles, n in r["step_times"][2:] if compiles == 0]
    if len(steady) < 3:
        raise LitError(f"{tag}: {len(steady)} steady steps (need >= 3): run more --steps")
    r["step_s"] = statistics.median(t for t, _ in steady)
    r["padded_tokens_per_step"] = statistics.median(n for _, n in steady)
    r["steady_steps_timed"] = len(steady)
    return r


def main(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    backend: Literal["cpu", "xla"] = "cpu",
    n_layer: int = 4,
    n_embd: int = 256,
    steps: int = 10,
    micro_batch_size: int = 4,
    max_seq_length: int = 128,
    lengths: List[int] = [90, 120],
    repeats: int = 2,
    work_dir: Optional[Path] = None,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, Any]:
    """Time SFT, DPO with the LoRA reference (adapters off) and DPO with the precomputed reference.

    Args:
        checkpoint_dir: A SmolLM2 checkpoint: its tokenizer is used (the weights are random).
        backend: "cpu" (finetune/*.py, eager) or "xla" (xla/finetune/*.py; set PJRT_DEVICE, CPU_NUM_DEVICES).
        n_layer: Layers of the random model.
        n_embd: Its width (64-wide heads, MLP 4x).
        steps: Optimizer steps per run (the first two and any that compiled are not timed).
        micro_batch_size: Samples (SFT) or pairs (DPO) per device per step; one micro-batch per step.
        max_seq_length: The recipes' --train.max_seq_length (XLA pads to powers of two up to it).
        lengths: Tokens of prompt + reply (+EOS) of each row, min and max.
        repeats: Rounds of the three runs, interleaved.
        work_dir: Where the model, the data and the runs go (default: a temporary directory).
        results_file: Also write the results to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    devices = backend_devices(backend, "bench/dpo.py")
    rows = micro_batch_size * devices
    work, tmp = work_folder(work_dir)
    model_dir = make_model(work / "model", Path(checkpoint_dir), n_layer, n_embd)
    pairs = rows * steps + 4
    (work / "pairs.json").write_text(json.dumps(preference_rows(model_dir, pairs, tuple(lengths))))
    data_dir = work / "pairs"
    prep = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_preferences.py"), "--checkpoint_dir", str(model_dir),
         "--data_file", str(work / "pairs.json"), "--destination_path", str(data_dir), "--prompt_style", "alpaca",
         "--val_split_fraction", str(4 / pairs), "--max_seq_length", str(max_seq_length)],
        cwd=ROOT, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if not k.startswith("PJRT")})
    if prep.returncode != 0:
        raise LitError(f"scripts/prepare_preferences.py failed: {prep.stderr[-2000:]}")

    runs: Dict[str, List[Dict[str, Any]]] = {v: [] for v in VARIANTS}
    commands: Dict[str, str] = {}
    for r in range(repeats):
        for variant in VARIANTS:
            argv = command(variant, backend, model_dir, data_dir, work / f"{variant}_{r}", steps, micro_batch_size,
                           rows, max_seq_length)
            commands[variant] = "python " + " ".join(argv)
            result = run_one(argv, work, f"{variant}_{r}")
            runs[variant].append(result)
            extra = (f", reference precompute {result['precompute_s']:.2f} s" if variant == "dpo_precomputed" else "")
            print(f"round {r + 1} {variant:>17}: step {result['step_s'] * 1000:8.1f} ms (median of"
                  f" {result['steady_steps_timed']} steady steps), {result['padded_tokens_per_step']:.0f} padded"
                  f" tokens/step{extra}", file=sys.stderr)

    results: Dict[str, Any] = {}
    sft = statistics.median(x["step_s"] for x in runs["sft"])
    sft_tokens = statistics.median(x["padded_tokens_per_step"] for x in runs["sft"])
    for variant in VARIANTS:
        step = statistics.median(x["step_s"] for x in runs[variant])
        tokens = statistics.median(x["padded_tokens_per_step"] for x in runs[variant])
        results[variant] = {
            "step_s": step, "step_s_runs": [x["step_s"] for x in runs[variant]],
            "padded_tokens_per_step": tokens, "padded_tokens_per_s": tokens / step,
            "ratio_to_sft_per_step": step / sft, "ratio_to_sft_per_padded_token": (step / tokens) / (sft / sft_tokens),
            "expected_ratio_per_step": EXPECTED[variant],
            "steady_steps_timed": [x["steady_steps_timed"] for x in runs[variant]],
            "train_compiles": [x.get("train_compiles") for x in runs[variant]],
            "wall_s": [x["wall_s"] for x in runs[variant]],
            "step_times": [x["step_times"] for x in runs[variant]],
        }
        if variant == "dpo_precomputed":
            pre = [x["precompute_s"] for x in runs[variant]]
            results[variant].update(precompute_s=statistics.median(pre), precompute_s_runs=pre, precompute_pairs=pairs,
                                    precompute_steps_equivalent=statistics.median(pre) / step)
        print(f"{variant:>17}: {step * 1000:8.1f} ms/step, {step / sft:.2f}x SFT per step (expected ~"
              f"{EXPECTED[variant]:.1f}x), {(step / tokens) / (sft / sft_tokens):.2f}x per padded token"
              + (f"; reference precompute {results[variant]['precompute_s']:.2f} s for {pairs} pairs"
                 if variant == "dpo_precomputed" else ""))
    settings = {"backend": backend, "devices": devices, "model": f"random SmolLM2-135M-Instruct layout, {n_layer}"
                f" layers, width {n_embd}", "n_layer": n_layer, "n_embd": n_embd, "vocab_size": 49152,
                "tokenizer": "SmolLM2", "precision": "32-true", "method": "lora", "lora_r": 8,
                "micro_batch_size": micro_batch_size, "rows_per_step": rows, "max_seq_length": max_seq_length,
                "row_tokens": list(lengths), "steps": steps, "timed_from_step": 3, "repeats": repeats, "pairs": pairs,
                "dpo_beta": 0.1, "dpo_loss": "sigmoid", "commands": commands}
    result_files.write(results_file, "dpo", settings, results, note)
    if tmp:
        tmp.cleanup()
    return results


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_worker":
        worker(json.loads(sys.argv[2]), Path(sys.argv[4]))
    else:
        run_cli(main)
