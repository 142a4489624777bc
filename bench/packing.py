"""Benchmark: packing (`--data.packing true`) against power-of-two padding, same data, same samples, one invocation.

    python bench/packing.py --results_file bench/results/packing_cpu.json                       # finetune/lora.py
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python bench/packing.py --backend xla --results_file bench/results/xla_packing_cpu8.json

1. The useful-token fraction: real (target and context) tokens over computed positions, of the batches the loop
   builds from the prepared samples: power-of-two padding (`--data.pad_pow2 true`, micro-batches of
   `--micro_batch_size` samples in the epoch's shuffled order) against packed rows of `--max_seq_length` (micro-
   batches of that many rows). Over the whole training set; no model needed.
2. Useful tokens per second: the LoRA recipe (finetune/lora.py, or xla/finetune/lora.py with `--backend xla`),
   unmodified, in its own process, padded then packed, interleaved `--repeats` times; the loop's own count of real
   tokens over its steady steps (`fit`'s summary), the ratio packed / padded per round. On XLA the padded run
   compiles its step once per length bucket: those steps are not steady and not timed (its wall time is reported).
3. The attention kernels for packed rows (CPU/CUDA choice): PyTorch SDPA with the (B, 1, T, T) block-diagonal mask
   (what the model runs) against SDPA's plain causal kernel (what an unpacked row runs), forward + backward at
   the row length; and whether FlexAttention's document mask (`torch.compile`d, the other candidate) trains here.

The data: `--samples` synthetic Alpaca-style rows (instruction, optional input, output of random words) whose token
counts under the Alpaca template follow a long-tailed log-normal (median ~150 tokens, a tail past 1000): shaped like
Alpaca, not Alpaca itself (the Hub is not reachable here); `--data_dir` measures prepared data of your own instead
(then part 2 trains on it). The model: a random Llama in SmolLM2's layout (bench/dpo.py's), fp32.
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)
from dpo import backend_devices, lora_run, make_model, run_one, work_folder  # bench/dpo.py's run helpers
from finetune import WORDS  # bench/finetune.py: the synthetic rows' words

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("padded", "packed")


def alpaca_shaped_rows(n: int, seed: int = 0) -> List[Dict[str, str]]:
    """`n` instruction rows whose lengths are long-tailed like Alpaca's: a short instruction, an input in 40% of
    the rows, an output of log-normal length (median ~70 words)."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    rows = []
    for _ in range(n):
        out = int(min(900, max(1, rng.lognormvariate(4.25, 0.9))))
        rows.append({"instruction": words(rng.randint(4, 25)), "input": words(rng.randint(3, 40)) if rng.random() < 0.4
                     else "", "output": words(out)})
    return rows


