"""Host memory of loading a checkpoint onto XLA devices: staged (lit_gpt.xla.load_staged) vs a naive full load.

    python bench/load.py                                  # ~1.4 GB fp32 checkpoint, 8 virtual CPU devices
    python bench/load.py --n_layer 12 --devices 4 --precision bf16-true
    python bench/load.py --sweep true --results_file bench/results/xla_load_cpu.json     # every load mode
    python bench/load.py --sweep true --smollm2_shape true --results_file bench/results/xla_load_tied_cpu.json

Each measurement runs in a fresh process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=devices, SPMD mesh over all of them)
and samples anonymous memory (RssAnon). Reported: overhead = peak - final, where final is the resident size
after loading (on XLA:CPU the device buffers are host memory, so final ~ baseline + model), as a multiple of the
largest transformer block and of the largest single tensor (both in the loaded dtype). The loader places one
tensor at a time, and torch_xla 2.9 copies every host shard it is handed once more before transferring it (its
AtenSource copies unconditionally): a tensor that needs no cast is in host memory once while it is placed (torch_xla's
copy of slices of the mapped file), a cast one twice (the loader's cast shards and torch_xla's copies of them). The
bound ("x bound") is 1.2x the larger of the largest block and those copies of the largest tensor (with a
SmolLM2-style 49152 x 576 tied embedding that tensor is 8 blocks). Memory is sampled from a helper process (a
thread would need the GIL, which torch_xla holds while it copies). Mapped checkpoint pages are not counted: they
count in ru_maxrss but the kernel can drop them. Every staged load is also checked bit-equal to the file's tensors
`.to(dtype)`.

  staged: meta-device model, per block torch.load(mmap=True) or safe_open -> sharded (and cast) transfer
  naive:  torch.load (no mmap) of the whole file, a CPU-initialised GPT, load_state_dict, .to(xla), FSDPv2 setup

`--sweep true` measures staged loads for every file dtype (float32, bfloat16, float16) x precision (32-true,
bf16-true) x devices (1, 8) x file format (lit_model.pth, model.safetensors), plus the naive load of the fp32
file on 8 devices as the reference, and exits 1 if a staged load is over its bound or not bit-equal.
"""

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from lit_gpt import GPT, Config
from lit_gpt.utils import run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)
from instruments import AnonMemorySampler  # bench/instruments.py

BOUND = 1.2  # x the larger of the largest block and the host copies of the largest tensor (1 uncast, 2 cast)
FILES = {"pth": "lit_model.pth", "safetensors": "model.safetensors"}
PRECISION_DTYPE = {"32-true": torch.float32, "bf16-true": torch.bfloat16}


def bench_config(n_layer: int, n_embd: int, intermediate_size: int, vocab_size: int, n_head: int,
                 n_query_groups: int, tie_embeddings: bool) -> Config:
    return Config(
        name="bench-llama",
        block_size=2048,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_query_groups=n_query_groups,
        n_embd=n_embd,
        intermediate_size=intermediate_size,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        tie_embeddings=tie_embeddings,
    )


def make_checkpoint(path: Path, config: Config, dtype: torch.dtype = torch.float32) -> None:
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(config)
    # random tensors one at a time, written at once: the bench machine needs ~1x the file, not 2x. Tied weights
    # are one tensor under both names in a .pth (torch.save keeps it once) and one key in a .safetensors file
    sd: Dict[str, torch.Tensor] = {}
    seen: Dict[int, str] = {}
    for name, t in meta.state_dict(keep_vars=True).items():
        if id(t) in seen:
            if path.suffix != ".safetensors":
                sd[name] = sd[seen[id(t)]]
            continue
        seen[id(t)] = name
        sd[name] = (torch.randn(t.shape) * 0.02).to(dtype)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(path))
    else:
        torch.save(sd, path)
    config.save(path.parent)


def sizes(config: Config, bytes_per: int) -> Dict[str, int]:
    with torch.device("meta"):
        meta = GPT(config)
    params = list(meta.parameters())  # tied parameters once
    return {
        "model": sum(p.numel() for p in params) * bytes_per,
        "block": sum(p.numel() for p in meta.transformer.h[0].parameters()) * bytes_per,
        "tensor": max(p.numel() for p in params) * bytes_per,
    }


