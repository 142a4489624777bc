"""Sharded checkpoints, written per host with torch.distributed.checkpoint (DCP), and their consolidation.

    save_sharded(path, {"model": model, "optimizer": optimizer, "step": 100, "data_pos": 1234})
    remainder = load_sharded(path, {"model": model, "optimizer": optimizer, "step": 0, "data_pos": 0})
    path = latest_checkpoint(out_dir)        # newest *complete* checkpoint in this folder
    path = agreed_latest_checkpoint(out_dir, "step-*")  # the same, agreed by every host: for `--resume auto`
    consolidate(path, "lit_model.pth")       # one plain file, needs neither torch_xla nor the devices

Layout of a checkpoint directory:
  __{rank}_{i}.distcp   the shards that process (host) `rank` holds, written by that host only (SPMDSavePlanner)
  .metadata             DCP's index: every tensor's global shape and where each chunk lives
  lit_checkpoint.json   completion marker, written last: format, hosts, files per host, tied names, and the size
                        and CRC32 of every file. A directory without it is an interrupted save and every loader
                        here refuses it.

Integrity: every host checksums (CRC32, streamed) the files it wrote before the marker is written; `load_sharded`
and the consolidators check the files they read against the marker first and refuse a damaged one, naming it (a
flipped bit inside a tensor would otherwise load as a wrong number: torch.load does not check the shards' zip CRCs).

Atomicity: everything is written into a hidden sibling `.NAME.tmp-TOKEN`, the marker last, then renamed to NAME,
so a process killed mid-save leaves the previous checkpoint as it was and no directory that looks valid.
Multi-host: with a shared directory (NFS, Filestore, gcsfuse) all hosts write into the same temporary directory
and host 0 renames it; with per-host local disks each host renames its own directory, which holds its own shards
plus a copy of the marker and `.metadata`: each host can then resume from its own disk (`load_sharded` reads the
files of its own rank), and `agreed_latest_checkpoint` makes all hosts resume from the same step. To consolidate,
copy the other hosts' `__{rank}_*.distcp` files into one directory first (`consolidate` names any that are missing).

What is stored: modules as plain lit names (FSDP wrappers' `_orig_module.` removed; a tied parameter once, its
aliases listed in the marker), optimizers' tensors sharded like their parameters, and everything else (step, data
position, optimizer hyperparameters, RNG states) as one small pickled entry written by host 0.
Loading onto another number of devices works: DCP reads, for every local shard, the chunks that overlap it.

This module imports torch_xla only when it is used with XLA tensors, so `consolidate` runs on any machine.
"""

import contextlib
import io
import json
import mmap
import os
import random
import re
import shutil
import time
import uuid
import struct
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.imports import RequirementCache
from torch.optim import Optimizer

from lit_gpt.state import as_tuple
from lit_gpt.storage import is_url, location, remove, staging_dir, write_into
from lit_gpt.utils import LitError, error_reason, remove_stale_temp_files, write_failure

MARKER = "lit_checkpoint.json"
FORMAT = "lit-gpt-xla-sharded"
FORMAT_VERSION = 1
META_KEY = "__lit_meta__"  # host 0's plain values and RNG states; host r > 0 stores its own under META_KEY + "r"
_WRAPPER_PREFIXES = ("_orig_module.", "_forward_module.", "_checkpoint_wrapped_module.")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_XLA_AVAILABLE = RequirementCache("torch_xla")

PathLike = Union[str, Path]
# DCP's writers stage tensors through a device-stream loader when CUDA or a custom device module is present; torchax
# (which torch_xla's scan imports) registers one without streams, and the save fails (AttributeError
# 'current_stream'). No copy-ahead selects DCP's serial loader, which XLA and CPU tensors need anyway.
_COPY_AHEAD = 0


# ---------------------------------------------------------------------------------------------------------------
# names and state
# ---------------------------------------------------------------------------------------------------------------
def plain_name(name: str) -> str:
    """`transformer.h.0._orig_module.attn.qkv.weight` -> `transformer.h.0.attn.qkv.weight` (wrappers add levels)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def module_state_dict(
    module: nn.Module, filter: Optional[Callable[[str, torch.Tensor], bool]] = None
) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The module's tensors under plain lit names, each tensor once.

    Returns (state, aliases): `state` maps a canonical name to the live tensor (so loading into it is in place),
    `aliases` maps every other name of a tied tensor to its canonical name (`lm_head.weight` ->
    `transformer.wte.weight`). The canonical name is the one a GPT state dict cannot do without (the embedding)."""
    groups: Dict[int, List[str]] = {}
    raw_names: Dict[int, List[str]] = {}
    tensors: Dict[int, torch.Tensor] = {}
    for raw, t in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(plain_name(raw))
        raw_names.setdefault(id(t), []).append(raw)
        tensors[id(t)] = t
    state: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    for key, names in groups.items():
        # GPT ties lm_head.weight to transformer.wte.weight and its loader restores the head from the embedding
        canonical = next((n for n in names if not n.startswith("lm_head.")), names[0])
        t = tensors[key].detach()
        # a filter may have been built from the wrapped model's names (`_orig_module.`): accept either spelling
        if filter is not None and not any(filter(n, t) for n in names + raw_names[key]):
            continue
        state[canonical] = t
        for n in names:
            if n != canonical:
                aliases[n] = canonical
    return state, aliases