def fractions(data_dir: Path, max_seq_length: int, micro_batch_size: int, seed: int = 3) -> Dict[str, Any]:
    """Useful-token fractions of both layouts over the training set, batched as the loop batches it."""
    import torch

    from lit_gpt.batches import collate
    from lit_gpt.data import load_prepared
    from lit_gpt.packing import collate_packed, pack, rows_of, sample_positions, useful_fraction

    train = load_prepared(data_dir).train
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    padded = [collate([train[i] for i in order[s:s + micro_batch_size]], max_seq_length, pad_pow2=True)
              for s in range(0, len(order), micro_batch_size)]
    rows = pack(train, max_seq_length)
    packed = [collate_packed(rows_of(train, rows[s:s + micro_batch_size]), max_seq_length)
              for s in range(0, len(rows), micro_batch_size)]
    lengths = sorted(sample_positions(s, max_seq_length) for s in train)
    targets = lambda batches: sum(int((b["labels"] != -100).sum()) for b in batches) / sum(  # noqa: E731
        b["labels"].numel() for b in batches)
    return {
        "samples": len(train), "rows": len(rows), "samples_per_row": len(train) / len(rows),
        "length_median": lengths[len(lengths) // 2], "length_p90": lengths[int(0.9 * len(lengths))],
        "length_max": lengths[-1], "cropped": sum(s["input_ids"].numel() - 1 > max_seq_length for s in train),
        "useful_fraction": {"padded": useful_fraction(padded), "packed": useful_fraction(packed)},
        "target_fraction": {"padded": targets(padded), "packed": targets(packed)},
        "padded_lengths": sorted({b["input_ids"].size(1) for b in padded}),
    }


def attention_kernels(max_seq_length: int, batch: int = 2, heads: int = 4, head_size: int = 64,
                      docs: int = 6, repeats: int = 5) -> Dict[str, Any]:
    """SDPA with the block-diagonal mask against SDPA causal (forward + backward), and FlexAttention's document
    mask: does it compile and train here, in how long."""
    import torch
    import torch.nn.functional as F

    from lit_gpt.packing import document_mask

    torch.manual_seed(0)
    T = max_seq_length
    segments = torch.zeros(batch, T, dtype=torch.long)
    for b in range(batch):
        cuts = sorted(torch.randperm(T - 1)[: docs - 1].add(1).tolist()) + [T]
        start = 0
        for d, end in enumerate(cuts, start=1):
            segments[b, start:end] = d
            start = end
    mask = document_mask(segments, None)
    q, k, v = (torch.randn(batch, heads, T, head_size, requires_grad=True) for _ in range(3))

    def timed(fn) -> float:
        for _ in range(2):
            fn().sum().backward()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn().sum().backward()
        return (time.perf_counter() - t0) / repeats

    out: Dict[str, Any] = {
        "shape": [batch, heads, T, head_size], "documents_per_row": docs,
        "sdpa_mask_s": timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        "sdpa_causal_s": timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    out["sdpa_mask_over_causal"] = out["sdpa_mask_s"] / out["sdpa_causal_s"]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        same = lambda b, h, qi, ki: (segments[b, qi] == segments[b, ki]) & (qi >= ki)  # noqa: E731
        block = create_block_mask(same, batch, None, T, T, device="cpu")
        flex = torch.compile(flex_attention)
        t0 = time.perf_counter()
        with torch.no_grad():
            flex(q, k, v, block_mask=block)
        out["flex_forward_compile_s"] = time.perf_counter() - t0
        out["flex_s"] = timed(lambda: flex(q, k, v, block_mask=block))
        out["flex_trains"] = True
    except Exception as e:  # what happens is the measurement
        out["flex_trains"] = False
        out["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return out


def command(layout: str, backend: str, checkpoint_dir: Path, data_dir: Path, out_dir: Path, steps: int, micro: int,
            rows: int, max_len: int) -> List[str]:
    """The LoRA recipe's timed run, padded to powers of two or packed."""
    return lora_run("lora.py", backend, checkpoint_dir, data_dir, out_dir, steps, micro, rows, max_len) + [
        "--data.pad_pow2", "true", "--data.packing", "true" if layout == "packed" else "false"]


def main(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    backend: Literal["cpu", "xla"] = "cpu",
    data_dir: Optional[Path] = None,
    samples: int = 2000,
    max_seq_length: int = 512,
    micro_batch_size: int = 4,
    n_layer: int = 4,
    n_embd: int = 256,
    steps: int = 10,
    repeats: int = 2,
    attention: bool = True,
    work_dir: Optional[Path] = None,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, Any]:
    """Measure packing against power-of-two padding.

    Args:
        checkpoint_dir: A SmolLM2 checkpoint: its tokenizer (and Alpaca template) prepares the rows; the weights are
            random.
        backend: "cpu" (finetune/lora.py, eager) or "xla" (xla/finetune/lora.py; set PJRT_DEVICE, CPU_NUM_DEVICES).
        data_dir: Prepared data to measure instead of the synthetic Alpaca-shaped rows.
        samples: Synthetic rows to prepare.
        max_seq_length: The packed rows' length, and the padded batches' cap.
        micro_batch_size: Samples (padded) or rows (packed) per device per step; one micro-batch per step.
        n_layer: Layers of the random model.
        n_embd: Its width.
        steps: Optimizer steps per training run (the first two and any that compiled are not timed).
        repeats: Rounds of the two runs, interleaved.
        attention: Also time the attention kernels (part 3).
        work_dir: Where the model, the data and the runs go (default: a temporary directory).
        results_file: Also write the results to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    devices = backend_devices(backend, "bench/packing.py")
    rows = micro_batch_size * devices
    work, tmp = work_folder(work_dir)
    model_dir = make_model(work / "model", Path(checkpoint_dir), n_layer, n_embd)
    if data_dir is None:
        (work / "rows.json").write_text(json.dumps(alpaca_shaped_rows(samples)))
        data_dir = work / "data"
        prep = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "prepare_alpaca.py"), "--checkpoint_dir", str(model_dir),
             "--data_file", str(work / "rows.json"), "--destination_path", str(data_dir), "--prompt_style", "alpaca",
             "--val_split_fraction", "0.01"],
            cwd=ROOT, capture_output=True, text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("PJRT")})
        if prep.returncode != 0:
            raise LitError(f"scripts/prepare_alpaca.py failed: {prep.stderr[-2000:]}")
    frac = fractions(Path(data_dir), max_seq_length, micro_batch_size)
    print(f"useful tokens / computed positions: pow2 padding {frac['useful_fraction']['padded']:.3f}, packed"
          f" {frac['useful_fraction']['packed']:.3f} ({frac['samples']} samples, median {frac['length_median']}"
          f" tokens, {frac['rows']} rows of {max_seq_length})", file=sys.stderr)

    runs: Dict[str, List[Dict[str, Any]]] = {v: [] for v in LAYOUTS}
    commands: Dict[str, str] = {}
    for r in range(repeats):
        for layout in LAYOUTS:
            argv = command(layout, backend, model_dir, Path(data_dir), work / f"{layout}_{r}", steps,
                           micro_batch_size, rows, max_seq_length)
            commands[layout] = "python " + " ".join(argv)
            result = run_one(argv, work, f"{layout}_{r}")
            steady = [(t, n) for t, c, n in result["step_times"][2:] if c == 0]
            result["steady_s"] = sum(t for t, _ in steady)
            runs[layout].append(result)
            print(f"round {r + 1} {layout:>6}: {result['tokens_per_sec']:.0f} useful tokens/s"
                  f" ({result['padded_tokens_per_sec']:.0f} computed), {result['steady_steps_timed']} steady steps,"
                  f" {result.get('train_compiles')} train-step compilations, wall {result['wall_s']:.1f} s",
                  file=sys.stderr)
    speed: Dict[str, Any] = {}
    for layout in LAYOUTS:
        speed[layout] = {
            "useful_tokens_per_s": statistics.median(x["tokens_per_sec"] for x in runs[layout]),
            "computed_tokens_per_s": statistics.median(x["padded_tokens_per_sec"] for x in runs[layout]),
            "useful_tokens_per_s_runs": [x["tokens_per_sec"] for x in runs[layout]],
            "steady_steps_timed": [x["steady_steps_timed"] for x in runs[layout]],
            "train_compiles": [x.get("train_compiles") for x in runs[layout]],
            "wall_s": [x["wall_s"] for x in runs[layout]],
        }
    per_round = [p["tokens_per_sec"] / q["tokens_per_sec"] for p, q in zip(runs["packed"], runs["padded"])]
    speed["packed_over_padded"] = statistics.median(per_round)
    speed["packed_over_padded_runs"] = per_round
    print(f"useful tokens/s packed / padded: {speed['packed_over_padded']:.2f}x (rounds: "
          + ", ".join(f"{x:.2f}" for x in per_round) + ")")
    kernels = attention_kernels(max_seq_length) if attention else None
    if kernels:
        print(f"attention fwd+bwd at {max_seq_length}: SDPA block-diagonal mask {kernels['sdpa_mask_s'] * 1e3:.1f} ms,"
              f" SDPA causal {kernels['sdpa_causal_s'] * 1e3:.1f} ms; FlexAttention trains here:"
              f" {kernels['flex_trains']}" + (f" ({kernels.get('flex_error')})" if not kernels["flex_trains"] else ""))
    settings = {"backend": backend, "devices": devices, "model": f"random SmolLM2-135M-Instruct layout, {n_layer}"
                f" layers, width {n_embd}", "method": "lora", "lora_r": 8, "precision": "32-true",
                "max_seq_length": max_seq_length, "micro_batch_size": micro_batch_size, "rows_per_step": rows,
                "steps": steps, "repeats": repeats, "threads": os.environ.get("OMP_NUM_THREADS"),
                "data": str(data_dir) if data_dir != work / "data" else
                f"{samples} synthetic Alpaca-shaped rows (bench/packing.py alpaca_shaped_rows), Alpaca template,"
                " SmolLM2 tokenizer", "commands": commands}
    results = {"fractions": frac, "speed": speed, "attention": kernels}
    result_files.write(results_file, "packing", settings, results, note)
    if tmp:
        tmp.cleanup()
    return results


if __name__ == "__main__":
    run_cli(main)
