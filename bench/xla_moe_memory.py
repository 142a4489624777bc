"""Host memory of the XLA checkpoint paths on a mixture-of-experts checkpoint against a dense one of the same size,
in the same run: the staged loader (lit_gpt.xla.load_staged), the sharded save (lit_gpt.xla.save_sharded) and the
consolidation (lit_gpt.xla.consolidation.consolidate).

    python bench/xla_moe_memory.py --results_file bench/results/xla_moe_memory_cpu.json

The models (random fp32 weights, 4 layers, 1024 wide, vocab 16000, ~0.6 GB each; each block ~111 MB):
  dense         the Llama-style MLP, intermediate 8192
  mixtral-like  8 experts, 2 per token, each 1024 wide (the experts hold as many weights as the dense MLP)
  qwen3moe-like 64 experts, 8 per token, each 128 wide (the same again, in 64 small experts)
so the three share their checkpoint size, their largest block and their largest tensor (the embedding): an MoE
block is as big as the dense block it replaces, and the expert weights are (n_expert, out, in) tensors that FSDPv2
splits 8 ways along their largest dimension.

Each measurement is a fresh process on 8 virtual XLA:CPU devices (SPMD mesh), sampling anonymous memory (RssAnon)
every millisecond from a helper process (bench/instruments.py), as bench/load.py and bench/consolidate.py do:
  load         bench/load.py's staged measurement (32-true: no cast; bf16-true: a cast on the way): peak - final,
               as a multiple of the largest block, of the largest tensor and of bench/load.py's bound
               (1.2 x the larger of the largest block and 1 / 2 (cast) copies of the largest tensor); every weight
               checked bit-equal to the file's
  save         the fp32 model loaded staged, then `save_sharded(dir, {"model": ...})`: peak - start of the save
  consolidate  `consolidate(dir, out)` without torch_xla (bench/consolidate.py's measurement, 512MB shards): peak -
               start against its bound, the largest output shard + 3 x the largest DCP chunk + 32 MiB
Each is measured `--repeats` times (3): the rows hold the median and every value (the save's peak varies by
~30 MiB between identical runs; a load's peak - final is 0-45 MiB for every model, sampling noise). Exits 1 if any
load or consolidation is over its bound, a load is not bit-equal, or an MoE model's median save or consolidation
overhead (as a multiple of the largest block) is over 1.1x the dense model's plus 0.05.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from lit_gpt import GPT, Config
from lit_gpt.utils import run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
GIB, MIB = 1 << 30, 1 << 20
SHAPE = dict(block_size=2048, vocab_size=16000, n_layer=4, n_embd=1024, n_head=16, n_query_groups=4, head_size=64,
             norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", tie_embeddings=False)
MODELS = {
    "dense": dict(intermediate_size=8192),
    "mixtral-like": dict(intermediate_size=8192, n_expert=8, n_expert_per_token=2, moe_intermediate_size=1024),
    "qwen3moe-like": dict(intermediate_size=8192, n_expert=64, n_expert_per_token=8, moe_intermediate_size=128),
}
LOAD_BOUND = 1.2  # bench/load.py's
MOE_SLACK = (1.1, 0.05)  # an MoE path's overhead (x largest block) within 1.1 x the dense one's + 0.05


def model_config(kind: str) -> Config:
    return Config(name=f"bench-{kind}", **SHAPE, **MODELS[kind])


def model_sizes(config: Config, bytes_per: int) -> Dict[str, int]:
    with torch.device("meta"):
        meta = GPT(config)
    params = list(meta.parameters())
    return {
        "model": sum(p.numel() for p in params) * bytes_per,
        "block": max(sum(p.numel() for p in b.parameters()) for b in meta.transformer.h) * bytes_per,
        "tensor": max(p.numel() for p in params) * bytes_per,
        "expert_tensor": max((p.numel() for n, p in meta.named_parameters() if ".experts." in n),
                             default=0) * bytes_per,
    }


def measure_save(checkpoint: Path, sharded: Path) -> Dict[str, Any]:
    """Runs in the measuring process (XLA): staged load of the fp32 model, then the sharded save, sampled."""
    from instruments import AnonMemorySampler  # bench/instruments.py

    import lit_gpt.xla as lx
    from lit_gpt.xla.loader import _release_host_memory

    config = Config.from_file(checkpoint.parent / "lit_config.json")
    fabric = lx.make_fabric(precision="32-true")
    fabric.launch()
    import torch_xla

    model = fabric.setup(lx.load_staged(config, checkpoint, fabric, progress=False))
    torch_xla.sync(wait=True)
    _release_host_memory()
    t0 = time.perf_counter()
    with AnonMemorySampler(interval=0.001) as mem:
        lx.save_sharded(sharded, {"model": model, "step": 0})
    return {"start": mem.start, "peak": mem.peak, "final": mem.end, "seconds": time.perf_counter() - t0}


def _row(model: str, path: str, precision: str, over: List[int], size: Dict[str, int], bound: Optional[float],
         seconds: List[float], **extra: Any) -> Dict[str, Any]:
    """One path's measurements: the median overhead (and every one) as MiB and multiples of the largest block,
    the largest tensor and the path's bound."""
    mid = statistics.median(over)
    row = {"model": model, "path": path, "precision": precision, "overhead_mib": mid / MIB,
           "overhead_all_mib": [o / MIB for o in over], "x_block": mid / size["block"],
           "x_tensor": mid / size["tensor"],
           "seconds": statistics.median(seconds)}
    if bound is not None:
        row.update(x_bound=mid / bound, x_bound_max=max(over) / bound, bound_mib=bound / MIB)
    row.update(extra)
    return row