def _to_cpu(data: Any) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.detach().cpu())


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if _xla_in_use():
        import torch_xla.core.xla_model as xm

        state["xla"] = int(xm.get_rng_state())
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(as_tuple(state["python"]))
    if "xla" in state and _xla_in_use():
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla"]))


def _xla_in_use() -> bool:
    if not _XLA_AVAILABLE:
        return False
    import sys

    # only when the program already uses torch_xla: importing it here would start a runtime for nothing
    return "torch_xla" in sys.modules and bool(os.environ.get("PJRT_DEVICE"))


def _is_spmd() -> bool:
    if not _xla_in_use():
        return False
    import torch_xla.runtime as xr

    return xr.is_spmd()


def _xla_sync() -> None:
    if _xla_in_use():
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()


def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _meta_key(rank: int) -> str:
    return META_KEY if rank == 0 else f"{META_KEY}{rank}"


def _all_gather(obj: Any) -> List[Any]:
    """`obj` of every process (rank order); `[obj]` without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _broadcast(obj: Any) -> Any:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


# ---------------------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------------------
def _split_state(
    state: Mapping[str, Any], filter: Optional[Mapping[str, Callable[[str, Any], bool]]]
) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """Tensors for DCP (sharded, per host), a small picklable `meta` (host 0) and the marker's description."""
    filter = filter or {}
    tensors: Dict[str, Any] = {}
    meta: Dict[str, Any] = {"values": {}, "optimizers": {}}
    described: Dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            sd, aliases = module_state_dict(obj, filter.get(key))
            tensors[key] = sd
            described[key] = {"kind": "module", "tensors": len(sd), "tied": aliases}
        elif isinstance(obj, Optimizer):
            osd = obj.state_dict()
            opt_tensors: Dict[str, Dict[str, torch.Tensor]] = {}
            extra: Dict[str, Dict[str, Any]] = {}
            for pid, pstate in osd["state"].items():
                for name, value in pstate.items():
                    if isinstance(value, torch.Tensor):
                        opt_tensors.setdefault(str(pid), {})[name] = value
                    else:
                        extra.setdefault(str(pid), {})[name] = value
            tensors[key] = opt_tensors
            meta["optimizers"][key] = {"param_groups": osd["param_groups"], "extra": extra}
            described[key] = {"kind": "optimizer"}
        else:
            if key in filter and isinstance(obj, dict):
                obj = {k: v for k, v in obj.items() if filter[key](k, v)}
            meta["values"][key] = _to_cpu(obj)
            described[key] = {"kind": "value"}
    meta["rng"] = _rng_state()
    return tensors, meta, described


def save_sharded(
    path: PathLike,
    state: Mapping[str, Any],
    filter: Optional[Mapping[str, Callable[[str, Any], bool]]] = None,
    write_files: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Save `state` (modules, optimizers, plain values) as a sharded checkpoint directory `path`, atomically.
    `write_files(folder)` (host 0) adds files of the caller's (configs, tokenizer) before the commit.

    Call it on every host at the same point. Each host writes only the shards it holds. `filter` works like
    `fabric.save(..., filter=...)`: `{"model": lambda name, tensor: tensor.requires_grad}` saves the trainable
    (adapter) tensors only. The RNG states (torch, python, XLA) are saved too and restored by `load_sharded`."""
    import torch.distributed.checkpoint as dcp

    path = location(path)
    rank, world = _rank_world()
    _xla_sync()  # materialise pending lazy computations once, not per tensor while writing
    tensors, meta, described = _split_state(state, filter)
    # one opaque bytes entry: DCP would otherwise split the nested values into one item per leaf
    buf = io.BytesIO()
    torch.save(meta, buf)
    # per host: every host's own RNG states, in its own shard file (a per-host local disk then holds them)
    tensors[_meta_key(rank)] = buf.getvalue()

    if _is_spmd():
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        planner = SPMDSavePlanner()
    else:
        planner = None  # DCP's default planner: plain (CPU, or single-device XLA) tensors
    if is_url(path):
        return _save_in_bucket(path, tensors, described, planner, write_files)

    token = _broadcast(uuid.uuid4().hex[:8] if rank == 0 else None)
    tmp = path.parent / f".{path.name}.tmp-{token}"
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        # leftovers of an interrupted save of this same checkpoint: never valid, safe to clear
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    tmp.mkdir(parents=True, exist_ok=True)

    writer = dcp.FileSystemWriter(str(tmp), sync_files=True, per_thread_copy_ahead=_COPY_AHEAD)
    with _quiet_dcp():
        dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=world == 1)
    _barrier()

    # every host checksums what it wrote (its own shards; host 0 also the index), while the bytes are in its
    # page cache; a host that does not see host 0's index writes to its own local disk
    own = {f.name: f for f in tmp.glob(f"__{rank}_*.distcp")}
    if rank == 0 and (tmp / ".metadata").is_file():
        own[".metadata"] = tmp / ".metadata"
    local = {name: file_checksum(f) for name, f in sorted(own.items())}
    gathered = _all_gather((local, (tmp / ".metadata").is_file()))
    checksums: Dict[str, Dict[str, Any]] = {}
    for sums, _ in gathered:
        checksums.update(sums)
    local_disks = not all(sees_index for _, sees_index in gathered)

    marker = _marker(_reader(tmp).read_metadata(), checksums, described) if rank == 0 else None
    if local_disks:
        # the other hosts keep a copy of the marker and the index next to their own shards
        marker_and_index = _broadcast((marker, (tmp / ".metadata").read_bytes()) if rank == 0 else None)
    if rank == 0:
        if write_files is not None:
            write_files(tmp)  # inside before the commit: a complete checkpoint always has them
        _write_json_synced(tmp / MARKER, marker)
        _fsync_dir(tmp)
        _replace_dir(tmp, path, token)
    _barrier()
    if rank != 0 and tmp.exists():
        # per-host local disk: this host's shards go next to where host 0's checkpoint lives on the shared name
        if local_disks:
            marker, index = marker_and_index
            with open(tmp / ".metadata", "wb") as f:
                f.write(index)
                f.flush()
                os.fsync(f.fileno())
            _write_json_synced(tmp / MARKER, marker)
            _fsync_dir(tmp)
        _replace_dir(tmp, path, token)
    _barrier()
    return path


def _marker(md: Any, checksums: Dict[str, Dict[str, Any]], described: Dict[str, Any]) -> Dict[str, Any]:
    """The completion marker's content: format, hosts, files per host, checksums, what each state entry is."""
    files: Dict[str, set] = {}
    for info in md.storage_data.values():
        m = _RANK_FILE.match(info.relative_path)
        files.setdefault(m.group(1) if m else "0", set()).add(info.relative_path)
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "saved_at": time.time(),
        "hosts": _rank_world()[1],
        "devices": _device_count(),
        "files": {r: sorted(v) for r, v in sorted(files.items(), key=lambda kv: int(kv[0]))},
        "checksums": checksums,
        "state": described,
    }


