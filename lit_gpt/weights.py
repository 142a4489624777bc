"""The weights files the project writes, and the reader of every weights file it accepts.

Format (safetensors, written with `safetensors` and `huggingface_hub`; any safetensors reader loads it):

* A model: `lit_model.safetensors`, or above `max_shard_size` Hugging Face's sharded layout,
  `lit_model-00001-of-0000N.safetensors` ... plus `lit_model.safetensors.index.json`
  (`{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}`). Tensor names are lit_gpt's
  state-dict keys (`transformer.h.0.attn.qkv.weight`, ...), dtypes as in the model. The architecture is
  `lit_config.json` beside it.
* Tensors that share storage (tied embeddings: `lm_head.weight` is `transformer.wte.weight`) are stored once; the
  safetensors header's metadata maps the dropped name to the kept one (`{"lm_head.weight": "transformer.wte.weight"}`,
  huggingface_hub's convention), and `load_weights` returns both names again.
* Finetuned weights of a parameter-efficient method: `lit_model.<method>.safetensors` (only the finetuned tensors)
  with `lit_model.<method>.json` beside it: `{"format": "lit_gpt.finetuned", "version": 1, "method": "lora",
  "config": {"lora_r": 8, ...}}` (see `lit_gpt.peft`).

Earlier versions wrote `torch.save` pickles (`lit_model.pth`, `lit_model.pth.lora`, ...): `load_weights` still reads
them, weights-only (a pickle that would import code is refused, never loaded); nothing writes them any more.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import torch

from lit_gpt.utils import LitError, load_state_dict, write_text_atomic

PathLike = Union[str, Path]
STEM = "lit_model"
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
LEGACY = "lit_model.pth"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def weights_name(stem: str = STEM) -> str:
    return stem + SUFFIX


def index_name(stem: str = STEM) -> str:
    return stem + INDEX_SUFFIX


def find_weights(directory: PathLike, stem: str = STEM) -> Optional[Path]:
    """The weights of `directory` as `load_weights` takes them: the one file, the index of the shards, or an earlier
    version's `lit_model.pth`; None if there are none."""
    directory = Path(directory)
    for name in (weights_name(stem), index_name(stem)) + ((LEGACY,) if stem == STEM else ()):
        if (directory / name).is_file():
            return directory / name
    return None


def is_weights_file(path: PathLike) -> bool:
    name = Path(path).name
    return name.endswith(SUFFIX) or name.endswith(INDEX_SUFFIX)


def _check_names(state: Mapping[str, Any]) -> None:
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise TypeError(f"weights must map names to tensors (got {type(name).__name__} -> {type(value).__name__})")


