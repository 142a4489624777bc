"""What makes a sharded checkpoint directory trustworthy, and which one to resume from: its completion marker,
the CRC32C (CRC32 in earlier versions' markers) of every file recorded at save time, the checks that refuse an
incomplete or damaged directory in one line, and the choice of the newest complete checkpoint (agreed by every
host for `--resume auto`).

    verify_files(path)                               sizes and CRC32Cs against the marker (lit_gpt.manifest)
    marker, md = check_complete(path)                marker readable, every host's files present and long enough
    latest_checkpoint(out_dir, "step-*")             newest complete checkpoint on this host
    agreed_latest_checkpoint(out_dir, "step-*")      the newest every host holds (communicates, if a group exists)

The files are written by `lit_gpt.xla.checkpoint.save_sharded`; its docstring describes the layout.
"""

import contextlib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch.distributed as dist

from lit_gpt.manifest import StepProblem, file_checksum, newest_intact, verify_checksums  # noqa: F401
from lit_gpt.storage import is_url, location
from lit_gpt.utils import LitError, error_reason

MARKER = "lit_checkpoint.json"
FORMAT = "lit-gpt-xla-sharded"
FORMAT_VERSION = 1
META_KEY = "__lit_meta__"  # host 0's plain values and RNG states; host r > 0 stores its own under META_KEY + "r"
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_VERIFIED: set = set()  # (folder, saved_at) of checkpoints whose every file this process verified

PathLike = Union[str, Path]


def _meta_key(rank: int) -> str:
    return META_KEY if rank == 0 else f"{META_KEY}{rank}"


