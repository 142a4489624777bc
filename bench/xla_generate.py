"""Benchmark: generation on XLA devices against eager generation on the CPU, same weights, one process.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python bench/xla_generate.py \\
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python bench/xla_generate.py   # on a TPU VM

For two prompt lengths (two buckets) and 8 / 64 / 256 new tokens, greedy and without stop tokens (every run
generates exactly that many): the XLA compilations of the call, the time to the first token (compilation
included), the steady decode speed (after the first decode step), the steady eager CPU decode speed on the same
weights and prompt (`lit_gpt.generate`, what generate/base.py runs; prefill and first token excluded, after a
warm-up call), their ratio, and whether the tokens are equal.
"""

import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch

from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

PROMPTS = (
    "The capital of France is",
    "Llamas are domesticated South American camelids, widely used as meat and pack animals by Andean cultures"
    " since the pre-Columbian era. They are social animals and live with others as a herd. Their wool is",
)


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    max_new_tokens: Tuple[int, ...] = (8, 64, 256),
    devices: Union[int, str] = "auto",
    precision: Optional[str] = None,
    eager_reference: bool = True,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> None:
    """Time XLA generation against eager CPU generation.

    Args:
        checkpoint_dir: A converted checkpoint directory.
        max_new_tokens: The generation lengths to measure, per prompt.
        devices: "auto" or the number of XLA devices (the mesh spans all of them).
        precision: "32-true" or "bf16-true" (default: bf16-true on TPUs, else 32-true).
        eager_reference: Also run eager generation on the CPU (the reference for the ratio and the tokens).
        results_file: Also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    from lit_gpt.loading import check_model_dir
    from lit_gpt.recipes.xla_generate import default_precision
    from lit_gpt.xla import make_fabric

    check_model_dir(checkpoint_dir)
    fabric = make_fabric(devices, default_precision(precision))
    rows = fabric.launch(main, checkpoint_dir, max_new_tokens, eager_reference)
    settings = {"checkpoint": Path(checkpoint_dir).name, "max_new_tokens": list(max_new_tokens),
                "devices": fabric.strategy.num_devices, "device": str(fabric.device),
                "precision": default_precision(precision), "decoding": "greedy, no stop tokens",
                "eager_threads": torch.get_num_threads() if eager_reference else None}
    result_files.write(results_file, "xla_generate", settings, rows, note)


def main(fabric, checkpoint_dir: Path, max_new_tokens: Tuple[int, ...], eager_reference: bool) -> List[dict]:
    from lit_gpt.config import load_config
    from lit_gpt.generate import generate as eager_generate
    from lit_gpt.generate import timed_generate
    from lit_gpt.loading import load_model
    from lit_gpt.recipes.xla_generate import load_base_staged
    from lit_gpt.tokenizer import Tokenizer
    from lit_gpt.xla.runtime import XLARuntime

    tokenizer = Tokenizer(checkpoint_dir)
    t0 = time.perf_counter()
    model_config = load_config(checkpoint_dir)
    model = fabric.setup_module(load_base_staged(fabric, checkpoint_dir))  # as xla/generate/base.py loads it
    runtime = XLARuntime(fabric)  # the one generation loop with XLA's placement and graph cuts
    load_time = time.perf_counter() - t0
    cpu_model = load_model(checkpoint_dir) if eager_reference else None
    n_devices = fabric.strategy.num_devices
    print(f"{checkpoint_dir.name} on {n_devices} XLA device(s) ({fabric.device}), loaded in {load_time:.1f} s; eager"
          f" reference: {'CPU, ' + str(torch.get_num_threads()) + ' threads' if eager_reference else 'off'}")
    header = (f"{'prompt':>6} {'bucket':>6} {'new':>4} {'compiles':>8} {'TTFT s':>7} {'XLA tok/s':>9}"
              f" {'eager tok/s':>11} {'XLA/eager':>9} {'equal':>5}")
    print(header)
    print("-" * len(header))
    rows = []
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        for n in max_new_tokens:
            r = timed_generate(model, ids, n, runtime, temperature=0.0)
            bucket = runtime.prompt_bucket(r.prompt_length, model_config.block_size)
            eager_speed, equal = None, None
            if cpu_model is not None:
                # steady eager decode, comparable with the XLA column: (n - 1) tokens over the time a call of n
                # tokens takes beyond a call of 1 token (prefill and first token), after a warm-up call
                eager_generate(cpu_model, ids, 2, temperature=0.0)
                t0 = time.perf_counter()
                ref = eager_generate(cpu_model, ids, n, temperature=0.0)
                t_n = time.perf_counter() - t0
                t0 = time.perf_counter()
                eager_generate(cpu_model, ids, 1, temperature=0.0)
                t_1 = time.perf_counter() - t0
                eager_speed = (n - 1) / (t_n - t_1) if t_n > t_1 else None
                equal = ref.tolist() == r.tokens.tolist()
            xla_speed = r.decode_tokens_per_sec
            ratio = xla_speed / eager_speed if xla_speed and eager_speed else None
            fmt = lambda v, width: f"{v:>{width}.2f}" if v is not None else f"{'n/a':>{width}}"  # noqa: E731
            print(f"{r.prompt_length:>6} {bucket:>6} {n:>4} {r.compiles:>8} {r.time_to_first_token:>7.2f}"
                  f" {fmt(xla_speed, 9)} {fmt(eager_speed, 11)} {fmt(ratio, 9)}"
                  f" {str(equal) if equal is not None else 'n/a':>5}", flush=True)
            rows.append({"prompt_tokens": r.prompt_length, "bucket": bucket, "new_tokens": n, "compiles": r.compiles,
                         "time_to_first_token_s": r.time_to_first_token, "xla_tokens_per_s": xla_speed,
                         "eager_tokens_per_s": eager_speed, "xla_over_eager": ratio, "tokens_equal": equal})
    print("compiles: XLA compilations of that call (prefill + decode: 2 for a new bucket or cache size, 0 otherwise);"
          " TTFT: time to the first token, compilation included; XLA tok/s: steady decode after the first decode"
          " step; eager tok/s: steady decode on the CPU (a call of N tokens minus a call of 1 token, after a warm-up)",
          file=sys.stderr)
    return rows


if __name__ == "__main__":
    run_cli(setup)