def _save_in_bucket(
    path: Path, tensors: Dict[str, Any], described: Dict[str, Any], planner: Any,
    write_files: Optional[Callable[[Path], None]],
) -> Path:
    """`save_sharded` into a URL (a bucket every host sees): no renames there, so every host writes its shards in
    place through DCP's fsspec writer, each checksums what landed (read back: what the bucket holds is what is
    verified), and host 0 writes the caller's files and then the marker, last: the marker is the commit. An
    earlier version of the same checkpoint loses its marker first, so it never looks complete half-replaced."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    rank, world = _rank_world()
    if rank == 0:
        remove(path, first=[MARKER])
    _barrier()
    with _quiet_dcp():
        dcp.save(tensors, storage_writer=FsspecWriter(str(path), sync_files=False, per_thread_copy_ahead=_COPY_AHEAD), planner=planner,
                 no_dist=world == 1)
    _barrier()
    own = {f.name: f for f in path.iterdir() if re.match(rf"^__{rank}_\d+\.distcp$", f.name)}
    if rank == 0:
        own[".metadata"] = path / ".metadata"
    checksums: Dict[str, Dict[str, Any]] = {}
    for sums in _all_gather({name: file_checksum(f) for name, f in sorted(own.items())}):
        checksums.update(sums)
    if rank == 0:
        marker = _marker(_reader(path).read_metadata(), checksums, described)
        if write_files is not None:
            write_into(path, write_files)
        _write_json_synced(path / MARKER, marker)
    _barrier()
    return path


def _replace_dir(tmp: Path, path: Path, token: str) -> None:
    """Rename the complete temporary directory to `path`, moving an older `path` aside first and deleting it after."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{token}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# integrity
# ---------------------------------------------------------------------------------------------------------------
_CHECKSUM_BLOCK = 8 << 20


def file_checksum(path: PathLike) -> Dict[str, Any]:
    """{"size", "crc32"} of a file, read in 8 MiB blocks (memory: one block)."""
    crc = 0
    size = 0
    buf = bytearray(_CHECKSUM_BLOCK)
    view = memoryview(buf)
    path = location(path)
    with (path.open("rb", buffering=0) if not is_url(path) else path.open("rb")) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": f"{crc:08x}"}


def verify_files(path: PathLike, names: Optional[List[str]] = None, marker: Optional[Dict[str, Any]] = None) -> None:
    """Check files of a sharded checkpoint against the sizes and CRC32s its marker recorded at save time (all of
    them, or `names`); raise a one-line LitError naming the first damaged one. Checkpoints written before
    checksums were recorded pass unchecked."""
    path = location(path)
    marker = read_marker(path) if marker is None else marker
    recorded: Dict[str, Dict[str, Any]] = marker.get("checksums") or {}
    for name in sorted(recorded) if names is None else names:
        expected = recorded.get(name)
        if expected is None:
            continue
        f = path / name
        if not f.is_file():
            raise LitError(f"sharded checkpoint file {str(f)!r} is missing: copy it from the host that wrote it")
        actual = file_checksum(f)
        if actual != expected:
            what = (
                f"{actual['size']} bytes instead of {expected['size']}"
                if actual["size"] != expected["size"]
                else f"CRC32 {actual['crc32']} instead of {expected['crc32']}"
            )
            raise LitError(
                f"sharded checkpoint file {str(f)!r} is damaged ({what} recorded at save time): copy it again from"
                " the host that wrote it, or use an earlier checkpoint"
            )


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


