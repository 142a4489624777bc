"""Consolidating a sharded checkpoint: throughput vs a plain copy of the same bytes, and peak memory.

    python bench/consolidate.py                 # ~1.4 GB fp32 model saved sharded over 8 virtual CPU devices
    python bench/consolidate.py --reference true   # also torch's dcp_to_torch_save (holds the whole state in RAM)

Steps: (1) a fresh PJRT_DEVICE=CPU process loads the bench/load.py model onto 8 devices and saves it with
`save_sharded`; (2) the shard files are copied with shutil (the "plain copy" of the same bytes); (3) a fresh
process without torch_xla runs `consolidate` and reports its peak RSS (ru_maxrss: the input is read with read(),
not mapped, so this is real memory) and RSS before starting. Every run reads files the previous step just wrote,
so all read from the page cache alike.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from lit_gpt.utils import run_cli

HERE = Path(__file__).resolve().parent


def _rss_now() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(what: str, sharded: Path, output: Path) -> dict:
    import torch  # noqa: F401  (imported before the baseline is taken: the baseline is torch's own footprint)

    before = _rss_now()
    t0 = time.perf_counter()
    if what == "consolidate":
        from lit_gpt.xla.checkpoint import consolidate

        consolidate(sharded, output, progress=False)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(sharded), str(output))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "rss_before": before, "peak_rss": peak, "xla_imported": "torch_xla" in sys.modules}


def _save_sharded(model_dir: Path, sharded: Path, devices: int) -> None:
    code = (
        "import sys, lit_gpt.xla as lx; from lit_gpt import Config; from pathlib import Path;"
        f"d = Path({str(model_dir)!r}); cfg = Config.from_file(d / 'lit_config.json');"
        "f = lx.make_fabric(); f.launch();"
        "m = lx.load_staged(cfg, d / 'lit_model.pth', f, progress=False);"
        f"lx.save_sharded({str(sharded)!r}, {{'model': m, 'step': 0}})"
    )
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def main(
    out_dir: Path = Path("bench_out"),
    devices: int = 8,
    reference: bool = False,
    child: Optional[str] = None,
) -> None:
    """Measure consolidation of the bench/load.py model saved sharded.

    Args:
        out_dir: working directory (bench/load.py's checkpoint is made in OUT_DIR/load if missing).
        devices: virtual XLA:CPU devices the checkpoint is sharded over.
        reference: also time torch's dcp_to_torch_save.
        child: internal: run one measurement in this process and print it as JSON.
    """
    out_dir = Path(out_dir)
    sharded = out_dir / "consolidate" / "sharded"
    if child:
        print(json.dumps(_child(child, sharded, out_dir / "consolidate" / f"{child}.pth")))
        return
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model_dir = out_dir / "load"
    if not (model_dir / "lit_model.pth").is_file():
        subprocess.run([sys.executable, str(HERE / "load.py"), "--out_dir", str(model_dir), "--modes", ""], check=True)
    if not (sharded / "lit_checkpoint.json").is_file():
        _save_sharded(model_dir, sharded, devices)
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(sharded)).read_metadata()
    largest = max(
        t.size.numel() * torch.empty((), dtype=t.properties.dtype).element_size()
        for t in md.state_dict_metadata.values()
        if isinstance(t, TensorStorageMetadata)
    )
    files = sorted(sharded.glob("*.distcp"))
    nbytes = sum(f.stat().st_size for f in files)
    gb = 1024**3

    copy_dir = out_dir / "consolidate" / "copy"
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    for f in files:
        shutil.copyfile(f, copy_dir / f.name)
        with open(copy_dir / f.name, "rb+") as fh:
            os.fsync(fh.fileno())  # consolidate fsyncs its output too
    copy_s = time.perf_counter() - t0
    shutil.rmtree(copy_dir)
    print(
        f"sharded checkpoint {sharded}: {nbytes / gb:.2f} GiB in {len(files)} file(s), {devices} devices, largest"
        f" tensor {largest / gb:.3f} GiB"
    )
    print(f"  plain copy: {copy_s:.2f} s = {nbytes / gb / copy_s:.2f} GiB/s")
    for what in ["consolidate"] + (["reference"] if reference else []):
        env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
        cmd = [sys.executable, __file__, "--out_dir", str(out_dir), "--child", what]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{what} failed")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        added = r["peak_rss"] - r["rss_before"]
        label = "consolidate" if what == "consolidate" else "dcp_to_torch_save (reference)"
        print(
            f"  {label}: {r['seconds']:.2f} s = {nbytes / gb / r['seconds']:.2f} GiB/s ="
            f" {copy_s / r['seconds']:.2f} x copy throughput; peak RSS {r['peak_rss'] / gb:.2f} GiB"
            f" (= {r['peak_rss'] / largest:.1f} x largest tensor; torch alone {r['rss_before'] / gb:.2f} GiB, added"
            f" {added / gb:.2f} GiB = {added / largest:.2f} x largest tensor = {added / nbytes:.2f} x checkpoint);"
            f" torch_xla imported: {r['xla_imported']}"
        )
        (out_dir / "consolidate" / f"{what}.pth").unlink(missing_ok=True)


if __name__ == "__main__":
    run_cli(main)
