"""Host memory of loading a checkpoint onto XLA devices: staged (lit_gpt.xla.load_staged) vs a naive full load.

    python bench/load.py                                  # ~1.5 GB fp32 checkpoint, 8 virtual CPU devices
    python bench/load.py --n_layer 12 --devices 4 --precision bf16-true

Each measurement runs in a fresh process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=devices, SPMD mesh over all of them)
and samples anonymous memory (RssAnon). Reported: overhead = peak - final, where final is the resident size
after loading (on XLA:CPU the device buffers are host memory, so final ~ baseline + model). Mapped checkpoint
pages are not counted: they count in ru_maxrss but the kernel can drop them.

  staged: meta-device model, per block torch.load(mmap=True) -> cast -> sharded transfer -> drop host copy
  naive:  torch.load (no mmap) of the whole file, a CPU-initialised GPT, load_state_dict, .to(xla), FSDPv2 setup
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from lit_gpt import GPT, Config
from lit_gpt.utils import run_cli


def bench_config(n_layer: int, n_embd: int, intermediate_size: int, vocab_size: int) -> Config:
    return Config(
        name="bench-llama",
        block_size=2048,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_embd // 128,
        n_embd=n_embd,
        intermediate_size=intermediate_size,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )


def make_checkpoint(path: Path, config: Config, dtype: torch.dtype = torch.float32) -> None:
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(config)
    # random tensors one at a time, written in one torch.save: the bench machine needs ~1x the file, not 2x
    sd = {name: (torch.randn(t.shape) * 0.02).to(dtype) for name, t in meta.state_dict().items()}
    torch.save(sd, path)
    config.save(path.parent)


def _sizes(config: Config, bytes_per: int):
    with torch.device("meta"):
        meta = GPT(config)
    block = sum(p.numel() for p in meta.transformer.h[0].parameters()) * bytes_per
    tensor = max(p.numel() for p in meta.parameters()) * bytes_per
    model = sum(p.numel() for p in meta.parameters()) * bytes_per
    return model, block, tensor


def measure(mode: str, checkpoint: Path, precision: str) -> dict:
    """Runs inside the measuring process."""
    import lit_gpt.xla as lx
    from lit_gpt.xla.diagnostics import AnonMemorySampler, rss_anon_bytes

    config = Config.from_file(checkpoint.parent / "lit_config.json")
    fabric = lx.make_fabric(precision=precision)
    fabric.launch()
    import torch_xla

    torch_xla.sync()
    t0 = time.perf_counter()
    with AnonMemorySampler() as mem:
        if mode == "staged":
            model = lx.load_staged(config, checkpoint, fabric, progress=False)
            model = fabric.setup(model)
        else:
            sd = torch.load(checkpoint, map_location="cpu", weights_only=True)
            model = GPT(config)
            model.load_state_dict(sd)
            del sd
            model = fabric.setup(model)  # precision cast, .to(xla), FSDPv2 sharding
        torch_xla.sync(wait=True)
    seconds = time.perf_counter() - t0
    final = rss_anon_bytes()
    spec = torch_xla._XLAC._get_xla_sharding_spec(next(model.parameters()))
    return {"mode": mode, "start": mem.start, "peak": mem.peak, "final": final, "seconds": seconds, "sharding": spec}


def main(
    out_dir: Path = Path("bench_out/load"),
    n_layer: int = 6,
    n_embd: int = 2048,
    intermediate_size: int = 5632,
    vocab_size: int = 16000,
    devices: int = 8,
    precision: str = "32-true",
    modes: str = "staged,naive",
    checkpoint_dtype: str = "float32",
    measure_only: Optional[str] = None,
) -> None:
    """Make (once) a random fp32 checkpoint and report each mode's host-memory overhead.

    Args:
        out_dir: where the checkpoint is written (reused between runs).
        n_layer, n_embd, intermediate_size, vocab_size: the Llama-style model (defaults: ~1.5 GB fp32).
        devices: virtual XLA:CPU devices (CPU_NUM_DEVICES).
        precision: 32-true or bf16-true (bf16 casts while loading).
        modes: comma-separated: staged, naive.
        checkpoint_dtype: dtype of the checkpoint file (float32 or bfloat16); loading bf16-true from a float32
            file casts each tensor on the host.
        measure_only: internal: run one measurement in this process and print it as JSON.
    """
    name = "lit_model.pth" if checkpoint_dtype == "float32" else f"{checkpoint_dtype}/lit_model.pth"
    checkpoint = Path(out_dir) / name
    if measure_only:
        print(json.dumps(measure(measure_only, checkpoint, precision)))
        return
    config = bench_config(n_layer, n_embd, intermediate_size, vocab_size)
    make_checkpoint(checkpoint, config, getattr(torch, checkpoint_dtype))
    bytes_per = 2 if precision == "bf16-true" else 4
    model, block, tensor = _sizes(config, bytes_per)
    gb = 1024**3
    print(
        f"checkpoint {checkpoint} ({checkpoint.stat().st_size / gb:.2f} GiB {checkpoint_dtype}); loaded as {precision}:"
        " model"
        f" {model / gb:.2f} GiB, largest block {block / gb:.3f} GiB, largest tensor {tensor / gb:.3f} GiB;"
        f" {devices} devices"
    )
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    for mode in filter(None, modes.split(",")):
        cmd = [sys.executable, __file__, "--out_dir", str(out_dir), "--precision", precision, "--measure_only", mode,
               "--checkpoint_dtype", checkpoint_dtype]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{mode} measurement failed")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        over = r["peak"] - r["final"]
        above_model = r["peak"] - r["start"] - model
        print(
            f"{mode:>6}: peak - final RssAnon {over / gb:.3f} GiB = {over / block:.2f} x largest block ="
            f" {over / model:.2f} x model; peak - (start + model bytes) {above_model / gb:.3f} GiB ="
            f" {above_model / block:.2f} x largest block; resident added {(r['final'] - r['start']) / gb:.2f} GiB;"
            f" {r['seconds']:.1f} s; sharding {r['sharding']}"
        )


if __name__ == "__main__":
    run_cli(main)
