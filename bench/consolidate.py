"""Consolidating a sharded checkpoint: the safetensors writer (`lit_gpt.xla.consolidation`) against the writer it
replaced, in the same run: peak host memory and throughput.

    python bench/consolidate.py --results_file bench/results/consolidate_cpu.json
    python bench/consolidate.py --max_shard_size 256MB --repeats 5

The checkpoint (made once under OUT_DIR/consolidate): the bench/load.py model (6 layers, 2048 wide, vocab 16000:
~1.4 GB fp32), saved as safetensors, loaded onto 8 virtual XLA:CPU devices and saved with `save_sharded`, so every
tensor is split 8 ways along its largest dimension, as FSDPv2 shards it.

The writers, each run in a fresh process without torch_xla:
  old      the torch-zip writer of commit 65a9963 (`lit_model.pth`: a `skip_data` skeleton filled in place by
           copy_file_range / pwrite, zip CRCs patched), its source taken from git history and run as a module
  sharded  `consolidate(..., max_shard_size=--max_shard_size)` (default: consolidation's default, 512MB): several
           safetensors shards and their index
  single   `consolidate(..., max_shard_size="5GB")` (the converters' shard size): one `lit_model.safetensors`, the whole
           model one shard: what a larger default would cost
A first round is not timed: it brings the input into the page cache and its outputs are compared tensor by tensor
(bit-equal). Then `--repeats` rounds, each writer first, second and third in turn, each output deleted as soon as
it is measured. Both writers verify every input file's CRC32 first and fsync what they write. Reported: wall time
and CPU time (medians), throughput (checkpoint bytes / wall time) and its ratio to the old writer's, and peak
anonymous memory above the start (RssAnon sampled every millisecond from a helper process; both writers read the
input with read(), nothing is mapped) against the new writer's bound: the largest output shard + 3 x the largest
DCP chunk (DCP's reader can hold the chunk it reads, the previous one and torch.load's buffer) + 32 MiB for the
libraries' own allocations. Exits 1 if the sharded writer's throughput is under 0.8x the old one's, a peak is over
its bound, or an output differs.
"""

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

from lit_gpt.utils import run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OLD_COMMIT = "65a9963"  # the last commit with the hand-written torch-zip consolidation
MIB = 1 << 20
SLACK = 32 * MIB  # the libraries' own allocations while they copy (torch, DCP's planner, safetensors)
MIN_RATIO = 0.8
WRITERS = ["old", "sharded", "single"]


