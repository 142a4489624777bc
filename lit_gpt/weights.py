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
  "config": {"lora_r": 8, ...}, "base": {"fingerprint": "sha256:...", "checkpoint_dir": "checkpoints/..."}}` (see
  `lit_gpt.peft`; "base": the base model it was finetuned on, `lit_gpt.fingerprint`; absent in earlier files).
* A fully finetuned model records its base the same way in its header metadata (the index's "metadata" when
  sharded): `"lit_gpt.base_fingerprint"` and `"lit_gpt.base_checkpoint_dir"` (`base_metadata`, `read_base_record`).

Earlier versions wrote `torch.save` pickles (`lit_model.pth`, `lit_model.pth.lora`, ...): `load_weights` still reads
them, weights-only (a pickle that would import code is refused, never loaded); nothing writes them any more.
"""

import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch
import torch.nn as nn

from lit_gpt.state import file_mode, fsync_dir
from lit_gpt.storage import is_url, location
from lit_gpt.utils import (
    LitError, download_command, load_error_detail, remove_stale_temp_files, write_text_atomic,
)

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
    earlier save under the same stem are removed. Returns the written files, the index (or single file) last."""
    _check_names(state)
    kept, aliases = _drop_shared(state)
    specs = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in kept.items()}
    return save_weights_streaming(
        specs, lambda names: {n: kept[n].detach().contiguous() for n in names}, directory, stem=stem,
        max_shard_size=max_shard_size, metadata={**(metadata or {}), **aliases},
    )


def save_weights_streaming(
    specs: Mapping[str, torch.Tensor],
    materialize: Callable[[List[str]], Mapping[str, torch.Tensor]],
    directory: PathLike,
    stem: str = STEM,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    metadata: Optional[Dict[str, str]] = None,
) -> List[Path]:
    """`save_weights` for weights that are not all in memory: written one shard at a time.

    `specs` maps every name to a tensor of its shape and dtype (on the meta device: nothing is allocated); the
    shards are planned from them with huggingface_hub's `split_torch_state_dict_into_shards`, as its
    `save_torch_state_dict` plans them. Then for each shard `materialize(names)` returns those CPU tensors, which
    are written (`safetensors.torch.save_file`) and dropped before the next shard is asked for: peak memory is one
    shard (`max_shard_size`, or one tensor above it) plus what `materialize` itself needs. `metadata` goes into
    the single file's header, or into the index when sharded (aliases of tied names: see `_drop_shared`).
    Layout, staging and commit as `save_weights`."""
    from huggingface_hub import split_torch_state_dict_into_shards

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = split_torch_state_dict_into_shards(
        dict(specs), filename_pattern=stem + "{suffix}" + SUFFIX, max_shard_size=max_shard_size
    )
    metadata = {"format": "pt", **(metadata or {})}
    remove_stale_temp_files(directory / stem)  # the staging folder of a save killed earlier (as large as the weights)
    staging = directory / f".{stem}.tmp{os.getpid()}"
    staging.mkdir()
    try:
        for filename, names in plan.filename_to_tensors.items():
            tensors = dict(materialize(list(names)))
            _check_shard(tensors, names, specs)
            # as huggingface_hub writes them: a shard's header names the format, the index holds the metadata
            _save_file(tensors, staging / filename, {"format": "pt"} if plan.is_sharded else metadata)
            del tensors
        if plan.is_sharded:
            index = {"metadata": {**plan.metadata, **metadata}, "weight_map": plan.tensor_to_filename}
            with open(staging / index_name(stem), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
        return _move_in(staging, directory, stem)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_shard(tensors: Mapping[str, torch.Tensor], names: List[str], specs: Mapping[str, torch.Tensor]) -> None:
    # tensors other than the planned ones would make the index lie about the shards
    if set(tensors) != set(names):
        raise ValueError(f"materialize returned {sorted(tensors)[:3]}... for the shard of {sorted(names)[:3]}...")
    for name in names:
        t, spec = tensors[name], specs[name]
        if t.shape != spec.shape or t.dtype != spec.dtype:
            raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, planned {spec.dtype} {tuple(spec.shape)}")


def _save_file(tensors: Dict[str, torch.Tensor], path: Path, metadata: Dict[str, str]) -> None:
    """safetensors' writer, made durable (fsync) before the file is moved in. Its I/O failures (a full disk, a file
    size limit) become the OSError they are, which callers report as a failed write."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        m = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
        if m is None:
            raise
        raise OSError(int(m.group(2)), m.group(1), str(path)) from None
    os.chmod(path, file_mode())  # safetensors creates it owner-only (0600); the files beside it have the umask's
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            # the file is on disk: its cached pages go back to the kernel, and the next shard is written into them
            # instead of into pages reclaimed from a full page cache (bench/consolidate.py: ~1.8x faster), so the
            # writer's page-cache footprint stays one shard
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _move_in(staging: Path, directory: Path, stem: str) -> List[Path]:
    """Move the complete files of `staging` into `directory`. The earlier save's index or single file goes first (a
    reader then finds no weights, never an index naming shards that are being replaced), then its other shards;
    the new shards come in, the new index or single file last. Returns the files, that one last."""
    last = (weights_name(stem), index_name(stem))
    written = sorted(staging.iterdir(), key=lambda p: (p.name in last, p.name))
    for name in last:
        (directory / name).unlink(missing_ok=True)
    keep = {p.name for p in written}
    for p in directory.glob(f"{stem}-*-of-*{SUFFIX}"):
        if p.name not in keep:
            p.unlink(missing_ok=True)
    for p in written:
        os.replace(p, directory / p.name)
    fsync_dir(directory)
    return [directory / p.name for p in written]


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


_ALIGNMENT = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` at a 64-byte boundary. safetensors maps the file and packs tensors back to back, so most start off one;
    the CPU's matmul kernels choose their code path by alignment, and a model loaded from such views computes a
    few ulps away from the model that was saved (and from run to run, by where the mapping lands). Copied, the
    weights are in memory once, as any loader that materialises them (transformers') has them; aligned views stay
    file-backed."""
    return t if t.data_ptr() % _ALIGNMENT == 0 else t.clone()


def _read_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

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
                    state[name] = _aligned(f.get_tensor(name))
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


def load_weights(path: PathLike, mmap: bool = True, packed: bool = False) -> Dict[str, torch.Tensor]:
    """{name: tensor} on the CPU from a `.safetensors` file, a sharded index, or an earlier version's `.pth` pickle
    (memory-mapped, weights only). A missing, truncated or corrupt file, an index that names a missing shard, or a
    pickle that would run code is one LitError line. gpt-oss's experts, which a converted checkpoint keeps packed in
    MXFP4, come decoded to float `.weight`s, or packed (`.blocks` / `.scales`) for a model that holds them so
    (`packed`: `load_checkpoint` asks the model): `lit_gpt.mxfp4.fit_state`, the one hook of every loader."""
    from lit_gpt.mxfp4 import fit_state

    state = _load_weights(path, mmap)
    return fit_state(state, packed, where=f"weights {str(path)!r}")


def _load_weights(path: PathLike, mmap: bool) -> Dict[str, torch.Tensor]:
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


def finetuned_metadata_dict(method: str, config: Mapping[str, Any],
                            base: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    meta = {"format": FINETUNED_FORMAT, "version": FINETUNED_VERSION, "method": method, "config": dict(config)}
    if base is not None:
        meta["base"] = dict(base)
    return meta


def save_finetuned_weights(
    state: Mapping[str, torch.Tensor], directory: PathLike, method: str, config: Mapping[str, Any],
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, base: Optional[Mapping[str, str]] = None,
) -> Path:
    """Write a method's finetuned tensors and their JSON (method, variant config, and `base`: {"fingerprint",
    "checkpoint_dir"} of the base model, `lit_gpt.fingerprint.base_record`) into `directory`; the JSON goes first, so
    the weights file, which the loaders look for, appears last. Returns the weights path."""
    stem = write_finetuned_json(directory, method, config, base=base)
    written = save_weights(state, directory, stem=stem, max_shard_size=max_shard_size)
    return written[-1]  # the single file, or the index (written last)


def write_finetuned_json(directory: PathLike, method: str, config: Mapping[str, Any],
                         base: Optional[Mapping[str, str]] = None) -> str:
    """`lit_model.<method>.json` into `directory`, before the weights it describes; returns their stem."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = finetuned_stem(method)
    write_json(directory / f"{stem}.json", finetuned_metadata_dict(method, config, base))
    return stem


