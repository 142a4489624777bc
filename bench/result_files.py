"""Result files of the benchmarks: one JSON file per run, with the machine, the versions, the date and the numbers.

Every `bench/*.py` takes `--results_file PATH` (and `--note TEXT`, e.g. "machine shared with other jobs") and then
writes

    {"bench": "xla_generate", "date": "...", "command": "python bench/xla_generate.py ...", "note": "...",
     "machine": {...}, "versions": {...}, "load_average": {"start": [...], "end": [...]},
     "settings": {...}, "results": {...}}

The committed files live in `bench/results/`; `python bench/tables.py` writes the results tables of README.md and
xla/README.md from them, and tests/test_docs.py checks that the tables in the READMEs are what it writes.
"""

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from lit_gpt.utils import meminfo_bytes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "torch_xla", "lightning", "transformers", "jsonargparse", "tokenizers")
_START_LOAD = os.getloadavg()  # taken when a bench imports this module, before it starts working


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> Optional[float]:
    total = meminfo_bytes("MemTotal")
    return None if total is None else round(total / 2**30, 1)


def machine() -> Dict[str, Any]:
    info: Dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpu": None,
    }
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> Dict[str, Optional[str]]:
    found: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _commit() -> Optional[str]:
    if os.environ.get("BENCH_COMMIT"):  # set when running from an exported copy of a commit (no .git there)
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write(path: Optional[Path], bench: str, settings: Dict[str, Any], results: Any, note: Optional[str] = None) -> None:
    """Write one result file (nothing when `path` is None), atomically; when that fails after the run, the record is
    kept in a temporary file that the error line names (lit_gpt.recipes.outputs.write_results)."""
    if path is None:
        return
    record = {
        "bench": bench,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *map(shlex.quote, [os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])]),
        "commit": _commit(),
        "note": note,
        "machine": machine(),
        "versions": versions(),
        "env": {k: os.environ[k] for k in ("PJRT_DEVICE", "CPU_NUM_DEVICES") if k in os.environ},
        "load_average": {"start": list(_START_LOAD), "end": list(os.getloadavg())},
        "settings": settings,
        "results": results,
    }
    from lit_gpt.recipes.outputs import write_results

    path = write_results(Path(path), json.dumps(record, indent=2, default=str) + "\n")
    print(f"results written to {path}", file=sys.stderr)


def _check_results_file(argv: List[str]) -> None:
    """A bench run's --results_file is checked when the bench imports this module, before it loads or measures
    anything (a folder, a file under a file, a read-only folder): a run of minutes must not end in a failed write.
    One `error:` line and exit 1, as run_cli reports a LitError."""
    from lit_gpt.recipes.outputs import check_output_file
    from lit_gpt.utils import LitError

    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--results_file"]
    values += [a.split("=", 1)[1] for a in argv if a.startswith("--results_file=")]
    try:
        for value in values:
            if value not in ("null", "None"):
                check_output_file(value, "--results_file")
    except LitError as e:
        sys.exit(f"error: {e}")


if Path(sys.argv[0]).resolve().parent == ROOT / "bench":  # a bench script run from the command line
    _check_results_file(sys.argv[1:])
