"""Benchmark: generation on XLA devices against eager generation on the CPU, same weights, one process.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python bench/xla_generate.py \\
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python bench/xla_generate.py   # on a TPU VM

For two prompt lengths (two buckets) and 8 / 64 / 256 new tokens, greedy and without stop tokens (every run
generates exactly that many): the XLA compilations of the call, the time to the first token (compilation
included), the steady decode speed, the eager CPU speed on the same weights and prompt (`lit_gpt.generate`,
what generate/base.py runs), their ratio, and whether the tokens are equal.
"""

import sys
import time
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli

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
) -> None:
    """Time XLA generation against eager CPU generation.

    Args:
        checkpoint_dir: A converted checkpoint directory.
        max_new_tokens: The generation lengths to measure, per prompt.
        devices: "auto" or the number of XLA devices (the mesh spans all of them).
        precision: "32-true" or "bf16-true" (default: bf16-true on TPUs, else 32-true).
        eager_reference: Also run eager generation on the CPU (the reference for the ratio and the tokens).
    """
    from lit_gpt.generate import check_model_dir
    from lit_gpt.xla import make_fabric
    from lit_gpt.xla.generate import default_precision

    check_model_dir(checkpoint_dir)
    fabric = make_fabric(devices, default_precision(precision))
    fabric.launch(main, checkpoint_dir, max_new_tokens, eager_reference)


def main(fabric, checkpoint_dir: Path, max_new_tokens: Tuple[int, ...], eager_reference: bool) -> None:
    from lit_gpt.generate import generate as eager_generate
    from lit_gpt.generate import load_config, load_model
    from lit_gpt.tokenizer import Tokenizer
    from lit_gpt.xla import load_staged
    from lit_gpt.xla.generate import generate

    tokenizer = Tokenizer(checkpoint_dir)
    t0 = time.perf_counter()
    model = fabric.setup_module(load_staged(load_config(checkpoint_dir), checkpoint_dir / "lit_model.pth", fabric))
    load_time = time.perf_counter() - t0
    cpu_model = load_model(checkpoint_dir) if eager_reference else None
    n_devices = fabric.strategy.num_devices
    print(f"{checkpoint_dir.name} on {n_devices} XLA device(s) ({fabric.device}), loaded in {load_time:.1f} s; eager"
          f" reference: {'CPU, ' + str(torch.get_num_threads()) + ' threads' if eager_reference else 'off'}")
    header = (f"{'prompt':>6} {'bucket':>6} {'new':>4} {'compiles':>8} {'TTFT s':>7} {'XLA tok/s':>9}"
              f" {'eager tok/s':>11} {'XLA/eager':>9} {'equal':>5}")
    print(header)
    print("-" * len(header))
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        for n in max_new_tokens:
            r = generate(model, ids, n)
            eager_speed, equal = None, None
            if cpu_model is not None:
                t0 = time.perf_counter()
                ref = eager_generate(cpu_model, ids, n, temperature=0.0)
                eager_speed = n / (time.perf_counter() - t0)
                equal = ref.tolist() == r.tokens.tolist()
            xla_speed = r.decode_tokens_per_sec
            ratio = xla_speed / eager_speed if xla_speed and eager_speed else None
            fmt = lambda v, width: f"{v:>{width}.2f}" if v is not None else f"{'n/a':>{width}}"  # noqa: E731
            print(f"{r.prompt_length:>6} {r.bucket:>6} {n:>4} {r.compiles:>8} {r.time_to_first_token:>7.2f}"
                  f" {fmt(xla_speed, 9)} {fmt(eager_speed, 11)} {fmt(ratio, 9)}"
                  f" {str(equal) if equal is not None else 'n/a':>5}", flush=True)
    print("compiles: XLA compilations of that call (prefill + decode: 2 for a new bucket or cache size, 0 otherwise);"
          " TTFT: time to the first token, compilation included; XLA tok/s: steady decode after the first decode"
          " step; eager: the whole generation on the CPU", file=sys.stderr)


if __name__ == "__main__":
    run_cli(setup)