def old_writer() -> types.ModuleType:
    """The consolidation as it was at OLD_COMMIT, from git history (one import moved since: patched)."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:lit_gpt/xla/checkpoint.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    source = source.replace("from lit_gpt.runtime import as_tuple", "from lit_gpt.state import as_tuple")
    module = types.ModuleType("old_checkpoint")
    module.__file__ = f"<{OLD_COMMIT}:lit_gpt/xla/checkpoint.py>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def measure(what: str, sharded: Path, output: Path, max_shard_size: str) -> Dict[str, Any]:
    """Runs inside the measuring process."""
    # the libraries both writers use, imported before the start: the peak is the writer's, not its imports'
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import tqdm  # noqa: F401
    from instruments import AnonMemorySampler  # bench/instruments.py

    from lit_gpt.xla.consolidation import consolidate

    old = old_writer() if what == "old" else None
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with AnonMemorySampler(interval=0.001) as mem:
        if old is not None:
            old.consolidate(sharded, output / "lit_model.pth", progress=False)
        else:
            consolidate(sharded, output, max_shard_size=max_shard_size if what == "sharded" else "5GB",
                        progress=False)
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "cpu_seconds": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
            "added": mem.peak - mem.start, "xla_imported": "torch_xla" in sys.modules}


def make_checkpoint(work: Path, devices: int) -> Path:
    from load import bench_config, make_checkpoint as make_model  # bench/load.py

    sharded = work / "sharded"
    if (sharded / "lit_checkpoint.json").is_file():
        return sharded
    model = work / "model" / "model.safetensors"
    make_model(model, bench_config(6, 2048, 5632, 16000, 16, 16, False))
    code = (
        "import lit_gpt.xla as lx; from lit_gpt import Config; from pathlib import Path;"
        f"d = Path({str(model.parent)!r}); f = lx.make_fabric(); f.launch();"
        "m = lx.load_staged(Config.from_file(d / 'lit_config.json'), d / 'model.safetensors', f, progress=False);"
        f"lx.save_sharded({str(sharded)!r}, {{'model': m, 'step': 0}})"
    )
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return sharded


def layout(sharded: Path, max_shard_size: str) -> Dict[str, int]:
    """Sizes that set the bounds: the checkpoint's tensor bytes, the largest DCP chunk, the largest planned shard."""
    import torch
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import split_torch_state_dict_into_shards
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(sharded)).read_metadata()
    tensors = {k: t for k, t in md.state_dict_metadata.items() if isinstance(t, TensorStorageMetadata)}
    size = {k: torch.empty((), dtype=t.properties.dtype).element_size() for k, t in tensors.items()}
    specs = {k: torch.empty(t.size, dtype=t.properties.dtype, device="meta") for k, t in tensors.items()}

    def largest_shard(limit: str) -> int:
        plan = split_torch_state_dict_into_shards(specs, max_shard_size=limit)
        return max(sum(specs[n].numel() * size[n] for n in names) for names in plan.filename_to_tensors.values())

    return {
        "bytes": sum(t.size.numel() * size[k] for k, t in tensors.items()),
        "largest_tensor": max(t.size.numel() * size[k] for k, t in tensors.items()),
        "largest_chunk": max(
            (torch.Size(c.sizes).numel() * size[k] for k, t in tensors.items() for c in t.chunks), default=0
        ),
        "largest_shard_sharded": largest_shard(max_shard_size),
        "largest_shard_single": largest_shard("5GB"),
        "files": len(list(sharded.glob("*.distcp"))),
    }


def bit_equal(outputs: Dict[str, Path]) -> bool:
    import torch

    from lit_gpt.weights import find_weights, load_weights

    old = torch.load(outputs["old"] / "lit_model.pth", mmap=True, weights_only=True)
    for what in ("sharded", "single"):
        new = load_weights(find_weights(outputs[what]))
        if set(new) != set(old) or not all(torch.equal(new[k], old[k]) and new[k].dtype == old[k].dtype for k in old):
            return False
    return True