def _reader(path: Path) -> Any:
    """DCP's reader for a local folder, or its fsspec-backed one for a URL (a bucket)."""
    import torch.distributed.checkpoint as dcp

    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(path))
    return dcp.FileSystemReader(str(path))


def _device_count() -> int:
    if _xla_in_use():
        import torch_xla.runtime as xr

        return xr.global_runtime_device_count()
    return 1


def _write_json_synced(path: Path, obj: Any) -> None:
    if is_url(path):  # an object: whole or absent once the write returns
        path.write_text(json.dumps(obj, indent=1), encoding="utf-8")
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    if is_url(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------
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


def latest_checkpoint(out_dir: PathLike, pattern: str = "*") -> Optional[Path]:
    """The newest complete sharded checkpoint directly under `out_dir` (highest trailing number in the name,
    then newest marker), or None. Interrupted saves (hidden `.NAME.tmp-*`, no marker) are never returned."""
    out_dir = location(out_dir)
    if not out_dir.is_dir():
        return None
    candidates = []
    for d in out_dir.glob(pattern):
        if d.name.startswith(".") or not d.is_dir() or not (d / MARKER).is_file():
            continue
        if not is_complete(d):
            continue
        m = re.search(r"(\d+)$", d.name)
        step = int(m.group(1)) if m else -1
        candidates.append((step, read_marker(d).get("saved_at", 0.0), d))
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c[0], c[1]))[2]


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
    decision: Any = None
    if rank == 0:
        decision = _agree(out_dir, reports)
    decision = _broadcast(decision)
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


