"""Benchmark: (a) one packed LoRA train step at long row lengths, the old attention path (the dense (B, 1, T, T)
document mask into SDPA) against the new one (one document at a time, lit_gpt.packing.document_attention), and the
new path of XLA:CPU (1 device: lit_gpt.xla.flash's blockwise segment attention, what the XLA strategy installs off a
TPU); (b) prefill of a T-token prompt + 64 greedy decode steps, the old KV cache (every position in every layer)
against the new (a sliding layer's cache holds its window, and the prompt attends without a dense (T, S) mask:
lit_gpt.kv_cache); all in one run, or (b) alone (`--train false --xla false`) and the XLA:CPU column alone (`--train
false --decode false`), each in its own result file (bench/tables.py takes their rows from there when they exist).

    python bench/long_context.py --results_file bench/results/long_context_cpu.json
    python bench/long_context.py --train false --xla false --results_file bench/results/long_context_decode_cpu.json
    python bench/long_context.py --train false --decode false --lengths 2048,4096 --max_step_s 600 \
        --results_file bench/results/long_context_xla_cpu.json

For each row length T (default 2k, 4k, 8k, 16k, 32k) and each path, a fresh process builds the model, packs one row
of T positions with documents of 200 to 2,000 tokens (the same documents at every T, cut to fit), and runs two
train steps (forward, backward, AdamW on the LoRA weights). Peak memory: the process's peak resident memory during
the first step above its resident memory before it (`/proc/self/clear_refs` resets the peak; the allocator returns
large blocks, so this is the step's activations, gradients and temporaries). Time: the second step (the first pays
the allocator's first touches). The old path's mask grows as T^2: a length whose projected peak (T^2 from the
largest length measured) passes `--max_gib`, or its projected step time `--max_step_s` (prefill: `--max_prefill_s`),
is skipped and says so (the old path, XLA:CPU's and generation's: the documents path grows linearly).

XLA:CPU (`--xla true`): the same step on one XLA:CPU device (`PJRT_DEVICE=CPU`, `--xla_backend_optimization_level=0`:
XLA:CPU checks memory and compile behaviour here, not speed), three steps each ending in `torch_xla.sync()` (the
first two compile: the second's inputs are the first's outputs); the peak is over all three, compilation included,
the time the third's. Its blockwise path keeps each query block's (block, keys) probabilities for
the backward (T^2 / 2 in all): it is projected and skipped like the old path.

Generation (b): the same layout with its first layer sliding (window `--window`, a Gemma-3-like local layer) and the
second global; a prompt of T random tokens in one forward (`prefill`), then 64 one-token steps (greedy); peak memory
above the process's before the prefill (KV cache included), the prefill's time and the decode steps' mean. The old
cache holds every position of the sliding layer too (its mask cuts the window, as before issue 36), and its prompt
attends with the dense (T, S) mask (`model.cache_prefill = "mask"`); the new prompt attends without it
(`lit_gpt.kv_cache.Prefill`: causal SDPA on the global layer, chunks over the window on the sliding one).

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
XLA_PATH = "xla"  # the new path on XLA:CPU (blockwise segment attention)
DECODE_PATHS = ("decode_old", "decode_new")
DECODE_STEPS = 64


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


def one_length(T: int, path: str, layers: int, vocab: int, window: int = 1024) -> Dict[str, Any]:
    """Child process: build, pack, two steps; peak memory of the first, time of both (or generation: `one_decode`)."""
    if path in DECODE_PATHS:
        return one_decode(T, path, layers, vocab, window)
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
    sync = lambda: None  # noqa: E731
    if path == XLA_PATH:
        import torch_xla
        import torch_xla.core.xla_model as xm

        from lit_gpt.xla.flash import tpu_segment_attention

        device = torch_xla.device()
        model = model.to(device)
        model.segment_attention = tpu_segment_attention()  # what the XLA strategy installs (off a TPU: blockwise)

        def sync() -> None:
            torch_xla.sync()
            xm.wait_device_ops()
    else:
        device = torch.device("cpu")
        model.packed_attention = path
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in document_lengths(T):
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 4] = IGNORE_INDEX  # a prompt
        samples.append({"input_ids": ids, "labels": labels})
    batch = {k: v.to(device) for k, v in collate_packed([samples], T).items() if isinstance(v, torch.Tensor)}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        # a tracing backend keeps every position's logits (the labelled ones' count would be in the graph's shapes)
        loss = loss_sum(model, batch["input_ids"], batch["labels"], targets_only=path != XLA_PATH,
                        positions=batch["positions"], segments=batch["segments"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory (VmHWM) restarts from here
    before = _status_kib("VmRSS")
    first = step()
    peak = _status_kib("VmHWM") - before
    second = step()
    if path == XLA_PATH:  # the second step compiles again (the weights are the first's outputs now): time a third
        second = step()
        peak = _status_kib("VmHWM") - before
    return {"T": T, "path": path, "documents": len(samples), "peak_mib": peak / 1024, "first_step_s": first,
            "step_s": second, "base_rss_mib": before / 1024}


def one_decode(T: int, path: str, layers: int, vocab: int, window: int) -> Dict[str, Any]:
    """Child process: a prompt of T tokens in one forward, then 64 greedy one-token steps, with the old KV cache
    (every position in every layer) or the new (the sliding layer's cache holds its window)."""
    import torch

    from lit_gpt import GPT, Config
    from lit_gpt.kv_cache import KVCache

    torch.manual_seed(0)
    config = Config.from_name("SmolLM2-135M-Instruct", n_layer=layers, vocab_size=vocab, block_size=T + DECODE_STEPS,
                              sliding_window_size=window,
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2) +
                              ["full_attention"] * (layers % 2))
    model = GPT(config).eval()
    model.apply(model._init_weights)
    prompt = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(1))
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    if path == "decode_old":  # the cache before issue 36: every position, the window cut by the mask alone
        model.cache_prefill = "mask"  # and the prompt's dense (T, S) mask over it
        for block in model.transformer.h:
            block.attn.kv_cache = KVCache(1, config.n_query_groups, T + DECODE_STEPS, config.head_size)
            block.attn.kv_cache.sliding_window = block.attn.sliding_window
    else:
        model.set_kv_cache(1, T + DECODE_STEPS)
    kv_bytes = sum(b.attn.kv_cache.k.nbytes + b.attn.kv_cache.v.nbytes for b in model.transformer.h)
    tokens = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(prompt, torch.arange(T), last_only=torch.tensor([T - 1]))
        token = logits[0, -1].argmax()
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(DECODE_STEPS):
            tokens.append(int(token))
            logits = model(token.view(1, 1), torch.tensor([T + i]))
            token = logits[0, -1].argmax()
        decode_s = (time.perf_counter() - t0) / DECODE_STEPS
    peak = _status_kib("VmHWM") - before
    return {"T": T, "path": path, "peak_mib": peak / 1024, "prefill_s": prefill_s, "decode_token_s": decode_s,
            "kv_cache_mib": kv_bytes / 2**20, "window": window, "tokens": tokens, "base_rss_mib": before / 1024}