def main(
    out_dir: Path = Path("bench_out"),
    devices: int = 8,
    max_shard_size: str = "512MB",
    repeats: int = 4,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
    child: Optional[str] = None,
) -> None:
    """Measure the safetensors consolidation against the old torch-zip writer on the same sharded checkpoint.

    Args:
        out_dir: working directory (the checkpoint is made once in OUT_DIR/consolidate and reused).
        devices: virtual XLA:CPU devices the checkpoint is sharded over.
        max_shard_size: the output shard size of the "sharded" runs (default: consolidation's own, 512MB: three
            shards of the 1.4 GB model).
        repeats: timed runs of each writer (interleaved, after one untimed round whose outputs are compared);
            times are their medians, peaks their maxima.
        results_file: also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: a remark stored in the results file (e.g. what else ran on the machine).
        child: internal: run one measurement in this process and print it as JSON.
    """
    work = Path(out_dir) / "consolidate"
    if child:
        print(json.dumps(measure(child, work / "sharded", work / f"out-{child}", max_shard_size)))
        return
    sharded = make_checkpoint(work, devices)
    sizes = layout(sharded, max_shard_size)
    bounds = {
        "sharded": sizes["largest_shard_sharded"] + 3 * sizes["largest_chunk"] + SLACK,
        "single": sizes["largest_shard_single"] + 3 * sizes["largest_chunk"] + SLACK,
    }
    gib = 1 << 30
    print(f"sharded checkpoint {sharded}: {sizes['bytes'] / gib:.2f} GiB of tensors in {sizes['files']} file(s),"
          f" {devices} devices; largest tensor {sizes['largest_tensor'] / MIB:.0f} MiB, largest chunk"
          f" {sizes['largest_chunk'] / MIB:.1f} MiB", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    outputs = {what: work / f"out-{what}" for what in WRITERS}

    def run(what: str) -> Dict[str, Any]:
        shutil.rmtree(outputs[what], ignore_errors=True)
        outputs[what].mkdir(parents=True)
        cmd = [sys.executable, __file__, "--out_dir", str(out_dir), "--max_shard_size", max_shard_size, "--child", what]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{what} failed")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # a first round, not timed: warms the page cache with the input, and its outputs are compared
    for what in WRITERS:
        run(what)
    equal = bit_equal(outputs)
    print(f"outputs bit-equal: {equal}", flush=True)
    runs: Dict[str, List[Dict[str, Any]]] = {what: [] for what in WRITERS}
    for i in range(repeats):
        # each writer first, second and third in turn; an output is deleted as soon as it is measured, so no
        # writer runs beside another's 1.4 GB in the page cache
        for what in WRITERS[i % 3:] + WRITERS[: i % 3]:
            r = run(what)
            shutil.rmtree(outputs[what], ignore_errors=True)
            runs[what].append(r)
            print(f"  {what:>7}: {r['seconds']:.2f} s (CPU {r['cpu_seconds']:.2f} s), peak RssAnon"
                  f" +{r['added'] / MIB:.0f} MiB", flush=True)

    old_s = statistics.median(r["seconds"] for r in runs["old"])
    rows = []
    for what, label in (("old", f"old: torch zip (lit_model.pth, {OLD_COMMIT})"),
                        ("sharded", f"new: safetensors, {max_shard_size} shards + index"),
                        ("single", "new: safetensors, one file (5GB shards)")):
        seconds = statistics.median(r["seconds"] for r in runs[what])
        added = max(r["added"] for r in runs[what])
        row = {
            "writer": what, "label": label, "seconds": seconds, "seconds_all": [r["seconds"] for r in runs[what]],
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs[what]),
            "gib_per_s": sizes["bytes"] / gib / seconds, "throughput_vs_old": old_s / seconds,
            "peak_added_mib": added / MIB, "peak_added_all_mib": [r["added"] / MIB for r in runs[what]],
            "bound_mib": bounds[what] / MIB if what in bounds else None,
            "x_bound": added / bounds[what] if what in bounds else None,
            "xla_imported": any(r["xla_imported"] for r in runs[what]),
        }
        rows.append(row)
        print(f"{label}: {seconds:.2f} s = {row['gib_per_s']:.2f} GiB/s = {row['throughput_vs_old']:.2f} x old"
              f" (CPU {row['cpu_seconds']:.2f} s);"
              f" peak RssAnon +{row['peak_added_mib']:.0f} MiB"
              + (f" = {row['x_bound']:.2f} x bound ({row['bound_mib']:.0f} MiB)" if what in bounds else ""))
    settings = {
        "model": {"n_layer": 6, "n_embd": 2048, "intermediate_size": 5632, "vocab_size": 16000, "dtype": "float32"},
        "devices": devices, "max_shard_size": max_shard_size, "repeats": repeats, "old_commit": OLD_COMMIT,
        "sizes_mib": {k: v / MIB for k, v in sizes.items() if k != "files"}, "input_files": sizes["files"],
        "bound": "largest output shard + 3 x largest DCP chunk + 32 MiB",
        "sampler": "helper process reading /proc/PID/status (RssAnon) every 1 ms",
        "min_throughput_vs_old": MIN_RATIO,
    }
    result_files.write(results_file, "consolidate", settings, {"rows": rows, "bit_equal": equal}, note)
    sharded_row = rows[1]
    failed = [why for why, bad in (
        (f"sharded throughput {sharded_row['throughput_vs_old']:.2f} x old < {MIN_RATIO}",
         sharded_row["throughput_vs_old"] < MIN_RATIO),
        ("a peak over its bound", any(r["x_bound"] is not None and r["x_bound"] > 1 for r in rows)),
        ("outputs differ", not equal),
    ) if bad]
    if failed:
        raise SystemExit("; ".join(failed))


if __name__ == "__main__":
    run_cli(main)