def _child(args: List[str], env: Dict[str, str]) -> Dict[str, Any]:
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"measurement failed: {' '.join(args)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(
    out_dir: Path = Path("bench_out/xla_moe_memory"),
    devices: int = 8,
    models: str = "dense,mixtral-like,qwen3moe-like",
    max_shard_size: str = "512MB",
    repeats: int = 3,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
    child: Optional[str] = None,
    checkpoint: Optional[Path] = None,
    sharded: Optional[Path] = None,
) -> None:
    """Measure the staged load, the sharded save and the consolidation of an MoE and a dense checkpoint.

    Args:
        out_dir: where the checkpoints are written (reused between runs; the sharded ones are rewritten).
        devices: virtual XLA:CPU devices (the SPMD mesh).
        models: comma-separated, from dense, mixtral-like, qwen3moe-like.
        max_shard_size: the consolidation's output shards.
        repeats: measurements of each path (fresh processes); the rows hold their median and all of them.
        results_file: also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: a remark stored in the results file (e.g. what else ran on the machine).
        child, checkpoint, sharded: internal: run one measurement in this process and print it as JSON.
    """
    if child == "save":
        print(json.dumps(measure_save(Path(checkpoint), Path(sharded))))
        return
    if child == "consolidate":
        from consolidate import measure  # bench/consolidate.py

        output = Path(out_dir) / "consolidated"
        shutil.rmtree(output, ignore_errors=True)
        output.mkdir(parents=True)
        print(json.dumps(measure("sharded", Path(sharded), output, max_shard_size)))
        return
    from consolidate import layout  # bench/consolidate.py
    from load import make_checkpoint, run_one  # bench/load.py

    xla_env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2")
    cpu_env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    rows: List[Dict[str, Any]] = []
    sizes_all: Dict[str, Dict[str, float]] = {}
    for kind in models.split(","):
        config = model_config(kind)
        path = Path(out_dir) / kind / "model.safetensors"
        make_checkpoint(path, config)
        fp32, bf16 = model_sizes(config, 4), model_sizes(config, 2)
        sizes_all[kind] = {k: v / MIB for k, v in fp32.items()}
        print(f"{kind}: {fp32['model'] / GIB:.2f} GiB fp32, largest block {fp32['block'] / MIB:.0f} MiB, largest"
              f" tensor {fp32['tensor'] / MIB:.0f} MiB, largest expert tensor {fp32['expert_tensor'] / MIB:.0f} MiB",
              flush=True)
        for precision, size in (("32-true", fp32), ("bf16-true", bf16)):
            cast = precision != "32-true"
            runs = [run_one("staged", path, precision, devices) for _ in range(repeats)]
            over = [r["peak"] - r["final"] for r in runs]
            above = [r["peak"] - r["start"] - size["model"] for r in runs]  # what loading needs beyond the model
            bound = LOAD_BOUND * max(size["block"], size["tensor"] * (2 if cast else 1))
            rows.append(_row(kind, "load", precision, over, size, bound, [r["seconds"] for r in runs],
                             above_model_mib=statistics.median(above) / MIB,
                             above_model_x_block=statistics.median(above) / size["block"],
                             bit_equal=all(r["bit_equal"] for r in runs), sharding=runs[0]["sharding"]))
        shard_dir = Path(out_dir) / kind / "sharded"
        runs = []
        for _ in range(repeats):
            shutil.rmtree(shard_dir, ignore_errors=True)
            runs.append(_child([__file__, "--child", "save", "--checkpoint", str(path), "--sharded", str(shard_dir)],
                               xla_env))
        over = [r["peak"] - r["start"] for r in runs]
        rows.append(_row(kind, "save", "32-true", over, fp32, None, [r["seconds"] for r in runs],
                         x_model=statistics.median(over) / fp32["model"]))
        lay = layout(shard_dir, max_shard_size)
        bound = lay["largest_shard_sharded"] + 3 * lay["largest_chunk"] + 32 * MIB
        runs = [_child([__file__, "--out_dir", str(Path(out_dir) / kind), "--max_shard_size", max_shard_size,
                        "--child", "consolidate", "--sharded", str(shard_dir)], cpu_env) for _ in range(repeats)]
        rows.append(_row(kind, "consolidate", "32-true", [r["added"] for r in runs], fp32, bound,
                         [r["seconds"] for r in runs], largest_chunk_mib=lay["largest_chunk"] / MIB))
        shutil.rmtree(Path(out_dir) / kind / "consolidated", ignore_errors=True)
        for row in rows[-4:]:
            extra = f" = {row['x_bound']:.2f} x bound" if "x_bound" in row else ""
            print(f"  {row['path']:>11} {row['precision']:>9}: median +{row['overhead_mib']:.0f} MiB ="
                  f" {row['x_block']:.2f} x largest block = {row['x_tensor']:.2f} x largest tensor{extra};"
                  f" {row['seconds']:.1f} s", flush=True)
    failed = [f"{r['model']} {r['path']} {r['precision']} over its bound ({r['x_bound_max']:.2f})" for r in rows
              if r.get("x_bound_max", 0) > 1]
    failed += [f"{r['model']} load {r['precision']} not bit-equal" for r in rows if r.get("bit_equal") is False]
    dense = {(r["path"], r["precision"]): r for r in rows if r["model"] == "dense"}
    for r in rows:
        ref = dense.get((r["path"], r["precision"]))
        if r["model"] != "dense" and ref is not None:
            r["x_block_vs_dense"] = r["x_block"] / ref["x_block"] if ref["x_block"] > 0 else None
            # loads: peak - final is 0-45 MiB for every model, within the sampling noise (held to their bound
            # above); the save and the consolidation hold hundreds of MiB, steady to ~10%: compared
            if r["path"] != "load" and r["x_block"] > MOE_SLACK[0] * ref["x_block"] + MOE_SLACK[1]:
                failed.append(f"{r['model']} {r['path']} {r['precision']}: {r['x_block']:.2f} x block against the"
                              f" dense model's {ref['x_block']:.2f}")
    settings = {
        "shape": SHAPE, "models": MODELS, "devices": devices, "max_shard_size": max_shard_size,
        "sizes_fp32_mib": sizes_all, "checkpoint": "random fp32 model.safetensors",
        "load_bound": f"{LOAD_BOUND} x max(largest block, largest tensor x 2 if cast else x 1) in the loaded dtype",
        "consolidate_bound": "largest output shard + 3 x largest DCP chunk + 32 MiB",
        "moe_vs_dense": f"save, consolidate: MoE x_block <= {MOE_SLACK[0]} x dense x_block + {MOE_SLACK[1]};"
                        " load: every model within its bound",
        "sampler": "helper process reading /proc/PID/status (RssAnon) every 1 ms", "repeats": repeats,
        "compared": "medians of the repeats; bounds: every repeat",
    }
    result_files.write(results_file, "xla_moe_memory", settings, rows, note)
    if failed:
        raise SystemExit("; ".join(failed))


if __name__ == "__main__":
    run_cli(main)
