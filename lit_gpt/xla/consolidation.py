"""A sharded checkpoint (`save_sharded`: per-host DCP shards) turned into the project's weights files, on any machine:
plain torch, neither torch_xla nor the devices.

    consolidate("out/xla/full/step-000100")                   # -> step-000100/lit_model.safetensors (+ shards)
    consolidate(step_dir, "out/final", max_shard_size="2GB")  # shards of up to 2 GB: lit_model-0000i-of-0000N + index
    for name, tensor in iter_consolidated(step_dir): ...       # one full tensor at a time

Output (`lit_gpt.weights` describes the format): a full-model checkpoint becomes `lit_model.safetensors`, or above
`max_shard_size` Hugging Face's sharded layout (`lit_model-00001-of-0000N.safetensors` ... and
`lit_model.safetensors.index.json`). A parameter-efficient one (saved with "method" and "config" values, see
`lit_gpt.peft.finetuned_metadata`) becomes `lit_model.<method>.safetensors` (the finetuned tensors) with
`lit_model.<method>.json` (method and settings) beside it. Tied names (listed in the checkpoint's marker) are
stored once, the others as aliases in the metadata, which `lit_gpt.weights.load_weights` restores.

Streaming: the output shards are planned from the checkpoint's index alone (names, shapes, dtypes), then one
shard at a time is read (`torch.distributed.checkpoint.load` of just that shard's tensors, preallocated on the
CPU: DCP reads each chunk that overlaps them and copies it into place), written (`safetensors`), and its memory
reused for the next. Peak host memory (anonymous): one output shard (`max_shard_size`, or the largest tensor when
it is larger) plus what DCP holds while it copies, up to three chunks (the one it reads, the previous one not yet
freed, torch.load's buffer), plus ~32 MiB of the libraries' own; a chunk is one tensor, or 1/N of it when the
tensor was sharded over N devices.
bench/consolidate.py and tests/xla/test_consolidation.py measure it. The shard's buffer is allocated once and
reused, and a written shard leaves the page cache once it is on disk (`lit_gpt.weights`): writing every shard
into fresh memory costs about as much time again as reading it.

The default shard size is 512 MB (`SHARD_SIZE`), not the 5 GB of the converters: the shard is the memory bound,
and a shard written into memory that an earlier shard freed is fast, while a large first shard pays for every
fresh page (bench/consolidate.py, 1.4 GB model on 8 XLA:CPU devices: 512 MB shards 0.86x the old zip writer's
throughput, one 1.4 GB file 0.58x; 256 MB shards 0.98-1.19x). A 70B bf16 model becomes ~280 files and an index.

Before anything is read, every file is checked against the size and CRC32 that its marker recorded at save time;
a damaged or badly copied file is refused in one line that names it. The output is committed as a whole: written
into a staging folder beside it and moved in with the index (or the single file) last; into a URL (a bucket),
written locally first and uploaded, that file last.
"""

import json
import math
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from lit_gpt.storage import is_url, location, staging_dir, upload
from lit_gpt.utils import LitError, error_reason
from lit_gpt.weights import (
    STEM,
    SUFFIX,
    base_metadata,
    finetuned_stem,
    index_name,
    save_weights_streaming,
    weights_name,
    write_finetuned_json,
)
from lit_gpt.xla.checkpoint import read_values
from lit_gpt.xla.integrity import _check_and_verify_all, _quiet_dcp, _reader

PathLike = Union[str, Path]
_ALIGN = 64  # byte alignment of each tensor inside the shard's buffer (any dtype's view of it is then valid)


SHARD_SIZE = "512MB"  # the default output shard (the memory bound): see the module doc

def _run_base(checkpoint_dir: Path) -> Optional[Dict[str, Any]]:
    """The base-model record of the run that wrote a step checkpoint (its finetune.json), if it has one."""
    run_file = checkpoint_dir / "finetune.json"
    try:
        base = json.loads(run_file.read_text()).get("base") if run_file.is_file() else None
    except (OSError, ValueError):
        return None
    return base if isinstance(base, dict) else None