# ---------------------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------------------
def prime_optimizer(optimizer: Optimizer) -> None:
    """Create an optimizer's state (DCP loads in place, so the tensors must exist) without changing parameters.

    torch_xla's `prime_optimizer` runs a real step with zero gradients, which still moves parameters under weight
    decay; here the step runs with lr=0 (and the original hyperparameters are put back)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params or all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    saved_grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
        if p.device.type == "xla":
            import torch_xla

            sharding = torch_xla._XLAC._get_xla_op_sharding(p)
            if sharding:
                torch_xla._XLAC._xla_mark_sharding(p.grad, sharding)
    with torch.no_grad():
        optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr
    for p, g in zip(params, saved_grads):
        p.grad = g
    _xla_sync()


def load_sharded(
    path: PathLike, state: Dict[str, Any], strict: bool = True, restore_rng: bool = True
) -> Dict[str, Any]:
    """Load a checkpoint written by `save_sharded` into `state` in place, on the current devices (any count).

    Modules and optimizers are restored in place; plain values in `state` are replaced by the saved ones (like
    `fabric.load`). Returns the saved plain values that `state` did not ask for. RNG states are restored.
    `strict=False` accepts modules whose tensors are only partly in the checkpoint (adapter-only saves).
    `restore_rng=False` leaves the RNG states alone."""
    import torch.distributed.checkpoint as dcp

    path = location(path)
    marker, md = _check_and_verify_for_load(path)
    saved = md.state_dict_metadata
    target: Dict[str, Any] = {}
    optimizers: Dict[str, Optimizer] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            live, _ = module_state_dict(obj)
            prefix = key + "."
            in_ckpt = {fqn[len(prefix) :] for fqn in saved if fqn.startswith(prefix)}
            if not in_ckpt and strict:
                raise LitError(f"checkpoint {str(path)!r} has no module {key!r}")
            missing = sorted(n for n in live if n not in in_ckpt)
            unexpected = sorted(n for n in in_ckpt if n not in live)
            if strict and (missing or unexpected):
                detail = []
                if missing:
                    detail.append(f"missing {_few(missing)}")
                if unexpected:
                    detail.append(f"unexpected {_few(unexpected)}")
                raise LitError(
                    f"checkpoint {str(path)!r} does not match {key!r} ({'; '.join(detail)}). Check the model"
                    " config, or load with strict=False for adapter-only checkpoints"
                )
            for n in in_ckpt & set(live):
                want, have = tuple(saved[prefix + n].size), tuple(live[n].shape)
                if want != have:
                    raise LitError(f"checkpoint tensor {key}.{n} has shape {want} but the model's is {have}")
            target[key] = {n: live[n] for n in live if n in in_ckpt}
        elif isinstance(obj, Optimizer):
            prime_optimizer(obj)
            optimizers[key] = obj
            osd = obj.state_dict()
            prefix = key + "."
            target[key] = {
                str(pid): {
                    n: v for n, v in pstate.items() if isinstance(v, torch.Tensor) and f"{prefix}{pid}.{n}" in saved
                }
                for pid, pstate in osd["state"].items()
            }
            if strict and not any(fqn.startswith(prefix) for fqn in saved) and osd["state"]:
                raise LitError(f"checkpoint {str(path)!r} has no optimizer state {key!r}")
    # this host's own entry (checkpoints of another host count, or older ones: host 0's)
    meta_key = _meta_key(_rank_world()[0]) if _meta_key(_rank_world()[0]) in saved else META_KEY
    target[meta_key] = b""  # replaced by DCP with the saved bytes

    if _is_spmd():
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        planner = SPMDLoadPlanner()
    else:
        planner = None
    with _quiet_dcp():
        dcp.load(target, storage_reader=_reader(path), planner=planner, no_dist=_rank_world()[1] == 1)
    meta = torch.load(io.BytesIO(target[meta_key]), map_location="cpu", weights_only=True)

    for key, opt in optimizers.items():
        saved_opt = meta["optimizers"].get(key)
        if saved_opt is None:
            if strict:
                raise LitError(f"checkpoint {str(path)!r} has no optimizer {key!r}")
            continue
        osd = opt.state_dict()
        merged: Dict[int, Dict[str, Any]] = {}
        for pid, pstate in osd["state"].items():
            merged[pid] = dict(target[key].get(str(pid), {}))
            merged[pid].update(saved_opt["extra"].get(str(pid), {}))
            for n, v in pstate.items():  # tensors the checkpoint did not have stay as primed
                merged[pid].setdefault(n, v)
        opt.load_state_dict({"state": merged, "param_groups": saved_opt["param_groups"]})

    values = meta["values"]
    for key, obj in list(state.items()):
        if isinstance(obj, (nn.Module, Optimizer)):
            continue
        if key in values:
            state[key] = values[key]
        elif strict:
            saved_values = ", ".join(sorted(values)) or "none"
            raise LitError(f"checkpoint {str(path)!r} has no entry {key!r} (saved: {saved_values})")
    if restore_rng:
        _set_rng_state(meta.get("rng", {}))
    _xla_sync()
    return {k: v for k, v in values.items() if k not in state}


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
        if world == 1:
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


# ---------------------------------------------------------------------------------------------------------------
# consolidation (plain torch: no torch_xla, no devices)
# ---------------------------------------------------------------------------------------------------------------
class _FileSlice(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open file: torch.load reads one DCP chunk from it
    without copying the chunk's bytes into a buffer first."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


def _chunks_by_tensor(md: Any, prefix: str) -> Dict[str, List[Tuple[Tuple[int, ...], Any]]]:
    chunks: Dict[str, List[Tuple[Tuple[int, ...], Any]]] = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith(prefix):
            chunks.setdefault(index.fqn, []).append((tuple(index.offset or ()), info))
    return chunks


class _ChunkReader:
    """Reads DCP chunks (each one a torch.save'd tensor at an offset of a `.distcp` file), keeping files open."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: Dict[str, Any] = {}

    def _file(self, info: Any) -> Any:
        f = self._files.get(info.relative_path)
        if f is None:
            f = self._files[info.relative_path] = (self.directory / info.relative_path).open("rb")
        return f

    def read(self, info: Any) -> torch.Tensor:
        return torch.load(_FileSlice(self._file(info), info.offset, info.length), map_location="cpu", weights_only=True)

    def raw_location(self, info: Any) -> Optional[Tuple[int, int, Tuple[int, ...], torch.dtype]]:
        """(file descriptor, absolute offset, shape, dtype) of a chunk whose bytes are stored as one plain
        contiguous record, so they can be copied file to file without passing through Python; else None."""
        if is_url(self.directory):  # no file descriptor to copy from: chunks are read and written
            return None
        f = self._file(info)
        window = _FileSlice(f, info.offset, info.length)
        with torch.serialization.skip_data():  # reads the pickled header only, not the data
            t = torch.load(window, map_location="cpu", weights_only=True)
        if t.storage_offset() != 0 or not t.is_contiguous():
            return None
        window.seek(0)
        with zipfile.ZipFile(window) as archive:
            records = [i for i in archive.infolist() if re.search(r"(^|/)data/\d+$", i.filename)]
        # one storage holding exactly this tensor's bytes (a view of a larger storage keeps the slow path)
        if len(records) != 1 or records[0].file_size != t.numel() * t.element_size() or records[0].compress_type:
            return None
        window.seek(0)
        # PyTorchFileReader names records without the archive's root folder
        offset = torch._C.PyTorchFileReader(window).get_record_offset(records[0].filename.split("/", 1)[1])
        return f.fileno(), info.offset + offset, tuple(t.shape), t.dtype

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def _numel(size: Tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _check_covered(directory: Path, fqn: str, covered: int, size: Tuple[int, ...]) -> None:
    if covered < _numel(size):
        raise LitError(f"sharded checkpoint {str(directory)!r} does not hold every chunk of {fqn}: it is damaged")


def _assemble(reader: _ChunkReader, tmd: Any, chunks: List[Tuple[Tuple[int, ...], Any]], fqn: str) -> torch.Tensor:
    """The full tensor from its chunks (memory: the tensor plus one chunk)."""
    size = tuple(tmd.size)
    dtype = tmd.properties.dtype
    if len(chunks) == 1:
        chunk = reader.read(chunks[0][1])
        if tuple(chunk.shape) == size:
            return chunk.to(dtype)  # unsharded: no second buffer
    full = torch.empty(size, dtype=dtype)
    covered = 0
    for offsets, info in chunks:
        chunk = reader.read(info)
        view = full
        for dim, (start, length) in enumerate(zip(offsets, chunk.shape)):
            view = view.narrow(dim, start, length)
        view.copy_(chunk)
        covered += chunk.numel()
        del chunk
    _check_covered(reader.directory, fqn, covered, size)
    return full


def iter_consolidated(checkpoint_dir: PathLike, key: str = "model") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (plain name, full CPU tensor) of module `key`, one tensor at a time (peak RAM ~ one tensor)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint_dir = location(checkpoint_dir)
    marker, md = _check_and_verify_all(checkpoint_dir)
    prefix = key + "."
    chunks = _chunks_by_tensor(md, prefix)
    reader = _ChunkReader(checkpoint_dir)
    try:
        for fqn, tmd in md.state_dict_metadata.items():
            if fqn.startswith(prefix) and isinstance(tmd, TensorStorageMetadata):
                yield fqn[len(prefix) :], _assemble(reader, tmd, chunks.get(fqn, []), fqn)
    finally:
        reader.close()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> bool:
    """Copy bytes between files inside the kernel (copy_file_range, what a plain file copy uses). False where the
    OS or filesystem cannot, before anything was written; the caller then reads and writes instead."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return False
    done = 0
    while done < nbytes:
        try:
            n = copy(src_fd, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
        except OSError:
            if done:
                raise
            return False
        if n == 0:
            if done:
                raise OSError(f"short copy: {done} of {nbytes} bytes")
            return False
        done += n
    return True


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_tensor(
    fd: int, base: int, reader: _ChunkReader, tmd: Any, chunks: List[Tuple[Tuple[int, ...], Any]], fqn: str
) -> None:
    """Write one tensor's bytes at `base`. Chunks that are whole rows (FSDPv2 sharding dim 0, the common case) go
    straight to their place in the file; others are assembled in memory first."""
    size = tuple(tmd.size)
    dtype = tmd.properties.dtype
    if len(size) >= 1 and all(all(o == 0 for o in offsets[1:]) for offsets, _ in chunks):
        row_bytes = _numel(size[1:]) * torch.empty((), dtype=dtype).element_size()
        covered = 0
        whole_rows = True
        for offsets, info in chunks:
            raw = reader.raw_location(info)
            if raw is not None and raw[3] == dtype and raw[2][1:] == size[1:]:
                src_fd, src_offset, shape, _ = raw
                nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
                if _copy_range(src_fd, src_offset, fd, base + offsets[0] * row_bytes, nbytes):
                    covered += _numel(shape)
                    continue
            chunk = reader.read(info)
            if tuple(chunk.shape[1:]) != size[1:]:
                whole_rows = False  # not whole rows after all: assemble below
                break
            _pwrite_all(fd, _as_bytes(chunk.to(dtype)), base + offsets[0] * row_bytes)
            covered += chunk.numel()
            del chunk
        if whole_rows:
            _check_covered(reader.directory, fqn, covered, size)
            return
    split = _single_split_dim(chunks, size)
    if split is not None and hasattr(os, "pwritev"):
        _gather_write(fd, base, reader, tmd, chunks, split, fqn)
        return
    _pwrite_all(fd, _as_bytes(_assemble(reader, tmd, chunks, fqn)), base)


def _single_split_dim(chunks: List[Tuple[Tuple[int, ...], Any]], size: Tuple[int, ...]) -> Optional[int]:
    """The one dimension the chunks are split along (FSDPv2: a weight's largest dimension), if there is one."""
    dims = {d for offsets, _ in chunks for d, o in enumerate(offsets) if o != 0}
    return dims.pop() if len(dims) == 1 and len(size) >= 2 else None


def _gather_write(
    fd: int, base: int, reader: _ChunkReader, tmd: Any, chunks: List[Tuple[Tuple[int, ...], Any]], dim: int, fqn: str
) -> None:
    """Write a tensor split along `dim` > 0 by gathering, for every index of the leading dimensions, each chunk's
    contiguous run in order (pwritev): the kernel interleaves the pieces, no assembled copy is made."""
    size = tuple(tmd.size)
    dtype = tmd.properties.dtype
    loaded = sorted(((offsets[dim], reader.read(info).to(dtype)) for offsets, info in chunks), key=lambda c: c[0])
    outer = _numel(size[:dim])
    if any(tuple(c.shape[:dim]) != size[:dim] or tuple(c.shape[dim + 1 :]) != size[dim + 1 :] for _, c in loaded):
        _pwrite_all(fd, _as_bytes(_assemble(reader, tmd, chunks, fqn)), base)
        return
    _check_covered(reader.directory, fqn, sum(c.numel() for _, c in loaded), size)
    rows = [c.contiguous().reshape(outer, -1).view(torch.uint8).numpy() for _, c in loaded]
    iov_max = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
    per_call = max(1, iov_max // len(rows))
    offset = base
    for start in range(0, outer, per_call):
        buffers = [r[o] for o in range(start, min(outer, start + per_call)) for r in rows]
        total = sum(b.nbytes for b in buffers)
        written = os.pwritev(fd, buffers, offset)
        if written != total:  # a short vectored write: finish the rest piece by piece
            _pwrite_all(fd, memoryview(b"".join(bytes(b) for b in buffers))[written:], offset + written)
        offset += total


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # signature ... crc32, sizes, name length, extra length
_DESCRIPTOR_SIGNATURE = 0x08074B50


def _fix_zip_crcs(f: Any) -> None:
    """Write the CRC32 of every record of the zip archive `f` (opened r+b) where the central directory and the
    data descriptor keep it. torch.save under `skip_data` records the CRCs of the placeholder bytes; the tensor
    bytes are written afterwards, so their CRCs are computed here from the file, one record at a time."""
    f.seek(0)
    archive = zipfile.ZipFile(f)
    infos = archive.infolist()
    start_dir = archive.start_dir
    fd = f.fileno()
    crcs: List[int] = []
    for info in infos:
        header = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
        fields = _LOCAL_HEADER.unpack(header)
        data_offset = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        crc = 0
        done = 0
        while done < info.compress_size:
            block = os.pread(fd, min(_CHECKSUM_BLOCK, info.compress_size - done), data_offset + done)
            if not block:
                raise OSError(f"short read in {info.filename}")
            crc = zlib.crc32(block, crc)
            done += len(block)
        crcs.append(crc)
        if crc == info.CRC:
            continue
        packed = struct.pack("<I", crc)
        if info.flag_bits & 0x08:
            # data descriptor after the data: [signature] crc32 compressed-size uncompressed-size
            end = data_offset + info.compress_size
            first = struct.unpack("<I", os.pread(fd, 4, end))[0]
            os.pwrite(fd, packed, end + 4 if first == _DESCRIPTOR_SIGNATURE else end)
        else:
            os.pwrite(fd, packed, info.header_offset + 14)
    # central directory: one entry per record, in the same order; the CRC is at byte 16 of an entry
    offset = start_dir
    for info, crc in zip(infos, crcs):
        entry = os.pread(fd, 46, offset)
        if entry[:4] != b"PK\x01\x02":
            raise OSError("unexpected zip layout: central directory entry not found")
        name_len, extra_len, comment_len = struct.unpack("<HHH", entry[28:34])
        if crc != info.CRC:
            os.pwrite(fd, struct.pack("<I", crc), offset + 16)
        offset += 46 + name_len + extra_len + comment_len


def _lazy_tensor(size: Tuple[int, ...], dtype: torch.dtype) -> Tuple[torch.Tensor, Any]:
    """A tensor of the right shape and dtype backed by an anonymous mapping that is never touched, so it takes no
    memory: torch.save under `skip_data` only needs shapes, dtypes and storage sizes."""
    numel = _numel(size)
    if numel == 0:
        return torch.empty(size, dtype=dtype), None
    mm = mmap.mmap(-1, numel * torch.empty((), dtype=dtype).element_size())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=dtype, count=numel).view(size), mm


def read_values(checkpoint_dir: PathLike) -> Dict[str, Any]:
    """The plain values saved with a checkpoint (step, data position, method, ...), without torch_xla or devices.

    Only the file holding them is read: in a multi-host run, this host's own entry (its own shard file, so a
    per-host local disk suffices); otherwise host 0's."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    checkpoint_dir = location(checkpoint_dir)
    _, md = check_complete(checkpoint_dir, ranks=[])  # marker and index readable; shards checked below
    rank, world = _rank_world()
    info = md.storage_data.get(MetadataIndex(_meta_key(rank))) if world > 1 else None
    info = info or md.storage_data.get(MetadataIndex(META_KEY))
    if info is None:
        raise LitError(
            f"checkpoint {str(checkpoint_dir)!r} has no {META_KEY} entry: it was not written by save_sharded"
        )
    path = checkpoint_dir / info.relative_path
    if not path.is_file() or path.stat().st_size < info.offset + info.length:
        raise LitError(
            f"sharded checkpoint {str(checkpoint_dir)!r} lacks {info.relative_path} (or it is truncated), which"
            " holds the saved step and settings: copy it from the host that wrote it"
        )
    try:
        with path.open("rb") as f:
            raw = torch.load(_FileSlice(f, info.offset, info.length), weights_only=True)  # DCP torch.saves bytes
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)["values"]
    except Exception as e:  # a damaged entry raises anything from EOFError to UnpicklingError
        raise LitError(
            f"cannot read the saved values in {str(path)!r} ({type(e).__name__}): the checkpoint is damaged, use an"
            " earlier one"
        ) from e


def consolidate(
    checkpoint_dir: PathLike, output: Optional[PathLike] = None, key: str = "model", progress: bool = True
) -> Path:
    """Turn a sharded checkpoint into one `torch.load`-able file.

    A full-model checkpoint becomes a plain state dict (default `CHECKPOINT_DIR/lit_model.pth`), loadable with
    `GPT.load_state_dict`. A parameter-efficient one (saved with `lit_gpt.peft.finetuned_metadata`, so with
    "method" and "config" values) becomes lit_gpt.peft's finetuned-weights file `{"method", "config", "model"}`
    (default `CHECKPOINT_DIR/lit_model.pth.METHOD`), which generate/{adapter,adapter_v2,lora}.py read.

    Streams: the output file's skeleton (pickled structure, space for every tensor) is written first with
    `torch.serialization.skip_data`, then each tensor's chunks are written into its place: whole-row chunks by an
    in-kernel file copy, column chunks by a gathered write, others assembled in memory first. Peak memory is
    about the largest tensor, not the model. Tied tensors are written once and appear under all their names,
    like `torch.save(model.state_dict())`. The result is written atomically. The shard files are checked
    against the CRC32s recorded at save time first, and the output's zip CRCs are computed from the bytes written
    (one more read of the output, from the page cache), so `zipfile.ZipFile(output).testzip()` passes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from tqdm import tqdm

    checkpoint_dir = location(checkpoint_dir)
    marker, md = _check_and_verify_all(checkpoint_dir)
    prefix = key + "."
    entries = [
        (fqn[len(prefix) :], tmd)
        for fqn, tmd in md.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(tmd, TensorStorageMetadata)
    ]
    if not entries:
        kinds = marker.get("state", {})
        modules = [k for k, v in kinds.items() if v.get("kind") == "module"]
        raise LitError(
            f"checkpoint {str(checkpoint_dir)!r} has no module {key!r}"
            + (f" (modules saved: {', '.join(modules)}; pass --key NAME)" if modules else "")
        )
    tied: Dict[str, str] = marker.get("state", {}).get(key, {}).get("tied", {})
    names = [n for n, _ in entries]
    values = read_values(checkpoint_dir)
    method = values.get("method") if isinstance(values.get("method"), str) else None
    if output is None and method:
        output = checkpoint_dir / f"lit_model.pth.{method}"
    output = location(output) if output is not None else checkpoint_dir / "lit_model.pth"
    if output.is_dir():
        raise LitError(f"--output {str(output)!r} is a directory: pass a file path, e.g. {output / 'lit_model.pth'}")
    if is_url(output):
        # the file is assembled with positioned writes, which objects do not take: locally first, then uploaded
        stage = staging_dir("lit-gpt-consolidate-")
        try:
            consolidate(checkpoint_dir, stage / output.name, key=key, progress=progress)
            output.fs.makedirs(output.parent.path, exist_ok=True)
            output.fs.put_file(str(stage / output.name), output.path)
        except OSError as e:
            raise LitError(f"cannot write {str(output)!r}: {error_reason(e)}") from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return output

    # skeleton: lazily mapped placeholders; aliases share their canonical's storage (one record, like torch.save)
    lazy: Dict[str, torch.Tensor] = {}
    mappings = []
    for n, t in entries:
        lazy[n], mm = _lazy_tensor(tuple(t.size), t.properties.dtype)
        mappings.append(mm)
    skeleton: Dict[str, torch.Tensor] = dict(lazy)
    for alias, canonical in tied.items():
        if canonical in lazy:
            skeleton[alias] = lazy[canonical]

    # a private directory keeps the archive's internal name equal to torch.save(..., output)'s
    tmp_dir = output.parent / f".{output.name}.tmp{os.getpid()}"
    remove_stale_temp_files(output)  # what a consolidation killed earlier left (as large as the output)
    try:
        tmp_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LitError(f"cannot write {str(output)!r}: {error_reason(e)}") from None
    tmp = tmp_dir / output.name
    try:
        obj: Dict[str, Any] = skeleton
        if method:
            # metadata first: the storages are then still numbered in the order of `skeleton`
            obj = {"method": method, "config": values.get("config") or {}, "model": skeleton}
        with torch.serialization.skip_data():
            torch.save(obj, tmp)
        del obj, skeleton, lazy
        for mm in mappings:
            if mm is not None:
                mm.close()
        # torch.save numbers storages in the order it first meets them while pickling the dict
        record_of: Dict[str, int] = {}
        for n in names:
            record_of.setdefault(n, len(record_of))
        file_reader = torch._C.PyTorchFileReader(str(tmp))
        records = file_reader.get_all_records()
        root = next(r for r in records if r.endswith("data.pkl"))[: -len("data.pkl")]
        if sum(r.startswith(f"{root}data/") for r in records) != len(record_of):
            raise RuntimeError("unexpected torch.save layout: storage records do not match the tensors")
        offsets = {n: file_reader.get_record_offset(f"{root}data/{i}") for n, i in record_of.items()}
        del file_reader
        chunks = _chunks_by_tensor(md, prefix)
        reader = _ChunkReader(checkpoint_dir)
        try:
            with open(tmp, "r+b") as out:
                fd = out.fileno()
                for n, tmd in tqdm(entries, desc="consolidating", unit="tensor", disable=not progress):
                    _write_tensor(fd, offsets[n], reader, tmd, chunks.get(prefix + n, []), prefix + n)
                out.flush()
                _fix_zip_crcs(out)
                os.fsync(fd)
        finally:
            reader.close()
        os.replace(tmp, output)
    except (OSError, RuntimeError) as e:  # a full disk: one line, and the temporary output removed below
        reason = write_failure(e)
        if reason is None:
            raise
        raise LitError(f"cannot write {str(output)!r}: {reason}") from None
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return output
