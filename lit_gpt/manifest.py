"""What makes a step checkpoint whole, on every backend and every storage: a manifest that records each file of the
step (size and CRC32C, or CRC32 in manifests of earlier versions), written last, so that a step is used only when
it is complete and undamaged.

    write_manifest(folder)              the manifest of a local folder's files (before the folder is committed)
    problem = step_problem(step_dir)    None when whole; else a `StepProblem` saying what is wrong, in one line
    newest_intact(steps, problem_of, out_dir)   what --resume auto takes, skipped steps named in one line

A step of a CPU/CUDA run (`lit_gpt.runtime.Runtime`) holds Fabric's `checkpoint.pth` and the run's files; one of
an XLA run (`lit_gpt.xla.checkpoint`) holds per-host DCP shards, and its completion marker (the same file name,
`lit_checkpoint.json`) carries the same "checksums" table, so both are verified by the same code here. On a local
disk the step is written under a temporary name and renamed when whole; in a bucket (and a `file://` URL, which
fsspec writes in place) its files are written first and the manifest last: it is the commit. A kill at any point
leaves either a whole step or one without a readable manifest, which `--resume auto` skips with one line.

Step folders written by earlier versions on a local disk have no manifest: they were committed by a rename, so they
are taken as whole (unverified).

Checksums: CRC32C (Castagnoli) through the `google-crc32c` package, whose C extension uses the CPU's CRC32C
instruction (SSE4.2 / ARMv8): several times faster than zlib's CRC32, which bounded a 7B or 70B run's save and resume
(xla/README.md, "Verifying checkpoints at scale"). Each file records the algorithm it was summed with (its key:
"crc32c" or "crc32"), so manifests written with zlib's CRC32 still verify. Without the package, new manifests fall
back to CRC32. The files of a step are verified by a few threads at once (reading overlaps summing), and on a
multi-host XLA run each host verifies only the files it reads (lit_gpt.xla.integrity).
"""

import json
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from lit_gpt.storage import is_url, location
from lit_gpt.utils import LitError

try:  # hardware CRC32C; without it new manifests record zlib's CRC32
    import google_crc32c
except ImportError:  # pragma: no cover (a requirement; an environment may still lack it)
    google_crc32c = None

MANIFEST = "lit_checkpoint.json"
STEP_FORMAT = "lit-gpt-step"
VERIFY_THREADS = 4  # files checked at once: reading one overlaps summing another (and a bucket's latency)
_BLOCK = 2 << 20  # read per file at a time: the threads hold 8 MiB in all (consolidation's peak memory counts it)
# a file's checksum key -> (how a block extends the running value, the name in messages)
ALGORITHMS = {"crc32c": (lambda data, crc: google_crc32c.extend(crc, data), "CRC32C"),
              "crc32": (lambda data, crc: zlib.crc32(data, crc), "CRC32")}


def default_algorithm() -> str:
    return "crc32c" if google_crc32c is not None else "crc32"

PathLike = Union[str, Path]


def file_checksum(path: PathLike, algorithm: Optional[str] = None) -> Dict[str, Any]:
    """{"size", ALGORITHM} of a file (`algorithm`: "crc32c", the default with google-crc32c installed, or "crc32"),
    read in 2 MiB blocks (memory: one block)."""
    algorithm = algorithm or default_algorithm()
    if algorithm == "crc32c" and google_crc32c is None:
        raise LitError(f"{str(path)!r} was recorded with a CRC32C checksum: pip install google-crc32c to verify it")
    update = ALGORITHMS[algorithm][0]
    crc = 0
    size = 0
    path = location(path)
    with (path.open("rb", buffering=0) if not is_url(path) else path.open("rb")) as f:
        while True:
            data = f.read(_BLOCK)
            if not data:
                break
            crc = update(data, crc)
            size += len(data)
    return {"size": size, algorithm: f"{crc:08x}"}


def checksums(folder: Path, names: Optional[Iterable[str]] = None) -> Dict[str, Dict[str, Any]]:
    """The checksum of every file under the local `folder` (relative names; or just `names`), the manifest aside."""
    folder = Path(folder)
    if names is None:
        names = sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file())
    return {name: file_checksum(folder / name) for name in names if name != MANIFEST}