def save_weights(
    state: Mapping[str, torch.Tensor],
    directory: PathLike,
    stem: str = STEM,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    metadata: Optional[Dict[str, str]] = None,
) -> List[Path]:
    """Write `state` as `stem.safetensors` (or sharded with an index above `max_shard_size`) into `directory`.

    The files are written into a staging folder beside them and moved in when all are complete, the index (or the
    single file) last, so an interrupted save never leaves a file that loads under the final name. Shards of an
    earlier save under the same stem are removed. Returns the written files."""
    from huggingface_hub import save_torch_state_dict

    _check_names(state)
    state, aliases = _drop_shared(state)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".{stem}.staging{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        # the aliases land in the single file's header, or in the index's "metadata" when sharded
        save_torch_state_dict(
            state, staging, filename_pattern=stem + "{suffix}" + SUFFIX, max_shard_size=max_shard_size,
            metadata={"format": "pt", **(metadata or {}), **aliases},
        )
        written = sorted(staging.iterdir(), key=lambda p: (p.name.endswith(".json"), p.name))
        _remove_old(directory, stem, keep={p.name for p in written})
        for p in written:
            os.replace(p, directory / p.name)
        _fsync_dir(directory)
        return [directory / p.name for p in written]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _drop_shared(state: Mapping[str, torch.Tensor]) -> "tuple[Dict[str, torch.Tensor], Dict[str, str]]":
    """Store a tensor that several names share once: the first name in the state's order stays (the embedding,
    not the tied head), the others become aliases."""
    kept: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    seen: Dict[Any, str] = {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.device.type != "meta" and t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen.setdefault(key, name)
        kept[name] = t
    return kept, aliases


def _remove_old(directory: Path, stem: str, keep: Iterable[str]) -> None:
    keep = set(keep)
    for p in directory.glob(f"{stem}-*-of-*{SUFFIX}"):
        if p.name not in keep:
            p.unlink(missing_ok=True)
    for name in (weights_name(stem), index_name(stem)):
        if name not in keep:
            (directory / name).unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: PathLike, obj: Any) -> None:
    """The documented JSON beside a weights file (indent 2, sorted keys), written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: PathLike, what: str) -> Dict[str, Any]:
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise LitError(f"{what} {str(path)!r} not found") from None
    except (OSError, ValueError) as e:
        raise LitError(f"cannot read {what} {str(path)!r} ({e}): re-create it") from None
    if not isinstance(obj, dict):
        raise LitError(f"{what} {str(path)!r} is not a JSON object: re-create it")
    return obj


def _restore_aliases(state: Dict[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    # names dropped because they shared storage with a kept tensor come back as the same tensor
    for dropped, kept in meta.items():
        if isinstance(kept, str) and dropped not in state and kept in state:
            state[dropped] = state[kept]


def _read_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    from lit_gpt.storage import is_url

    try:
        if is_url(path):  # a file in a bucket: read through fsspec (safetensors maps local files only)
            from safetensors.torch import load as load_bytes

            with path.open("rb") as f:
                state = load_bytes(f.read())
            meta = json.loads(_header_bytes(path)).get("__metadata__") or {}
        else:
            state, meta = {}, {}
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                for name in f.keys():
                    state[name] = f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LitError(
            f"cannot read weights {str(path)!r} (corrupt or truncated: {first}). Re-create it, e.g. by converting"
            " the model again"
        ) from None
    _restore_aliases(state, meta)
    return state


def _header_bytes(path: Path) -> bytes:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def load_weights(path: PathLike, mmap: bool = True) -> Dict[str, torch.Tensor]:
    """{name: tensor} on the CPU from a `.safetensors` file, a sharded index, or an earlier version's `.pth` pickle
    (memory-mapped, weights only). A missing, truncated or corrupt file, an index that names a missing shard, or a
    pickle that would run code is one LitError line."""
    from lit_gpt.storage import location

    path = location(path)
    name = path.name
    if name.endswith(INDEX_SUFFIX):
        index = read_json(path, "weights index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LitError(f"weights index {str(path)!r} has no weight_map: re-create it")
        state: Dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path.parent / shard
            if not shard_path.is_file():
                raise LitError(f"{str(path)!r} names the shard {shard!r}, which is missing: copy the whole folder")
            state.update(_read_safetensors(shard_path))
        _restore_aliases(state, index.get("metadata") or {})
        missing = [k for k in weight_map if k not in state]
        if missing:
            raise LitError(f"weights index {str(path)!r} lists {missing[0]!r}, which no shard holds: re-create it")
        return state
    if name.endswith(SUFFIX):
        if not path.is_file():
            raise LitError(f"weights file {str(path)!r} not found")
        return _read_safetensors(path)
    return load_state_dict(path, mmap=mmap)  # an earlier version's torch.save file (read-only compatibility)


# ---------------------------------------------------------------------------------------------------------------
# finetuned weights of a parameter-efficient method: lit_model.<method>.safetensors + lit_model.<method>.json
# ---------------------------------------------------------------------------------------------------------------
FINETUNED_FORMAT = "lit_gpt.finetuned"
FINETUNED_VERSION = 1


def finetuned_stem(method: str) -> str:
    return f"{STEM}.{method}"


def finetuned_json(weights_path: PathLike) -> Path:
    """`lit_model.lora.json` beside `lit_model.lora.safetensors` (or beside its index)."""
    path = Path(weights_path)
    name = path.name
    for suffix in (INDEX_SUFFIX, SUFFIX):
        if name.endswith(suffix):
            return path.with_name(name[: -len(suffix)] + ".json")
    return path.with_name(name + ".json")


def finetuned_metadata_dict(method: str, config: Mapping[str, Any]) -> Dict[str, Any]:
    return {"format": FINETUNED_FORMAT, "version": FINETUNED_VERSION, "method": method, "config": dict(config)}


def save_finetuned_weights(
    state: Mapping[str, torch.Tensor], directory: PathLike, method: str, config: Mapping[str, Any],
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a method's finetuned tensors and their JSON (method, variant config) into `directory`; the JSON goes
    first, so the weights file, which the loaders look for, appears last. Returns the weights path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = finetuned_stem(method)
    write_json(directory / f"{stem}.json", finetuned_metadata_dict(method, config))
    written = save_weights(state, directory, stem=stem, max_shard_size=max_shard_size)
    return written[-1]  # the single file, or the index (written last)


def read_finetuned_metadata(weights_path: PathLike) -> Dict[str, Any]:
    """The JSON beside a finetuned-weights file: {"format", "version", "method", "config"}; one line if absent."""
    path = finetuned_json(weights_path)
    if not path.is_file():
        raise LitError(f"{str(weights_path)!r} has no {path.name} beside it (the method and its settings): copy it"
                       " together with the weights, as the finetuning recipe wrote them")
    meta = read_json(path, "finetuned-weights description")
    if meta.get("format") != FINETUNED_FORMAT or not isinstance(meta.get("method"), str):
        raise LitError(f"{str(path)!r} is not a finetuned-weights description (no format {FINETUNED_FORMAT!r})")
    if not isinstance(meta.get("config"), dict):
        meta["config"] = {}
    return meta