def main(lengths: str = "2048,4096,8192,16384,32768", layers: int = 2, vocab: int = 2048, max_gib: float = 6.0,
         max_step_s: float = 120.0, max_prefill_s: float = 600.0, xla: bool = True, decode: bool = True,
         window: int = 1024, train: bool = True,
         results_file: Optional[Path] = None, note: Optional[str] = None, child: Optional[str] = None) -> None:
    """Measure both attention paths at every length (and XLA:CPU's new path, and generation with the old and new
    KV caches); `train` false leaves out the CPU train step's two paths; `child` is the internal "T,path" of one
    measurement."""
    if child is not None:
        T, path = child.split(",")
        print(json.dumps(one_length(int(T), path, layers, vocab, window)))
        return
    Ts = [int(x) for x in str(lengths).split(",")]
    paths = (PATHS if train else ()) + ((XLA_PATH,) if xla else ()) + (DECODE_PATHS if decode else ())
    rows: List[Dict[str, Any]] = []
    for path in paths:
        done: List[Dict[str, Any]] = []
        for T in Ts:
            if path != "documents" and done:  # project from the largest measured length (T^2 terms)
                last = done[-1]
                scale = (T / last["T"]) ** 2
                seconds = last["prefill_s"] if path in DECODE_PATHS else last["step_s"]
                projected = {"peak_gib": last["peak_mib"] * scale / 1024, "step_s": seconds * scale}
                limit_s = max_prefill_s if path in DECODE_PATHS else max_step_s
                if projected["peak_gib"] > max_gib or projected["step_s"] > limit_s:
                    rows.append({"T": T, "path": path, "skipped": f"projected {projected['peak_gib']:.1f} GiB,"
                                 f" {projected['step_s']:.0f} s per {'prefill' if path in DECODE_PATHS else 'step'}"
                                 f" (limits {max_gib} GiB, {limit_s} s)"})
                    print(f"T={T} {path}: skipped ({rows[-1]['skipped']})", file=sys.stderr)
                    continue
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{T},{path}", "--layers", str(layers),
                   "--vocab", str(vocab), "--window", str(window)]
            env = dict(os.environ)
            if path == XLA_PATH:
                env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="2",
                           XLA_FLAGS="--xla_backend_optimization_level=0")
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"T={T} {path} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            done.append(r)
            rows.append(r)
            if path in DECODE_PATHS:
                print(f"T={T} {path}: peak +{r['peak_mib']:.0f} MiB, prefill {r['prefill_s']:.2f} s, decode"
                      f" {r['decode_token_s'] * 1000:.1f} ms/token, KV cache {r['kv_cache_mib']:.0f} MiB",
                      file=sys.stderr)
            else:
                print(f"T={T} {path}: peak +{r['peak_mib']:.0f} MiB, step {r['step_s']:.2f} s"
                      f" (first {r['first_step_s']:.2f} s), {r['documents']} documents", file=sys.stderr)
    by = {(r["path"], r["T"]): r for r in rows if "skipped" not in r}
    ratios: Dict[str, Any] = {}
    for path in paths:
        peaks = [(T, by[(path, T)]["peak_mib"]) for T in Ts if (path, T) in by]
        ratios[path] = {f"{b[0]}/{a[0]}": b[1] / a[1] for a, b in zip(peaks, peaks[1:])}
    first_T = Ts[0]
    speed = (by[("mask", first_T)]["step_s"] / by[("documents", first_T)]["step_s"]
             if ("mask", first_T) in by and ("documents", first_T) in by else None)
    results: Dict[str, Any] = {"steps": [r for r in rows if r["path"] not in DECODE_PATHS], "peak_ratios": ratios,
                               f"old_over_new_time_at_{first_T}": speed}
    if decode:
        results["decode"] = [r for r in rows if r["path"] in DECODE_PATHS]
        # the same greedy tokens with either cache (random weights: a check that both caches attend alike)
        results["decode_same_tokens"] = all(by[("decode_old", T)]["tokens"] == by[("decode_new", T)]["tokens"]
                                            for T in Ts if ("decode_old", T) in by and ("decode_new", T) in by)
    settings = {"model": f"random SmolLM2-135M-Instruct layout, {layers} layers, vocab {vocab}",
                "method": "LoRA r 8 (alpha 16) on q, k, v, projection and MLP; AdamW", "precision": "32-true",
                "rows_per_step": 1, "documents": "200-2000 tokens each (bench/long_context.py document_lengths)",
                "lengths": Ts, "threads": os.environ.get("OMP_NUM_THREADS"), "max_gib": max_gib, "train": train,
                "max_step_s": max_step_s, "max_prefill_s": max_prefill_s,
                "xla": "XLA:CPU, 1 device, --xla_backend_optimization_level=0" if xla else None,
                "decode": (f"layer 0 sliding (window {window}), layer 1 global; prompt of T tokens, then"
                           f" {DECODE_STEPS} greedy steps; no LoRA; old: every position cached, the prompt's dense"
                           " (T, S) mask; new: the sliding layer's ring, the prompt without the mask"
                           if decode else None)}
    print(json.dumps(results, indent=1))
    result_files.write(results_file, "long_context", settings, results, note)


if __name__ == "__main__":
    run_cli(main)