def write_json_synced(path: PathLike, obj: Any) -> None:
    """A small JSON file, on disk before this returns (fsync); in a bucket an object is whole or absent."""
    path = location(path)
    if is_url(path):
        path.write_text(json.dumps(obj, indent=1), encoding="utf-8")
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(folder: Path, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write `folder/lit_checkpoint.json` recording every file already in the local `folder`: call it after all of
    them are written and before the folder is committed (renamed, or uploaded with the manifest last)."""
    manifest = {"format": STEP_FORMAT, "version": 1, "saved_at": time.time(), "checksums": checksums(folder),
                **(extra or {})}
    write_json_synced(Path(folder) / MANIFEST, manifest)
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# reading: what is wrong with a step, in one line
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class StepProblem:
    kind: str
    """"incomplete" (its save did not finish: no readable manifest) or "damaged" (a recorded file differs)."""
    detail: str
    """What is wrong, naming the file: "checkpoint.pth has 1024 bytes, 4096 recorded at save time"."""
    name: str = ""
    """The file that is missing or differs ("" when the problem is not one file's)."""
    difference: str = ""
    """How it differs: "1024 bytes instead of 4096", "CRC32C 0a1b2c3d instead of 4e5f6a7b" ("" when missing)."""

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})"


def read_manifest(step: PathLike) -> Tuple[Optional[Dict[str, Any]], Optional[StepProblem]]:
    """(manifest, None), (None, None) when the folder has none, or (None, problem) when it is unreadable."""
    path = location(step) / MANIFEST
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("checksums", {}), dict):
            raise ValueError("not a manifest")
    except (OSError, ValueError) as e:
        return None, StepProblem("incomplete", f"{MANIFEST} is unreadable ({type(e).__name__}): its save was cut off")
    return data, None


def verify_checksums(step: PathLike, recorded: Dict[str, Dict[str, Any]], names: Optional[Iterable[str]] = None
                     ) -> Optional[StepProblem]:
    """The first recorded file (of `names`, or all, in that order) that is missing or differs from what was
    recorded, or None. Each file is summed with the algorithm its entry names (CRC32C, or an older CRC32)."""
    step = location(step)
    names = [n for n in (sorted(recorded) if names is None else names) if recorded.get(n) is not None]
    if len(names) <= 1:
        return next((p for p in (_file_problem(step, n, recorded[n]) for n in names) if p is not None), None)
    with ThreadPoolExecutor(min(VERIFY_THREADS, len(names))) as pool:
        futures = [pool.submit(_file_problem, step, n, recorded[n]) for n in names]
        for future in futures:
            problem = future.result()
            if problem is not None:
                for other in futures:
                    other.cancel()  # the first damaged file is the answer: the rest need not be read
                return problem
    return None


def _file_problem(step: Any, name: str, expected: Dict[str, Any]) -> Optional[StepProblem]:
    f = step / name
    if not f.is_file():
        return StepProblem("damaged", f"{name} is missing", name)
    algorithm = "crc32c" if "crc32c" in expected else "crc32"
    actual = file_checksum(f, algorithm)
    label = ALGORITHMS[algorithm][1]
    for key, unit in (("size", "bytes"), (algorithm, "")):
        if actual[key] != expected.get(key):
            a, e = (f"{actual[key]} {unit}", expected[key]) if unit else (f"{label} {actual[key]}", expected[key])
            return StepProblem("damaged", f"{name} has {a}, {e} recorded at save time", name, f"{a} instead of {e}")
    return None


def step_problem(step: PathLike, required: str) -> Optional[StepProblem]:
    """What keeps the step folder `step` (of a CPU/CUDA run, whose weights are the file `required`) from being
    resumed: None when its manifest is there and every file matches it. A local folder of an earlier version
    (no manifest; committed by a rename) is whole if `required` is there; in a bucket the manifest is the commit."""
    step = location(step)
    manifest, problem = read_manifest(step)
    if problem is not None:
        return problem
    if manifest is None:
        if not is_url(step) and (step / required).is_file():
            return None  # an earlier version's step: renamed into place when complete
        return StepProblem("incomplete", f"no {MANIFEST}: its save was interrupted")
    return verify_checksums(step, manifest.get("checksums") or {})


def newest_intact(steps: List[Tuple[int, Path]], problem_of: Callable[[Path], Optional[StepProblem]],
                  out_dir: PathLike) -> Optional[Path]:
    """The newest of `steps` ((number, folder) pairs) that `problem_of` finds whole, checked newest first. Steps
    skipped on the way are named in one line on stderr with the step resumed from; when none is whole but one is
    damaged, a LitError (starting over would silently overwrite a run that may be recoverable); when all are
    incomplete (cut off in their first save), None with one line: the run starts fresh."""
    skipped: List[str] = []
    damaged = False
    for _, folder in sorted(steps, key=lambda s: s[0], reverse=True):
        problem = problem_of(folder)
        if problem is None:
            if skipped:
                note(f"{'; '.join(skipped)}: resuming from {folder.name}, the newest intact step")
            return folder
        damaged = damaged or problem.kind == "damaged"
        skipped.append(f"{folder.name} is {problem}")
    if damaged:
        raise LitError(
            f"no intact step checkpoint in {str(out_dir)!r}: {'; '.join(skipped)}. Restore the damaged files, or"
            " start over in a new --out_dir"
        )
    if skipped:
        note(f"{'; '.join(skipped)}: no complete step to resume from, starting fresh")
    return None


def note(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