def consolidate(
    checkpoint_dir: PathLike,
    output_dir: Optional[PathLike] = None,
    key: str = "model",
    max_shard_size: Union[int, str] = SHARD_SIZE,
    progress: bool = True,
    base: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write module `key` of a sharded checkpoint as safetensors into `output_dir` (default: the checkpoint folder),
    a folder or a URL. Returns the weights file that loaders take: the single file, or the index when sharded
    (`lit_gpt.weights.load_weights` reads either). Peak host memory: one output shard plus up to three DCP
    chunks (see the module's docstring). The base model the run was finetuned from (`base`, by default the record
    in the step's finetune.json) is recorded with the weights (`lit_gpt.fingerprint`)."""
    checkpoint_dir = location(checkpoint_dir)
    marker, md = _check_and_verify_all(checkpoint_dir)
    base = base if base is not None else _run_base(checkpoint_dir)
    specs = _module_specs(checkpoint_dir, marker, md, key)
    tied = marker.get("state", {}).get(key, {}).get("tied", {})
    aliases = {alias: name for alias, name in tied.items() if name in specs and alias not in specs}
    method, config = saved_method(checkpoint_dir)
    out = _output_dir(checkpoint_dir, output_dir)

    def write(directory: Path) -> List[Path]:
        stem = write_finetuned_json(directory, method, config, base=base) if method else STEM
        metadata = aliases if method else {**aliases, **base_metadata(base)}
        with _ShardReader(checkpoint_dir, key, specs, progress) as materialize:
            return save_weights_streaming(specs, materialize, directory, stem=stem, max_shard_size=max_shard_size,
                                          metadata=metadata)

    created = not is_url(out) and not out.exists()
    try:
        if not is_url(out):
            return write(out)[-1]
        # safetensors writes local files: they are written here and uploaded, the file loaders look for last
        stage = staging_dir("lit-gpt-consolidate-")
        try:
            last = write(stage)[-1].name
            _remove_weights_in_bucket(out, finetuned_stem(method) if method else STEM)
            upload(stage, out, last=[last])
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return out / last
    except OSError as e:  # a full disk, a read-only or missing folder: one line, and no folder left half-written
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise LitError(f"cannot write {str(out)!r}: {error_reason(e)}") from None


def saved_method(checkpoint_dir: PathLike) -> Tuple[Optional[str], Dict[str, Any]]:
    """(method, its settings) of a parameter-efficient checkpoint, (None, {}) for a full model: what decides the
    output's name (`lit_model.<method>.safetensors` or `lit_model.safetensors`)."""

    values = read_values(checkpoint_dir)
    method = values.get("method") if isinstance(values.get("method"), str) else None
    return method, (values.get("config") or {}) if method else {}


def output_stem(checkpoint_dir: PathLike) -> str:
    """The stem of `consolidate`'s output for this checkpoint: `lit_model` or `lit_model.<method>`."""
    method, _ = saved_method(checkpoint_dir)
    return finetuned_stem(method) if method else STEM


def iter_consolidated(checkpoint_dir: PathLike, key: str = "model") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (plain name, full CPU tensor) of module `key`, one tensor at a time (peak memory: one tensor plus one
    chunk), after the same checks as `consolidate`."""
    checkpoint_dir = location(checkpoint_dir)
    marker, md = _check_and_verify_all(checkpoint_dir)
    specs = _module_specs(checkpoint_dir, marker, md, key)
    reader = _reader(checkpoint_dir)
    for name, spec in specs.items():
        tensor = torch.empty(spec.shape, dtype=spec.dtype)
        _load(checkpoint_dir, reader, {key: {name: tensor}})
        yield name, tensor


def _module_specs(checkpoint_dir: Path, marker: Dict[str, Any], md: Any, key: str) -> Dict[str, torch.Tensor]:
    """{plain name: meta tensor of its global shape and dtype} of module `key`, in saved order."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = key + "."
    specs: Dict[str, torch.Tensor] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not fqn.startswith(prefix) or not isinstance(tmd, TensorStorageMetadata):
            continue
        # the shard's memory is reused: a tensor whose chunks do not cover it would keep another's bytes
        if sum(math.prod(c.sizes) for c in tmd.chunks) < math.prod(tmd.size):
            raise LitError(f"sharded checkpoint {str(checkpoint_dir)!r} does not hold every chunk of {fqn}: it is"
                           " damaged, use an earlier checkpoint")
        specs[fqn[len(prefix):]] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype, device="meta")
    if not specs:
        modules = [k for k, v in marker.get("state", {}).items() if v.get("kind") == "module"]
        raise LitError(
            f"checkpoint {str(checkpoint_dir)!r} has no module {key!r}"
            + (f" (modules saved: {', '.join(modules)}; pass --key NAME)" if modules else "")
        )
    return specs


def _output_dir(checkpoint_dir: Path, output_dir: Optional[PathLike]) -> Path:
    if output_dir is None:
        return checkpoint_dir
    out = location(output_dir)
    name = out.name
    # the earlier API took a file (lit_model.pth, lit_model.pth.lora): never turn that name into a folder
    if name.endswith((".pth", SUFFIX)) or ".pth." in name:
        raise LitError(
            f"{str(output_dir)!r} names a file, but consolidation writes safetensors files into a folder"
            f" (lit_model.safetensors, or lit_model.<method>.safetensors with its .json): pass the folder, e.g."
            f" {str(out.parent)!r}"
        )
    if out.is_file():
        raise LitError(f"{str(output_dir)!r} is a file: pass the folder to write the weights into")
    return out


class _ShardReader:
    """`materialize` for `save_weights_streaming`: the tensors of one output shard, read from the checkpoint into
    one buffer that every shard reuses (grown when a shard needs more: its size is the largest shard's)."""

    def __init__(self, checkpoint_dir: Path, key: str, specs: Dict[str, torch.Tensor], progress: bool) -> None:
        from tqdm import tqdm

        self.checkpoint_dir, self.key, self.specs = checkpoint_dir, key, specs
        self.reader = _reader(checkpoint_dir)
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.bar = tqdm(total=len(specs), desc="consolidating", unit="tensor", disable=not progress)

    def __enter__(self) -> "_ShardReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def __call__(self, names: List[str]) -> Dict[str, torch.Tensor]:
        sizes = [self.specs[n].numel() * self.specs[n].element_size() for n in names]
        need = sum(-(-size // _ALIGN) * _ALIGN for size in sizes)
        if self.buffer.numel() < need:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one is freed before the larger one exists
            self.buffer = torch.empty(need, dtype=torch.uint8)
        tensors: Dict[str, torch.Tensor] = {}
        offset = 0
        for name, size in zip(names, sizes):
            spec = self.specs[name]
            tensors[name] = self.buffer[offset: offset + size].view(spec.dtype).view(spec.shape)
            offset += -(-size // _ALIGN) * _ALIGN
        _load(self.checkpoint_dir, self.reader, {self.key: tensors})
        self.bar.update(len(names))
        return tensors


def _load(checkpoint_dir: Path, reader: Any, state: Dict[str, Dict[str, torch.Tensor]]) -> None:
    """DCP's load of `state` (CPU tensors, filled in place) from the checkpoint, in this process only."""
    import torch.distributed.checkpoint as dcp

    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (dcp.CheckpointException, Exception) as e:  # (files verified first: a checkpoint without checksums)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise LitError(
            f"cannot read the shards of {str(checkpoint_dir)!r} ({reason}): the checkpoint is damaged, use an"
            " earlier one"
        ) from e


def _remove_weights_in_bucket(folder: Path, stem: str) -> None:
    """An earlier consolidation's files of `stem` in a bucket folder: the file that loaders look for first, then
    its shards (the upload brings the new ones, that file last)."""
    fs = folder.fs
    for name in (weights_name(stem), index_name(stem)):
        if fs.exists((folder / name).path):
            fs.rm((folder / name).path)
    for shard in fs.glob((folder / f"{stem}-*-of-*{SUFFIX}").path):
        fs.rm(shard)