def _file_tensors(checkpoint: Path) -> Dict[str, torch.Tensor]:
    if checkpoint.suffix == ".safetensors":
        from safetensors import safe_open

        handle = safe_open(str(checkpoint), framework="pt", device="cpu")
        return {k: handle.get_tensor(k) for k in handle.keys()}
    return torch.load(checkpoint, mmap=True, weights_only=True)


def measure(mode: str, checkpoint: Path, precision: str) -> dict:
    """Runs inside the measuring process."""
    import lit_gpt.xla as lx
    from lit_gpt.xla.loader import _release_host_memory

    config = Config.from_file(checkpoint.parent / "lit_config.json")
    fabric = lx.make_fabric(precision=precision)
    fabric.launch()
    import torch_xla

    torch_xla.sync(wait=True)
    _release_host_memory()  # start from memory that is really in use
    t0 = time.perf_counter()
    with AnonMemorySampler(interval=0.001) as mem:
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
    final = mem.end
    params = dict(model.named_parameters())
    spec = torch_xla._XLAC._get_xla_sharding_spec(max(params.values(), key=lambda p: p.numel()))
    result = {"mode": mode, "start": mem.start, "peak": mem.peak, "final": final, "seconds": seconds, "sharding": spec}
    if mode == "staged":  # after measuring: every weight equal to the file's tensor .to(dtype), bit for bit
        dtype = PRECISION_DTYPE[precision]
        source = _file_tensors(checkpoint)
        stripped = {n.replace("_forward_module.", "").replace("_orig_module.", ""): p for n, p in params.items()}
        result["bit_equal"] = all(
            torch.equal(p.cpu(), source.get(n, source.get("transformer.wte.weight")).to(dtype))
            for n, p in stripped.items()
        ) and {p.dtype for p in params.values()} == {dtype}
    return result