BASE_FINGERPRINT_KEY = "lit_gpt.base_fingerprint"
BASE_CHECKPOINT_DIR_KEY = "lit_gpt.base_checkpoint_dir"


def base_metadata(base: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """The header metadata of a fully finetuned model that records its base ({"fingerprint", "checkpoint_dir"})."""
    if not base:
        return {}
    out = {BASE_FINGERPRINT_KEY: str(base["fingerprint"])}
    if base.get("checkpoint_dir"):
        out[BASE_CHECKPOINT_DIR_KEY] = str(base["checkpoint_dir"])
    return out


def read_base_record(weights_path: PathLike) -> Optional[Dict[str, Any]]:
    """The base model that finetuned weights record: their JSON's "base", or a full model's header (or index)
    metadata; None where nothing is recorded (files of earlier versions, a `.pth`, a converted model)."""
    path = location(weights_path)
    if not is_url(path) and finetuned_json(path).is_file():
        base = read_json(finetuned_json(path), "finetuned-weights description").get("base")
        return base if base is None or isinstance(base, dict) else {"invalid": base}
    if path.name.endswith(INDEX_SUFFIX):
        meta = read_json(path, "weights index").get("metadata") or {}
    elif path.name.endswith(SUFFIX) and path.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            if is_url(path):
                meta = json.loads(_header_bytes(path)).get("__metadata__") or {}
            else:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    meta = f.metadata() or {}
        except (SafetensorError, OSError, ValueError, OverflowError, MemoryError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise LitError(f"cannot read weights {str(path)!r} (corrupt or truncated: {first}). Re-create it, e.g. by"
                           " converting the model again") from None
    else:
        return None
    if BASE_FINGERPRINT_KEY not in meta:
        return None
    return {"fingerprint": meta[BASE_FINGERPRINT_KEY], "checkpoint_dir": meta.get(BASE_CHECKPOINT_DIR_KEY)}


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


# ---------------------------------------------------------------------------------------------------------------
# a model folder's weights, and earlier versions' torch.save files
# ---------------------------------------------------------------------------------------------------------------
_FINETUNED_NAME = re.compile(r"lit_model\.(?:pth\.(\w+)|(\w+)\.safetensors(?:\.index\.json)?)")
_GENERATE_FLAG = {"lora": "generate/lora.py --lora_path", "adapter": "generate/adapter.py --adapter_path",
                  "adapter_v2": "generate/adapter_v2.py --adapter_path"}



def check_checkpoint_dir(checkpoint_dir: Path, filename: Optional[str] = None) -> Path:
    """The weights of `checkpoint_dir` (`lit_model.safetensors`, the index of its shards, or an earlier version's
    `lit_model.pth`; or `filename` in it when given), or raise a LitError that says how to get them."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / filename if filename is not None else find_weights(checkpoint_dir)
    if path is not None and path.is_file():
        return path
    if not checkpoint_dir.is_dir():
        raise LitError(
            f"checkpoint directory {str(checkpoint_dir)!r} does not exist. Download and convert it with:"
            f" {download_command(checkpoint_dir)} (offline: python scripts/convert_gguf_checkpoint.py)"
        )
    # a finetuning run's output folder: parameter-efficient weights only (lit_model.<method>.safetensors, or an
    # earlier version's lit_model.pth.<method>), which need their base model
    finetuned = sorted(p for p in checkpoint_dir.iterdir() if _FINETUNED_NAME.fullmatch(p.name))
    if finetuned:
        m = _FINETUNED_NAME.fullmatch(finetuned[0].name)
        kind = m.group(1) or m.group(2)
        recipe = _GENERATE_FLAG.get(kind, f"the {kind} generate recipe with")
        merge = " (or merge them into a full model with scripts/merge_lora.py)" if kind == "lora" else ""
        raise LitError(
            f"{str(checkpoint_dir)!r} holds {kind} finetuned weights ({finetuned[0].name}), not a full model: pass the"
            f" base model as --checkpoint_dir and use {recipe} {finetuned[0]}{merge}"
        )
    hf_files = list(checkpoint_dir.glob("*.safetensors")) + list(checkpoint_dir.glob("pytorch_model*.bin"))
    if hf_files:
        raise LitError(
            f"no {weights_name()} in {str(checkpoint_dir)!r}, only Hugging Face weights: convert them with"
            f" python scripts/convert_hf_checkpoint.py --checkpoint_dir {checkpoint_dir}"
        )
    missing = checkpoint_dir / (filename or weights_name())
    raise LitError(
        f"{str(missing)!r} not found. Download and convert the model with: {download_command(checkpoint_dir)}"
    )


def _refused_global(message: str) -> Optional[str]:
    """The Python object a weights-only `torch.load` refused to import (e.g. `posix.system`), if that is the error."""
    m = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", message)
    if m:
        return m.group(1)
    if "Weights only load failed" in message:
        return "an object that is not a tensor"
    return None


def load_state_dict(path: Union[str, Path], mmap: bool = True) -> Dict[str, torch.Tensor]:
    """`torch.load` (memory-mapped, weights only) with a clear error for a missing, corrupt or truncated file,
    and for a pickle that would run code (refused, never loaded)."""
    path = location(path)
    if not path.is_file():
        raise LitError(f"checkpoint file {str(path)!r} not found")
    try:
        if is_url(path):  # a file in a bucket: read through fsspec (nothing to memory-map)
            with path.open("rb") as f:
                return torch.load(f, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except (RuntimeError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, OSError) as e:
        message = str(e).strip()
        refused = _refused_global(message) if isinstance(e, pickle.UnpicklingError) else None
        if refused is not None:
            # a pickle that imports a callable can run code when loaded: never load it, and never suggest it
            raise LitError(
                f"refusing to load {str(path)!r}: it is a pickle that imports {refused}, which could run code,"
                " so it is not a plain weights file. Use weights from a source you trust, or re-create the file"
                " by converting the model again"
            ) from None
        first = message.splitlines()[0] if message else type(e).__name__
        raise LitError(
            f"cannot read checkpoint {str(path)!r} (corrupt or truncated: {first}). Re-create it, e.g. by converting"
            " the model again"
        ) from e


def load_checkpoint(model: nn.Module, path: Union[str, Path], strict: bool = True, assign: bool = False) -> Any:
    """Load lit weights (`lit_gpt.weights.load_weights`: safetensors, a sharded index, or an earlier version's
    `.pth`) into `model`; a file that does not fit the model is one LitError line."""

    from lit_gpt.mxfp4 import holds_packed

    state_dict = load_weights(path, packed=holds_packed(model))  # packed experts for a model built to hold them
    state_dict = state_dict.get("model", state_dict)
    try:
        return model.load_state_dict(state_dict, strict=strict, assign=assign)
    except RuntimeError as e:
        raise LitError(
            f"checkpoint {str(path)!r} does not match the model config: {load_error_detail(e)}. Was it written for"
            " another model (check lit_config.json next to it)?"
        ) from e
