"""Benchmark: one packed LoRA train step at long row lengths, the old attention path (the dense (B, 1, T, T) document
mask into SDPA) against the new one (one document at a time, lit_gpt.packing.document_attention), in one run.

    python bench/long_context.py --results_file bench/results/long_context_cpu.json

For each row length T (default 2k, 4k, 8k, 16k, 32k) and each path, a fresh process builds the model, packs one row
of T positions with documents of 200 to 2,000 tokens (the same documents at every T, cut to fit), and runs two
train steps (forward, backward, AdamW on the LoRA weights). Peak memory: the process's peak resident memory during
the first step above its resident memory before it (`/proc/self/clear_refs` resets the peak; the allocator returns
large blocks, so this is the step's activations, gradients and temporaries). Time: the second step (the first pays
the allocator's first touches). The old path's mask grows as T^2: a length whose projected peak (T^2 from the
largest length measured) passes `--max_gib`, or its projected step time `--max_step_s`, is skipped and says so.

The model: random weights in SmolLM2-135M's layout (width 576, 9 heads, 3 KV groups, head 64, MLP 1536) with
`--layers` layers and a `--vocab`-token vocabulary (the 49,152-token head at 32k positions alone would take 6 GB of
logits); LoRA r 8 on every projection, fp32, one row per step.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import result_files  # bench/result_files.py (this script's folder is on sys.path)
from lit_gpt.utils import run_cli

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("mask", "documents")


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def document_lengths(T: int, seed: int = 0) -> List[int]:
    """Token counts of the documents of a row of T positions: 200 to 2,000 tokens each (one more than the positions
    a document takes), the same sequence at every T, the last cut to fill the row."""
    import random

    rng, out, used = random.Random(seed), [], 0
    while used < T:
        n = min(rng.randint(200, 2000), T - used)
        out.append(n + 1)
        used += n
    return out


def one_length(T: int, path: str, layers: int, vocab: int) -> Dict[str, Any]:
    """Child process: build, pack, two steps; peak memory of the first, time of both."""
    import torch

    import lit_gpt.lora as lora
    from lit_gpt.batches import IGNORE_INDEX
    from lit_gpt.losses import loss_sum
    from lit_gpt.packing import collate_packed

    torch.manual_seed(0)
    config = lora.Config.from_name("SmolLM2-135M-Instruct", n_layer=layers, vocab_size=vocab,
                                   block_size=T, lora_r=8, lora_alpha=16, lora_query=True, lora_key=True,
                                   lora_value=True, lora_projection=True, lora_mlp=True)
    model = lora.GPT(config)
    model.apply(model._init_weights)
    lora.mark_only_lora_as_trainable(model)
    model.packed_attention = path
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in document_lengths(T):
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 4] = IGNORE_INDEX  # a prompt
        samples.append({"input_ids": ids, "labels": labels})
    batch = collate_packed([samples], T)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        loss = loss_sum(model, batch["input_ids"], batch["labels"], positions=batch["positions"],
                        segments=batch["segments"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory (VmHWM) restarts from here
    before = _status_kib("VmRSS")
    first = step()
    peak = _status_kib("VmHWM") - before
    second = step()
    return {"T": T, "path": path, "documents": len(samples), "peak_mib": peak / 1024, "first_step_s": first,
            "step_s": second, "base_rss_mib": before / 1024}


def main(lengths: str = "2048,4096,8192,16384,32768", layers: int = 2, vocab: int = 2048, max_gib: float = 6.0,
         max_step_s: float = 120.0, results_file: Optional[Path] = None, note: Optional[str] = None,
         child: Optional[str] = None) -> None:
    """Measure both attention paths at every length; `child` is the internal "T,path" of one measurement."""
    if child is not None:
        T, path = child.split(",")
        print(json.dumps(one_length(int(T), path, layers, vocab)))
        return
    Ts = [int(x) for x in str(lengths).split(",")]
    rows: List[Dict[str, Any]] = []
    for path in PATHS:
        done: List[Dict[str, Any]] = []
        for T in Ts:
            if path == "mask" and done:  # project the old path from its largest measured length (T^2 terms)
                last = done[-1]
                scale = (T / last["T"]) ** 2
                projected = {"peak_gib": last["peak_mib"] * scale / 1024, "step_s": last["step_s"] * scale}
                if projected["peak_gib"] > max_gib or projected["step_s"] > max_step_s:
                    rows.append({"T": T, "path": path, "skipped": f"projected {projected['peak_gib']:.1f} GiB,"
                                 f" {projected['step_s']:.0f} s per step (limits {max_gib} GiB, {max_step_s} s)"})
                    print(f"T={T} {path}: skipped ({rows[-1]['skipped']})", file=sys.stderr)
                    continue
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{T},{path}", "--layers", str(layers),
                   "--vocab", str(vocab)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(f"T={T} {path} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            done.append(r)
            rows.append(r)
            print(f"T={T} {path}: peak +{r['peak_mib']:.0f} MiB, step {r['step_s']:.2f} s"
                  f" (first {r['first_step_s']:.2f} s), {r['documents']} documents", file=sys.stderr)
    by = {(r["path"], r["T"]): r for r in rows if "skipped" not in r}
    ratios: Dict[str, Any] = {}
    for path in PATHS:
        peaks = [(T, by[(path, T)]["peak_mib"]) for T in Ts if (path, T) in by]
        ratios[path] = {f"{b[0]}/{a[0]}": b[1] / a[1] for a, b in zip(peaks, peaks[1:])}
    first_T = Ts[0]
    speed = (by[("mask", first_T)]["step_s"] / by[("documents", first_T)]["step_s"]
             if ("mask", first_T) in by and ("documents", first_T) in by else None)
    results = {"steps": rows, "peak_ratios": ratios, f"old_over_new_time_at_{first_T}": speed}
    settings = {"model": f"random SmolLM2-135M-Instruct layout, {layers} layers, vocab {vocab}",
                "method": "LoRA r 8 (alpha 16) on q, k, v, projection and MLP; AdamW", "precision": "32-true",
                "rows_per_step": 1, "documents": "200-2000 tokens each (bench/long_context.py document_lengths)",
                "lengths": Ts, "threads": os.environ.get("OMP_NUM_THREADS"), "max_gib": max_gib,
                "max_step_s": max_step_s}
    print(json.dumps(results, indent=1))
    result_files.write(results_file, "long_context", settings, results, note)


if __name__ == "__main__":
    run_cli(main)
