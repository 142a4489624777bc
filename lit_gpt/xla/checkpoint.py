"""Sharded checkpoints, written per host with torch.distributed.checkpoint (DCP): save, load, and the plain values.

    save_sharded(path, {"model": model, "optimizer": optimizer, "step": 100, "data_pos": 1234})
    remainder = load_sharded(path, {"model": model, "optimizer": optimizer, "step": 0, "data_pos": 0})
    path = latest_checkpoint(out_dir)        # newest *complete* checkpoint in this folder
    path = agreed_latest_checkpoint(out_dir, "step-*")  # the same, agreed by every host: for `--resume auto`
    consolidate(path, "out/final")           # (lit_gpt.xla.consolidation) safetensors, no torch_xla needed

This module saves and loads; `lit_gpt.xla.integrity` checks the files and picks the checkpoint to resume from;
`lit_gpt.xla.consolidation` turns a checkpoint into weights files. Their public names are importable from here too.

Layout of a checkpoint directory:
  __{rank}_{i}.distcp   the shards that process (host) `rank` holds, written by that host only (SPMDSavePlanner)
  .metadata             DCP's index: every tensor's global shape and where each chunk lives
  lit_checkpoint.json   completion marker, written last: format, hosts, files per host, tied names, and the size
                        and CRC32 of every file. A directory without it is an interrupted save and every loader
                        here refuses it.

Integrity: every host checksums (CRC32, streamed) the files it wrote before the marker is written; `load_sharded`
and the consolidation check the files they read against the marker first and refuse a damaged one, naming it (a
flipped bit inside a tensor would otherwise load as a wrong number: DCP does not check what it reads).

Atomicity: everything is written into a hidden sibling `.NAME.tmp-TOKEN`, the marker last, then renamed to NAME
(`lit_gpt.state.commit_folder`), so a process killed mid-save leaves the previous checkpoint as it was and no
directory that looks valid.
Multi-host: with a shared directory (NFS, Filestore, gcsfuse) all hosts write into the same temporary directory
and host 0 renames it; with per-host local disks each host renames its own directory, which holds its own shards
plus a copy of the marker and `.metadata`: each host can then resume from its own disk (`load_sharded` reads the
files of its own rank), and `agreed_latest_checkpoint` makes all hosts resume from the same step. To consolidate,
copy the other hosts' `__{rank}_*.distcp` files into one directory first (`consolidate` names any that are missing).

What is stored: modules as plain lit names (FSDP wrappers' `_orig_module.` removed; a tied parameter once, its
aliases listed in the marker), optimizers' tensors sharded like their parameters, and everything else (step, data
position, optimizer hyperparameters, RNG states: `lit_gpt.state.rng_state`) as one small pickled entry per host.
Loading onto another number of devices works: DCP reads, for every local shard, the chunks that overlap it.

This module imports torch_xla only when it is used with XLA tensors, so the consolidation runs on any machine.
"""

import io
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.imports import RequirementCache
from torch.optim import Optimizer

from lit_gpt.manifest import write_json_synced
from lit_gpt.state import commit_folder, fsync_dir, rng_state, set_rng_state
from lit_gpt.storage import is_url, location, remove, write_into
from lit_gpt.utils import LitError
from lit_gpt.xla.integrity import (  # noqa: F401  (the recipes and tests import them from here)
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    META_KEY,
    _RANK_FILE,
    _all_gather,
    _barrier,
    _broadcast,
    _check_and_verify_for_load,
    _few,
    _meta_key,
    _quiet_dcp,
    _rank_world,
    _reader,
    agreed_latest_checkpoint,
    check_complete,
    file_checksum,
    is_complete,
    latest_checkpoint,
    needed_files,
    read_marker,
    verify_files,
)

__all__ = [
    "MARKER", "FORMAT", "FORMAT_VERSION", "META_KEY", "plain_name", "module_state_dict", "save_sharded", "load_sharded",
    "prime_optimizer", "read_values", "file_checksum", "verify_files", "read_marker", "check_complete", "is_complete",
    "latest_checkpoint", "agreed_latest_checkpoint", "needed_files",
]  # consolidation (which reads these checkpoints) is lit_gpt.xla.consolidation
_WRAPPER_PREFIXES = ("_orig_module.", "_forward_module.", "_checkpoint_wrapped_module.")
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


def _rng_device() -> Optional[torch.device]:
    """The device whose generator `lit_gpt.state.rng_state` records besides the host's: the XLA device when the
    program uses torch_xla (dropout on the devices draws from it), else none."""
    if not _xla_in_use():
        return None
    import torch_xla

    return torch_xla.device()


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
    meta["rng"] = rng_state(_rng_device())
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
    (adapter) tensors only. Every host's RNG states (`lit_gpt.state.rng_state`: Python, NumPy, torch, XLA) are saved
    too and restored by `load_sharded`."""
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
            marker["checksums"].update(run_file_checksums(tmp))
        write_json_synced(tmp / MARKER, marker)
        fsync_dir(tmp)
        commit_folder(tmp, path, token)
    _barrier()
    if rank != 0 and tmp.exists():
        # per-host local disk: this host's shards go next to where host 0's checkpoint lives on the shared name
        if local_disks:
            marker, index = marker_and_index
            with open(tmp / ".metadata", "wb") as f:
                f.write(index)
                f.flush()
                os.fsync(f.fileno())
            write_json_synced(tmp / MARKER, marker)
            fsync_dir(tmp)
        commit_folder(tmp, path, token)
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
        writer = FsspecWriter(str(path), sync_files=False, per_thread_copy_ahead=_COPY_AHEAD)
        dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=world == 1)
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
            marker["checksums"].update(run_file_checksums(path))  # read back: what the bucket holds
        write_json_synced(path / MARKER, marker)
    _barrier()
    return path


def run_file_checksums(folder: Path) -> Dict[str, Dict[str, Any]]:
    """Checksums of the caller's files in a checkpoint folder (configs, tokenizer, the run's arguments): everything
    but the shards, the index and the marker, which the marker covers already or is."""
    return {f.name: file_checksum(f) for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.is_file() and f.name not in (MARKER, ".metadata") and not _RANK_FILE.match(f.name)}


def _device_count() -> int:
    if _xla_in_use():
        import torch_xla.runtime as xr

        return xr.global_runtime_device_count()
    return 1


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
        set_rng_state(meta.get("rng", {}), _rng_device())
    _xla_sync()
    return {k: v for k, v in values.items() if k not in state}


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