# ---------------------------------------------------------------------------------------------------------------
# hosts: checkpoints are saved and loaded inside multi-host runs (a process group from Fabric or from plain
# torch.distributed) and also without any group (one host; consolidation on any machine), where torch.distributed's
# collectives refuse to run. So each collective is called only when a group of several processes exists.
# ---------------------------------------------------------------------------------------------------------------
def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _all_gather(obj: Any) -> List[Any]:
    """`obj` of every process (rank order); `[obj]` without a process group."""
    if _rank_world()[1] == 1:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    """Host 0's `obj` on every host."""
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------------------------------
# DCP access, checksums, completeness
# ---------------------------------------------------------------------------------------------------------------
def _reader(path: Path) -> Any:
    """DCP's reader for a local folder, or its fsspec-backed one for a URL (a bucket)."""
    import torch.distributed.checkpoint as dcp

    if is_url(path):
        # torch 2.9 keeps DCP's fsspec storage in this module only (earlier versions: the public
        # torch.distributed.checkpoint.fsspec); `dcp.load(checkpoint_id=URL)` picks the same class by itself, but
        # reading the index alone needs the instance
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(path))
    return dcp.FileSystemReader(str(path))


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Silence warnings about DCP's and torch_xla's own internals that a user can do nothing about."""
    with warnings.catch_warnings():
        for message in (
            r"The function definition for SavePlanner.set_up_planner",
            r"The function definition for LoadPlanner.set_up_planner",
            r"TypedStorage is deprecated",
            r"Using a non-tuple sequence for multidimensional indexing",
            r"torch.distributed is disabled, unavailable or uninitialized",
        ):
            warnings.filterwarnings("ignore", message=message)
        yield


def verify_files(path: PathLike, names: Optional[List[str]] = None, marker: Optional[Dict[str, Any]] = None) -> None:
    """Check files of a sharded checkpoint against the sizes and CRC32s its marker recorded at save time (all of
    them, or `names`); raise a one-line LitError naming the first damaged one. Checkpoints written before
    checksums were recorded pass unchecked."""
    path = location(path)
    marker = read_marker(path) if marker is None else marker
    recorded: Dict[str, Dict[str, Any]] = marker.get("checksums") or {}
    problem = verify_checksums(path, recorded, sorted(recorded) if names is None else names)
    if problem is not None:
        f = path / problem.name
        if not problem.difference:
            raise LitError(f"sharded checkpoint file {str(f)!r} is missing: copy it from the host that wrote it")
        raise LitError(
            f"sharded checkpoint file {str(f)!r} is damaged ({problem.difference} recorded at save time): copy it"
            " again from the host that wrote it, or use an earlier checkpoint"
        )


def read_marker(path: PathLike) -> Dict[str, Any]:
    path = location(path)
    marker = path / MARKER
    if not path.is_dir():
        raise LitError(
            f"sharded checkpoint {str(path)!r} does not exist (expected a directory written by save_sharded)"
        )
    if not marker.is_file():
        if any(path.glob("*.distcp")) or (path / ".metadata").exists():
            raise LitError(
                f"{str(path)!r} is an incomplete checkpoint (no {MARKER}: its save was interrupted). Use an earlier"
                " checkpoint (latest_checkpoint / --resume auto skips incomplete ones)"
            )
        raise LitError(f"{str(path)!r} is not a sharded checkpoint directory (no {MARKER})")
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LitError(
            f"cannot read {str(marker)!r} ({error_reason(e)}): the checkpoint is damaged, use an earlier one"
        ) from e
    if data.get("format") == "lit-gpt-step":
        raise LitError(f"{str(path)!r} is a step of a CPU/CUDA run (finetune/*.py): resume it with that recipe")
    if data.get("format") != FORMAT:
        raise LitError(f"{str(marker)!r} is not a {FORMAT} marker")
    return data


def check_complete(path: PathLike, ranks: Optional[List[str]] = None) -> Tuple[Dict[str, Any], Any]:
    """Marker present, DCP metadata readable, every host's shard files (or those of the hosts `ranks`, e.g. ["1"]
    for host 1 reading its own local disk) present and long enough.

    Returns (marker, DCP metadata). The error names the missing host (rank) files."""
    path = location(path)
    marker = read_marker(path)
    if not (path / ".metadata").is_file():
        raise LitError(f"{str(path)!r} has a marker but no .metadata file: copy host 0's files into it")
    try:
        md = _reader(path).read_metadata()
    except Exception as e:  # a truncated pickle raises anything from EOFError to UnpicklingError
        name = str(path / ".metadata")
        raise LitError(f"cannot read {name!r} ({type(e).__name__}): the checkpoint is damaged") from e
    needed: Dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing: Dict[str, List[str]] = {}
    short: List[str] = []
    for name, size in sorted(needed.items()):
        f = path / name
        m = _RANK_FILE.match(name)
        rank = m.group(1) if m else "?"
        if ranks is not None and rank not in ranks:
            continue
        if not f.is_file():
            missing.setdefault(rank, []).append(name)
        elif f.stat().st_size < size:
            short.append(f"{name} ({f.stat().st_size} of {size} bytes)")
    if missing:
        hosts = "; ".join(f"host/rank {r}: {', '.join(v)}" for r, v in sorted(missing.items()))
        raise LitError(
            f"sharded checkpoint {str(path)!r} is missing the files of {hosts}. Each host writes its own shards:"
            " copy every host's __RANK_*.distcp files into this directory (or save to a shared disk)"
        )
    if short:
        raise LitError(f"sharded checkpoint {str(path)!r} has truncated files: {', '.join(short)}. Copy them again")
    return marker, md


def is_complete(path: PathLike) -> bool:
    try:
        check_complete(path)
    except LitError:
        return False
    return True


def step_problem(path: PathLike) -> Optional[StepProblem]:
    """Why the sharded checkpoint `path` cannot be resumed on this host alone (incomplete: no readable marker, its
    save was cut off; damaged: a file missing, short, or with another CRC32 than recorded), or None when whole."""
    path = location(path)
    if not (path / MARKER).is_file():
        return StepProblem("incomplete", f"no {MARKER}: its save was interrupted")
    try:
        marker = read_marker(path)
    except LitError as e:
        if str(e).startswith("cannot read"):
            return StepProblem("incomplete", f"{MARKER} is unreadable: its save was cut off")
        return StepProblem("damaged", _first_clause(e))
    try:
        _check_and_verify_all(path)
    except LitError as e:
        # another host's shards absent (per-host disks, or not copied yet) is not damage: this host cannot use it
        kind = "incomplete" if "missing the files of host" in str(e) else "damaged"
        return StepProblem(kind, _first_clause(e))
    _VERIFIED.add((str(path), marker.get("saved_at")))
    return None


def _first_clause(e: LitError) -> str:
    return str(e).split(": ", 1)[0] if str(e).count(": ") else str(e)


def latest_checkpoint(out_dir: PathLike, pattern: str = "*") -> Optional[Path]:
    """The newest whole sharded checkpoint directly under `out_dir` (highest trailing number in the name), every
    file verified against its marker, or None. Newer ones that are incomplete (interrupted saves; hidden
    `.NAME.tmp-*` folders are never considered) or damaged are skipped with one line on stderr naming them and the
    checkpoint taken instead; when none is whole but one is damaged, a LitError (see `newest_intact`)."""
    out_dir = location(out_dir)
    if not out_dir.is_dir():
        return None
    candidates = [(_step_of(d), d) for d in out_dir.glob(pattern) if not d.name.startswith(".") and d.is_dir()
                  and any(d.iterdir())]
    return newest_intact(candidates, step_problem, out_dir)


def _step_of(path: Path) -> int:
    m = re.search(r"(\d+)$", path.name)
    return int(m.group(1)) if m else -1


def needed_files(marker: Dict[str, Any], md: Any, rank: int, world: int) -> List[str]:
    """The files host `rank` of `world` reads to load a checkpoint: its own shards, and the files holding whatever
    every host needs (unsharded tensors, which DCP writes once, in one host's file; host 0's values). With another
    host count than at save time, any shard may be needed: all files."""
    files: Dict[str, List[str]] = marker.get("files", {})
    if marker.get("hosts") != world:
        return sorted({n for v in files.values() for n in v})
    needed = set(files.get(str(rank), []))
    own_meta = _meta_key(rank)
    has_own_meta = any(index.fqn == own_meta for index in md.storage_data)
    sizes = {fqn: tuple(t.size) for fqn, t in md.state_dict_metadata.items() if hasattr(t, "size")}
    for index, info in md.storage_data.items():
        if index.fqn.startswith(META_KEY):
            if index.fqn == own_meta or (index.fqn == META_KEY and not has_own_meta):
                needed.add(info.relative_path)
            continue
        size = sizes.get(index.fqn)
        chunk = next((c for c in getattr(md.state_dict_metadata.get(index.fqn), "chunks", [])
                      if tuple(c.offsets) == tuple(index.offset or ())), None)
        if size is None or chunk is None or tuple(chunk.sizes) == size:
            needed.add(info.relative_path)  # unsharded (or not a tensor): every host reads it
    return sorted(needed)


def _held_here(path: Path, rank: int, world: int) -> Optional[str]:
    """Why this host cannot load checkpoint `path` from its own disk (None: it can): the marker must be readable,
    the index present, and this host's own shard files present at their recorded sizes (all hosts' files when
    the checkpoint was saved by another number of hosts, which reshards)."""
    try:
        marker = read_marker(path)
    except LitError as e:
        return str(e)
    if not (path / ".metadata").is_file():
        return "no .metadata"
    try:
        md = _reader(path).read_metadata()
    except Exception as e:  # a damaged index raises anything from EOFError to UnpicklingError
        return f".metadata unreadable ({type(e).__name__})"
    sizes = marker.get("checksums") or {}
    missing = []
    for name in needed_files(marker, md, rank, world):
        f = path / name
        if not f.is_file():
            missing.append(name)
        elif name in sizes and f.stat().st_size != sizes[name]["size"]:
            return f"{name} has {f.stat().st_size} of {sizes[name]['size']} bytes"
    if missing:
        return f"missing {_few(missing)}"
    return None


def _damaged_here(path: Path, rank: int, world: int) -> Optional[str]:
    """What differs from the recorded CRC32s among the files this host reads of checkpoint `path`, or None."""
    marker = read_marker(path)
    if (str(path), marker.get("saved_at")) in _VERIFIED:
        return None
    md = _reader(path).read_metadata()
    problem = verify_checksums(path, marker.get("checksums") or {}, needed_files(marker, md, rank, world) + [".metadata"])
    return None if problem is None else f"{problem.kind}: {problem.detail}"


def agreed_latest_checkpoint(out_dir: PathLike, pattern: str = "*") -> Optional[Path]:
    """The newest checkpoint under `out_dir` that every host can load, the same on all hosts: what `--resume auto`
    resumes from. Call it on every host at the same point (it communicates when a process group is initialized;
    without one it is `latest_checkpoint`).

    Each host lists the checkpoints it holds (marker readable, `.metadata` present, its own shard files present at
    their recorded sizes: a per-host local disk suffices); host 0 picks the newest one that every host holds and
    tells the others. When a newer checkpoint is missing on some host (a save killed between host 0's rename and
    the others', or files lost on one disk), all hosts fall back to the newest common one, and host 0 says on
    stderr which one was skipped and why: a checkpoint is complete only when every host has it, and resuming
    from an earlier complete step is exact. When no checkpoint is held by every host although some host holds
    one, all hosts raise the same LitError naming, for host 0's newest, the hosts and files that are missing:
    starting fresh would silently throw that run away. Returns None when no host holds any checkpoint."""
    rank, world = _rank_world()
    out_dir = location(out_dir)
    if world == 1:
        return latest_checkpoint(out_dir, pattern)
    held: Dict[str, Tuple[int, float]] = {}
    why_not: Dict[str, str] = {}
    if out_dir.is_dir():
        for d in out_dir.glob(pattern):
            if d.name.startswith(".") or not d.is_dir():
                continue
            reason = _held_here(d, rank, world)
            if reason is None:
                held[d.name] = (_step_of(d), float(read_marker(d).get("saved_at", 0.0)))
            else:
                why_not[d.name] = reason
    reports = _all_gather((held, why_not))
    while True:
        decision: Any = _agree(out_dir, reports) if rank == 0 else None
        decision = _broadcast(decision)
        if decision[0] == "error" or decision[1] is None:
            break
        # the chosen step is held at its recorded sizes everywhere: now its bytes, on every host (a damaged file
        # makes all hosts fall back to the next one that every host holds whole)
        problems = _all_gather(_damaged_here(out_dir / decision[1], rank, world))
        if not any(problems):
            break
        for r, problem in enumerate(problems):
            if problem:
                reports[r][0].pop(decision[1], None)
                reports[r][1][decision[1]] = problem
    kind, value, note = decision
    if note and rank == 0:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    if kind == "error":
        raise LitError(value)
    return None if value is None else out_dir / value


def _agree(out_dir: Path, reports: List[Tuple[Dict[str, Tuple[int, float]], Dict[str, str]]]) -> Tuple[str, Any, str]:
    """Host 0's decision from every host's (held, why not) report: ("ok", name or None, note) or ("error", msg, "")."""
    def newest(names: Any) -> Optional[str]:
        ranked = [(reports[0][0].get(n) or next(r[0][n] for r in reports if n in r[0]), n) for n in names]
        return max(ranked)[1] if ranked else None

    anywhere = set().union(*(set(held) for held, _ in reports))
    if not anywhere:
        return ("ok", None, "")
    common = set.intersection(*(set(held) for held, _ in reports))
    newest_anywhere = newest(anywhere)
    chosen = newest(common)

    def missing(name: str) -> str:
        parts = []
        for r, (held, why_not) in enumerate(reports):
            if name not in held:
                parts.append(f"host {r} ({why_not.get(name, 'no such directory')})")
        return "; ".join(parts)

    if chosen is None:
        return (
            "error",
            f"no checkpoint in {str(out_dir)!r} is held by every host: the newest, {newest_anywhere}, is missing on"
            f" {missing(newest_anywhere)}. Copy the missing files to those hosts, or start over in a new --out_dir",
            "",
        )
    note = ""
    if chosen != newest_anywhere:
        note = (
            f"resuming from {chosen}, the newest checkpoint every host holds: {newest_anywhere} is missing on"
            f" {missing(newest_anywhere)}"
        )
    return ("ok", chosen, note)


def _check_and_verify_all(path: Path) -> Tuple[Dict[str, Any], Any]:
    """Every file present (missing ones named by host) and equal to what was saved (CRC32): the index first, so a
    damaged one is reported as such rather than as whatever unpickling it raises."""
    marker = read_marker(path)
    if (path / ".metadata").is_file():
        verify_files(path, [".metadata"], marker)
    marker, md = check_complete(path)
    verify_files(path, None, marker)
    return marker, md


def _check_and_verify_for_load(path: Path) -> Tuple[Dict[str, Any], Any]:
    """`check_complete` and `verify_files` for the files this process will read, with every process agreeing on
    the outcome: one host that finds a damaged file makes all of them fail with its line, instead of the others
    waiting forever for it in the collective load.

    A host reads its own rank's shards when the checkpoint was saved by as many hosts as there are now (so a
    per-host local disk suffices); with another host count any shard may be needed, so all are checked."""
    rank, world = _rank_world()
    outcome: Any = None
    try:
        marker = read_marker(path)
        if world == 1 and (str(path), marker.get("saved_at")) in _VERIFIED:
            marker, md = check_complete(path)  # verified by --resume auto's choice just before
        elif world == 1:
            marker, md = _check_and_verify_all(path)
        else:
            # the files this host reads must be here (on a per-host local disk the others' may be elsewhere)
            if not (path / ".metadata").is_file():
                raise LitError(f"{str(path)!r} has a marker but no .metadata file: copy host 0's files into it")
            verify_files(path, [".metadata"], marker)
            try:
                md = _reader(path).read_metadata()
            except Exception as e:  # a truncated pickle raises anything from EOFError to UnpicklingError
                raise LitError(f"cannot read {str(path / '.metadata')!r} ({type(e).__name__}): it is damaged") from e
            names = needed_files(marker, md, rank, world) + [".metadata"]
            absent = [n for n in names if not (path / n).is_file()]
            if absent:
                raise LitError(
                    f"sharded checkpoint {str(path)!r} lacks {_few(absent)}, which this host reads: copy them from"
                    " the hosts that wrote them (or save to a shared directory)"
                )
            verify_files(path, names, marker)
    except LitError as e:
        outcome = f"host {rank}: {e}" if world > 1 else str(e)
    failures = [o for o in _all_gather(outcome) if o is not None]
    if failures:
        raise LitError(failures[0])
    return marker, md


def _few(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