def run_one(mode: str, checkpoint: Path, precision: str, devices: int) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, __file__, "--measure_only", mode, "--checkpoint", str(checkpoint), "--precision", precision]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{mode} measurement failed ({checkpoint}, {precision}, {devices} devices)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(
    out_dir: Path = Path("bench_out/load"),
    n_layer: int = 6,
    n_embd: int = 2048,
    intermediate_size: int = 5632,
    vocab_size: int = 16000,
    n_head: int = 16,
    n_query_groups: int = 16,
    tie_embeddings: bool = False,
    smollm2_shape: bool = False,
    devices: str = "8",
    precision: str = "32-true",
    modes: str = "staged,naive",
    checkpoint_dtype: str = "float32",
    checkpoint_format: str = "pth",
    sweep: bool = False,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
    measure_only: Optional[str] = None,
    checkpoint: Optional[Path] = None,
) -> None:
    """Make (once) random checkpoints and report each load's host-memory overhead.

    Args:
        out_dir: where the checkpoints are written (reused between runs).
        n_layer, n_embd, intermediate_size, vocab_size, n_head, n_query_groups: the Llama-style model (defaults:
            ~1.4 GB fp32).
        tie_embeddings: one tensor for the embedding and the head (SmolLM2, Llama 3.2 1B/3B).
        smollm2_shape: SmolLM2-135M's shape (30 layers, 576 wide, 9 heads, 3 KV heads, 1536, vocab 49152, tied);
            overrides the shape arguments.
        devices: virtual XLA:CPU devices (CPU_NUM_DEVICES); comma-separated for several.
        precision: 32-true or bf16-true (loading a file of another dtype casts); comma-separated for several.
        modes: comma-separated: staged, naive.
        checkpoint_dtype: dtype of the checkpoint file (float32, bfloat16, float16); comma-separated for several.
        checkpoint_format: pth (lit_model.pth) or safetensors (model.safetensors); comma-separated for several.
        sweep: every dtype x precision x devices (1, 8) x format, staged, plus the naive fp32 reference on 8.
        results_file: also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: a remark stored in the results file (e.g. what else ran on the machine).
        measure_only, checkpoint: internal: run one measurement in this process and print it as JSON.
    """
    if measure_only:
        print(json.dumps(measure(measure_only, Path(checkpoint), precision)))
        return
    if smollm2_shape:
        n_layer, n_embd, intermediate_size, vocab_size, n_head, n_query_groups, tie_embeddings = (
            30, 576, 1536, 49152, 9, 3, True)
    config = bench_config(n_layer, n_embd, intermediate_size, vocab_size, n_head, n_query_groups, tie_embeddings)
    split = lambda value: [v for v in str(value).split(",") if v]  # noqa: E731
    if sweep:
        cases = [("staged", d, p, int(n), f) for f, n, d, p in itertools.product(
            ("pth", "safetensors"), (8, 1), ("float32", "bfloat16", "float16"), ("bf16-true", "32-true"))]
        cases.append(("naive", "float32", "32-true", 8, "pth"))
        cases.append(("naive", "float32", "bf16-true", 8, "pth"))
    else:
        cases = list(itertools.product(split(modes), split(checkpoint_dtype), split(precision),
                                       map(int, split(devices)), split(checkpoint_format)))
    tag = f"L{n_layer}-E{n_embd}-I{intermediate_size}-V{vocab_size}{'-tied' if tie_embeddings else ''}"
    gb = 1024**3
    rows: List[dict] = []
    for mode, file_dtype, prec, n, fmt in cases:
        if mode == "naive" and fmt != "pth":
            continue
        path = Path(out_dir) / tag / file_dtype / FILES[fmt]
        make_checkpoint(path, config, getattr(torch, file_dtype))
        size = sizes(config, PRECISION_DTYPE[prec].itemsize)
        cast = file_dtype != str(PRECISION_DTYPE[prec]).split(".")[1]
        bound = max(size["block"], size["tensor"] * (2 if cast else 1))
        r = run_one(mode, path, prec, n)
        over = r["peak"] - r["final"]
        above_model = r["peak"] - r["start"] - size["model"]
        row = {
            "mode": mode, "file": f"{file_dtype} {FILES[fmt]}", "precision": prec, "devices": n, "cast": cast,
            "overhead_gib": over / gb, "x_block": over / size["block"], "x_tensor": over / size["tensor"],
            "x_bound": over / bound, "above_model_x_bound": above_model / bound,
            "resident_added_gib": (r["final"] - r["start"]) / gb, "seconds": r["seconds"], "sharding": r["sharding"],
            "bit_equal": r.get("bit_equal"),
        }
        rows.append(row)
        print(
            f"{mode:>6} {row['file']:>26} as {prec:>9} on {n}: peak - final RssAnon {over / gb:.3f} GiB ="
            f" {row['x_block']:.2f} x block = {row['x_tensor']:.2f} x tensor = {row['x_bound']:.2f} x bound;"
            f" peak - (start + model) {row['above_model_x_bound']:.2f} x bound; resident added"
            f" {row['resident_added_gib']:.2f} GiB; {r['seconds']:.1f} s; {r['sharding']}"
            f"{'' if row['bit_equal'] is None else '; bit-equal' if row['bit_equal'] else '; NOT BIT-EQUAL'}",
            flush=True,
        )
    fp32, bf16 = sizes(config, 4), sizes(config, 2)
    settings = {
        "config": {"n_layer": n_layer, "n_embd": n_embd, "intermediate_size": intermediate_size,
                   "vocab_size": vocab_size, "n_head": n_head, "n_query_groups": n_query_groups,
                   "tie_embeddings": tie_embeddings},
        "sizes_gib": {"fp32": {k: v / gb for k, v in fp32.items()}, "bf16": {k: v / gb for k, v in bf16.items()}},
        "bound": f"{BOUND} x max(largest block, largest tensor x 2 if cast else x 1) in the loaded dtype",
        "sampler_interval_s": 0.001,
        "sampler": "helper process reading /proc/PID/status",
    }
    result_files.write(results_file, "xla_load", settings, rows, note)
    bad = [r for r in rows if r["mode"] == "staged" and (r["x_bound"] > BOUND or r["bit_equal"] is False)]
    if bad:
        raise SystemExit(f"{len(bad)} staged load(s) over {BOUND}x the bound or not bit-equal")


if __name__ == "__main__":
    run_cli(main)
