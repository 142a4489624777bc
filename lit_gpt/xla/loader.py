"""Loading a checkpoint onto XLA devices block by block, so that host RAM stays low.

    model = load_staged(config, checkpoint_dir / "lit_model.safetensors", fabric)
    model = load_staged(lambda: GPT(config), [base_path, adapter_path], fabric, strict=False)  # adapters, LoRA

The model is built on the meta device (no memory). Then for each transformer block in turn, only that block's
tensors are read from the checkpoint (`safe_open` per tensor for `.safetensors` files and the shards a
`.safetensors.index.json` names; `torch.load(..., mmap=True, weights_only=True)` for an earlier version's `.pth`),
and sent to the devices already sharded the way FSDPv2 shards them (largest dimension over the "fsdp" axis, so no
device ever holds a full copy): each device's shard is sliced from the mapped file and cast to
the parameter dtype on the way (one host copy per shard, none for a contiguous shard that needs no cast), handed to
torch_xla as that device's data (`_global_tensor_from_cpu_shards`), and dropped once transferred; then the
embeddings, final norm and head. The loader waits for each large transfer before the next (under SPMD; on one
device torch_xla's wait can return before the copy ends, so two can overlap). torch_xla 2.9 copies every host
shard it is handed once more before transferring it, so a tensor is in host memory once while it is placed (no
cast) or twice (cast: the loader's shards and torch_xla's copies). Host memory above the final resident size
therefore stays within about the larger of one block and one (no cast) or two (cast) copies of the largest
tensor; only models whose embedding outweighs a block (SmolLM2, Llama 3, Gemma) reach the tensor term
(bench/load.py measures every combination).

gpt-oss's experts, which a converted checkpoint keeps packed in MXFP4 (`lit_gpt.mxfp4`), are read in the form the
model holds them, one projection at a time (`_Sources.fit_mxfp4`): decoded for float experts, or, with
`quantize="mxfp4"`, as the file's uint8 blocks and scales, sharded as the expert weight they stand for would be.

Parameters that are not in any checkpoint (new adapter or LoRA weights) are initialised by their module's
`reset_parameters()`; tied parameters (`lm_head.weight` / `transformer.wte.weight`) stay one tensor.
`fabric.setup(model, ...)` afterwards wraps the blocks without moving or resharding anything.
"""

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn

from lit_gpt.config import Config
from lit_gpt.utils import LitError
from lit_gpt.weights import load_state_dict
from lit_gpt.weights import INDEX_SUFFIX, SUFFIX, read_json

PathLike = Union[str, Path]


class _Sources:
    """Key -> tensor lookup over one or more weights files; a later file overrides an earlier one.

    safetensors files (one file, or the shards an index names) are opened with `safe_open` once per tensor taken:
    it maps the file, so the tensor is read from the page cache, not copied into anonymous memory, and its mapping
    ends with the tensor once it is placed (one handle kept open for the whole load would keep every page it had
    touched resident, the whole file by the end). Names stored once for several (a tied head: `lit_gpt.weights`'
    aliases) resolve to the kept tensor. An earlier version's `.pth` is memory-mapped with `torch.load(mmap=True)`."""

    def __init__(self, paths: Sequence[PathLike]) -> None:
        self._where: Dict[str, Tuple[str, Any, str]] = {}  # name -> (kind, file path or state dict, key in it)
        self._handles: List[Any] = []
        self._decoded: Dict[str, Tuple[str, Any, str]] = {}  # MXFP4 (`fit_mxfp4`): float experts to pack
        self._packed_half: Dict[str, torch.Tensor] = {}  # the half of a packed projection not yet placed
        for path in paths:
            path = Path(path)
            if path.name.endswith(INDEX_SUFFIX):
                index = read_json(path, "weights index")
                weight_map = index.get("weight_map")
                if not isinstance(weight_map, dict) or not weight_map:
                    raise LitError(f"weights index {str(path)!r} has no weight_map: re-create it")
                for shard in sorted(set(weight_map.values())):
                    self._add_safetensors(path.parent / shard, named_by=path)
                self._add_aliases(index.get("metadata") or {})
            elif path.name.endswith(SUFFIX):
                self._add_safetensors(path)
            else:
                sd = load_state_dict(path, mmap=True)  # memory-mapped: nothing is read until a tensor is used
                sd = sd.get("model", sd)
                self._handles.append(sd)
                for key in sd:
                    self._where[key] = ("dict", sd, key)

    def _add_safetensors(self, path: Path, named_by: Optional[Path] = None) -> None:
        from safetensors import SafetensorError, safe_open

        if not path.is_file():
            if named_by is not None:
                raise LitError(f"{str(named_by)!r} names the shard {path.name!r}, which is missing: copy the whole"
                               " folder")
            raise LitError(f"checkpoint file {str(path)!r} not found")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:  # the header only
                keys, meta = list(f.keys()), f.metadata() or {}
        except (SafetensorError, OSError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise LitError(f"cannot read weights {str(path)!r} (corrupt or truncated: {first}). Re-create it, e.g."
                           " by converting the model again") from None
        for key in keys:
            self._where[key] = ("safetensors", str(path), key)
        self._add_aliases(meta)

    def _add_aliases(self, meta: Dict[str, Any]) -> None:
        # a name the file dropped because it shared storage with a kept tensor reads that tensor
        for dropped, kept in meta.items():
            if isinstance(kept, str) and dropped not in self._where and kept in self._where:
                kind, source, key = self._where[kept]
                if kind == "safetensors":
                    self._where[dropped] = (kind, source, key)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def take(self, key: str) -> torch.Tensor:
        kind, source, name = self._where.pop(key)
        if kind == "decode":  # a packed MXFP4 projection read as the float weight of a model of float experts
            from lit_gpt.mxfp4 import fit_state

            return fit_state({f"{source}.{k}": self._read(*name[k]) for k in name}, where="the checkpoint")[key]
        if kind == "pack":  # the other way: a decoded projection packed (both halves made at once, one kept)
            if key not in self._packed_half:
                from lit_gpt.mxfp4 import fit_state

                packed = fit_state({f"{source}.weight": self._read(*self._decoded.pop(source))}, packed=True)
                self._packed_half.update({f"{source}.{h}": packed[f"{source}.{h}"] for h in ("blocks", "scales")})
            return self._packed_half.pop(key)
        return self._read(kind, source, name, pop=True)

    def _read(self, kind: str, source: Any, name: str, pop: bool = False) -> torch.Tensor:
        if kind == "safetensors":
            from safetensors import safe_open

            with safe_open(source, framework="pt", device="cpu") as f:
                return f.get_tensor(name)
        # pop: drop the dict's reference, the mapped pages can go once the tensor is placed
        return source.pop(name) if pop else source[name]

    def fit_mxfp4(self, wanted: Iterable[str]) -> None:
        """gpt-oss's experts in the form the model holds them (`lit_gpt.mxfp4.fit_state`'s rule, one projection at a
        time as it is placed): a packed file's `.blocks` / `.scales` read as the decoded `.weight` of a model of float
        experts (in its bias's dtype), a decoded file's `.weight` packed for a model of `MXFP4ExpertLinear`s."""
        from lit_gpt.mxfp4 import packed_prefixes

        wanted = set(wanted)
        for prefix in packed_prefixes(dict.fromkeys(self._where)):
            if f"{prefix}.weight" in wanted and f"{prefix}.blocks" not in wanted:
                parts = {"blocks": self._where.pop(f"{prefix}.blocks")}
                if f"{prefix}.scales" in self._where:
                    parts["scales"] = self._where.pop(f"{prefix}.scales")
                if f"{prefix}.bias" in self._where:  # read, not taken: the decoded weight takes its dtype
                    parts["bias"] = self._where[f"{prefix}.bias"]
                self._where[f"{prefix}.weight"] = ("decode", prefix, parts)  # type: ignore[assignment]
        for key in [k for k in self._where if k.endswith(".weight")]:
            prefix = key[: -len(".weight")]
            if f"{prefix}.blocks" in wanted and f"{prefix}.blocks" not in self._where:
                self._decoded[prefix] = self._where.pop(key)
                for half in ("blocks", "scales"):
                    self._where[f"{prefix}.{half}"] = ("pack", prefix, prefix)


def _fsdp_spec(t: torch.Tensor) -> Tuple[Optional[str], ...]:
    """The partition spec FSDPv2 gives a parameter: its largest dimension over "fsdp" (scalars replicated)."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    return _prepare_spmd_partition_spec(t, shard_maximal=True)


def _resolve_target(fabric: Any, mesh: Any, dtype: Optional[torch.dtype], device: Any) -> Tuple[Any, Any, Any]:
    if fabric is not None:
        from lit_gpt.xla.strategy import get_strategy

        strategy = get_strategy(fabric)
        mesh = mesh if mesh is not None else strategy.mesh
        dtype = dtype if dtype is not None else strategy.precision.param_dtype
        device = device if device is not None else strategy.root_device
    if device is None:
        import torch_xla

        device = torch_xla.device()
    return mesh, dtype, device


def load_staged(
    model: Union[Config, Callable[[], nn.Module]],
    checkpoint: Union[PathLike, Sequence[PathLike]],
    fabric: Optional[Any] = None,
    *,
    mesh: Optional[Any] = None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
    layer_cls: Optional[Iterable[Type[nn.Module]]] = None,
    strict: bool = True,
    progress: bool = True,
    allow_missing: Optional[Callable[[str], bool]] = None,
    quantize: Optional[str] = None,
) -> nn.Module:
    """Build `model` (a `Config` for `GPT`, or a function returning a module) on the meta device and fill it
    from `checkpoint` (one file or several, later ones override) block by block onto the XLA devices.

    With `fabric` (from `make_fabric`, launched) the mesh, device and parameter dtype come from it; otherwise
    pass `device` (default: the XLA device), `mesh` (None: no sharding) and `dtype` (None: keep the file's).
    `strict=False` allows checkpoint keys the model does not have. A tensor missing from every checkpoint is an
    error unless `allow_missing(name)` says the variant adds it itself (adapter / LoRA parameters): those are
    initialised by their module's `reset_parameters()`. The rule is the CPU/GPU recipes' (one line naming the
    missing tensors): a base checkpoint that lacks a base weight is refused, never filled with random values.
    `quantize="mxfp4"`: gpt-oss's experts stay packed (`lit_gpt.mxfp4.packed_shells`): the file's uint8 blocks and
    scales go to the devices as they are, sharded as the expert weights they stand for would be; otherwise a packed
    file's experts are decoded one projection at a time on the way (`_Sources.fit_mxfp4`)."""
    from tqdm import tqdm

    mesh, dtype, device = _resolve_target(fabric, mesh, dtype, device)
    if isinstance(model, Config):
        from lit_gpt.model import GPT

        config = model
        model_fn: Callable[[], nn.Module] = lambda: GPT(config)
    else:
        model_fn = model
    with torch.device("meta"):
        module = model_fn()
    if quantize == "mxfp4":
        from lit_gpt.mxfp4 import packed_shells

        packed_shells(module)
    if layer_cls is None:
        from lit_gpt.model import Block

        layer_cls = {Block}
    layer_cls = tuple(layer_cls)

    paths = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
    sources = _Sources(paths)

    # tied parameters: every name of one Parameter, so it is loaded once and assigned under all its names
    names_of: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    # the bookkeeping is by id(): every tensor it has seen stays referenced until the end, so that no id is
    # reused by a new tensor while loading (which would alias two parameters)
    keepalive: List[Any] = [p for _, p in module.named_parameters(remove_duplicate=False)]

    units = [(name, m) for name, m in module.named_modules() if isinstance(m, layer_cls)]
    unit_names = [n for n, _ in units]

    def owner_unit(name: str) -> Optional[str]:
        for u in unit_names:
            if name.startswith(u + "."):
                return u
        return None

    # every tensor (parameters and persistent buffers) grouped by unit; the rest (embeddings, norms, head) last
    plan: Dict[Optional[str], List[Tuple[str, bool]]] = {u: [] for u in unit_names}
    plan[None] = []
    for name, p in module.named_parameters():
        plan[owner_unit(name)].append((name, True))
    persistent = set(module.state_dict(keep_vars=True).keys())
    for name, b in module.named_buffers():
        if name in persistent:
            plan[owner_unit(name)].append((name, False))

    expected_keys = persistent  # parameters under all their names, and persistent buffers
    sources.fit_mxfp4(expected_keys)
    unexpected = sorted(k for k in sources.keys() if k not in expected_keys)
    if unexpected and strict:
        raise LitError(
            f"the checkpoint has tensors the model does not ({_few(unexpected)}): check that the model config"
            " matches the checkpoint (lit_config.json)"
        )

    missing = sorted(
        name for name in expected_keys
        if _source_key(name, names_of.get(id(_lookup(module, name)), [name]), sources) is None
    )
    not_allowed = [n for n in missing if allow_missing is None or not allow_missing(n)]
    if not_allowed:
        raise LitError(
            f"the checkpoint lacks {len(not_allowed)} weight(s) of the model ({_few(not_allowed)}): it does not"
            " match the model config (lit_config.json), or it is not a complete base checkpoint"
        )

    placed: Dict[int, nn.Parameter] = {}
    order = unit_names + [None]
    bar = tqdm(order, desc="loading", unit="block", disable=not progress or not _print_rank())
    for unit in bar:
        bar.set_postfix_str(unit or "embeddings, norms, head")
        entries = plan[unit]
        fresh = _init_missing(module, entries, sources, names_of)
        keepalive.extend(fresh.values())
        for name, is_param in entries:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            old = getattr(owner, attr)
            if is_param and id(old) in placed:
                setattr(owner, attr, placed[id(old)])
                continue
            key = _source_key(name, names_of.get(id(old), [name]) if is_param else [name], sources)
            if key is not None:
                cpu = sources.take(key)
            elif name in fresh:
                cpu = fresh.pop(name)
            else:
                raise LitError(f"the checkpoint has no tensor {name!r} and its module cannot initialise it")
            if tuple(cpu.shape) != tuple(old.shape):
                raise LitError(
                    f"checkpoint tensor {name} has shape {tuple(cpu.shape)} but the model's is {tuple(old.shape)}:"
                    " the model config does not match the checkpoint"
                )
            target = dtype if dtype is not None and cpu.is_floating_point() else cpu.dtype
            nbytes = cpu.numel() * target.itemsize
            # casts on the way: per shard when sharded (MXFP4 blocks / scales as the weight they stand for)
            xt = _to_device(cpu, device, mesh, target, _packed_spec(old, owner, attr) if mesh is not None else None)
            del cpu
            if nbytes >= _TRIM_BYTES and str(device).startswith("xla"):
                import torch_xla.core.xla_model as xm

                # transfers are asynchronous: without waiting, a whole block's staging copies can be in flight
                xm.wait_device_ops()
                _release_host_memory()
            if is_param:
                param = nn.Parameter(xt, requires_grad=old.requires_grad)
                for alias in names_of.get(id(old), [name]):
                    a_owner_name, _, a_attr = alias.rpartition(".")
                    a_owner = module.get_submodule(a_owner_name) if a_owner_name else module
                    setattr(a_owner, a_attr, param)
                placed[id(old)] = param
                keepalive.append(old)
            else:
                owner._buffers[attr] = xt
    if mesh is not None or str(device).startswith("xla"):
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()  # transfers run asynchronously: their staging buffers are freed once they finish
    _release_host_memory()
    del keepalive  # only meta tensors and the placed ones' old objects: no memory
    if hasattr(module, "reset_rope_cache"):
        # the RoPE tables (non-persistent buffers, built on meta with the model): built on the host, transferred
        from lit_gpt.xla.runtime import set_rope_length

        set_rope_length(module, module.max_seq_length)
    still_meta = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if still_meta:
        raise LitError(
            f"{len(still_meta)} tensor(s) were neither in the checkpoint nor initialisable ({_few(still_meta)})"
        )
    return module


def _lookup(module: nn.Module, name: str) -> Any:
    owner_name, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner_name) if owner_name else module, attr)


def _source_key(name: str, aliases: List[str], sources: _Sources) -> Optional[str]:
    if name in sources:
        return name
    for alias in aliases:
        if alias in sources:
            return alias
    return None


def _init_missing(
    module: nn.Module, entries: List[Tuple[str, bool]], sources: _Sources, names_of: Dict[int, List[str]]
) -> Dict[str, torch.Tensor]:
    """CPU values for this unit's tensors that no checkpoint has, from their module's `reset_parameters()`."""
    missing: Dict[str, List[str]] = {}
    for name, is_param in entries:
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        aliases = names_of.get(id(getattr(owner, attr)), [name]) if is_param else [name]
        if _source_key(name, aliases, sources) is None:
            missing.setdefault(owner_name, []).append(attr)
    fresh: Dict[str, torch.Tensor] = {}
    for owner_name, attrs in missing.items():
        owner = module.get_submodule(owner_name) if owner_name else module
        if not hasattr(owner, "reset_parameters"):
            names = [f"{owner_name}.{a}" if owner_name else a for a in attrs]
            raise LitError(
                f"the checkpoint has no {_few(names)} and {type(owner).__name__} has no reset_parameters() to"
                " initialise it: check that the model config matches the checkpoint"
            )
        # materialise only the missing tensors on the CPU: the rest stays on meta, where the init ops are no-ops,
        # so a LoRA layer does not allocate (and randomly initialise) the big base weight it is about to receive
        for a in attrs:
            old = getattr(owner, a)
            cpu = torch.empty_like(old, device="cpu")
            if a in owner._parameters:
                owner._parameters[a] = nn.Parameter(cpu, requires_grad=old.requires_grad)
            else:
                owner._buffers[a] = cpu
        with torch.no_grad():
            owner.reset_parameters()
        for a in attrs:
            fresh[f"{owner_name}.{a}" if owner_name else a] = getattr(owner, a).detach()
    return fresh


_TRIM_BYTES = 1 << 20


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def _release_host_memory() -> None:
    """Give freed host buffers back to the OS.

    A sharded transfer copies each shard on torch_xla's worker threads; glibc keeps what they free in per-thread
    arenas, which would stay in the process's resident memory (~40% of the model in bench/load.py) and be
    reused only by chance. Without glibc this is a no-op."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _packed_spec(old: torch.Tensor, owner: nn.Module, attr: str) -> Optional[Tuple[Optional[str], ...]]:
    """The partition spec of an MXFP4 expert projection's `blocks` (E, out, G, 16) or `scales` (E, out, G): the spec
    FSDPv2 gives the (E, out, in) weight they stand for, its in dim as the G groups (each device then decodes its
    own rows or groups: no gather before the matmul); None for any other tensor."""
    from lit_gpt.mxfp4 import PACKED, MXFP4ExpertLinear

    if not isinstance(owner, MXFP4ExpertLinear) or attr not in PACKED:
        return None
    spec = _fsdp_spec(torch.empty(owner.n_expert, owner.out_features, owner.in_features, device="meta"))
    return tuple(spec) + (None,) * (old.dim() - 3)


def _to_device(cpu: torch.Tensor, device: torch.device, mesh: Any, dtype: torch.dtype,
               spec: Optional[Tuple[Optional[str], ...]] = None) -> torch.Tensor:
    """`cpu` (usually mapped file pages) as `dtype` on the device(s); sharded the FSDPv2 way over `mesh` if given.

    Host memory: torch_xla's own sharded transfer (`send_cpu_data_to_device` with a sharding spec) copies the
    tensor into per-device shards; casting the whole tensor before it held a second full-size host copy beside
    those. Here each device's shard is sliced from the source and cast once, and those shards go straight to the
    transfer: the loader's cost is one host copy of the tensor for a cast, none for an uncast shard that is a
    contiguous view of the mapped file. torch_xla 2.9 adds one copy of its own to either (its AtenSource copies
    every shard, `copy=true`, before the transfer starts), which no caller can avoid."""
    if mesh is None or cpu.dim() == 0:
        return cpu.to(dtype).to(device)  # one device: torch_xla copies what it is given (the cast, or the file's view)
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    spec = spec if spec is not None else _fsdp_spec(cpu)
    if cpu.dim() == 1:
        # torch_xla 2.9's direct sharded transfer fails for 1-D tensors on a mesh with a replicated axis
        # ("too many indices"); these are norms and biases, small enough to place first and shard after
        xt = cpu.to(dtype).to(device)
        xs.mark_sharding(xt, mesh, spec)
        return xt
    shards = _host_shards(cpu, mesh, spec, dtype)
    if shards is None:  # a mesh over several hosts: torch_xla's own sharded transfer, after a full-size cast
        return xm.send_cpu_data_to_device([cpu.to(dtype)], device, xs.ShardingSpec(mesh, spec))[0]
    # straight from host memory into per-device shards: no device ever holds the whole tensor
    import torch_xla

    return torch_xla._XLAC._global_tensor_from_cpu_shards(shards, mesh.get_op_sharding(spec), list(cpu.shape))


def _host_shards(
    cpu: torch.Tensor, mesh: Any, spec: Tuple[Optional[str], ...], dtype: torch.dtype
) -> Optional[List[torch.Tensor]]:
    """One host tensor per device (in device order) holding that device's shard of `cpu` as `dtype`, padded with
    zeros at the end of a dimension that does not divide evenly (as torch_xla pads); devices that hold the same
    shard (replicas over an unsharded mesh axis) share one tensor. A contiguous shard that needs no cast is a
    view of `cpu` (no copy). None when some devices belong to other processes (multi-host meshes)."""
    import numpy as np
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    if xr.addressable_runtime_device_count() != n or any(not (a is None or isinstance(a, str)) for a in spec):
        return None
    ids = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
    shards: List[torch.Tensor] = []
    made: Dict[Tuple[Tuple[int, int], ...], torch.Tensor] = {}
    for device_id in range(n):
        coords = [int(c[0]) for c in np.nonzero(ids == device_id)]
        bounds = []  # (start, stop, padded length) per dimension
        for size, axis in zip(cpu.shape, spec):
            if axis is None:
                bounds.append((0, size, size))
                continue
            k = mesh.mesh_shape[mesh.axis_names.index(axis)]
            step = -(-size // k)
            start = min(coords[mesh.axis_names.index(axis)] * step, size)
            bounds.append((start, min(start + step, size), step))
        key = tuple((b[0], b[1]) for b in bounds)
        if key not in made:
            view = cpu[tuple(slice(b[0], b[1]) for b in bounds)]
            padded = [b[2] for b in bounds]
            if list(view.shape) != padded:
                shard = torch.zeros(padded, dtype=dtype)
                shard[tuple(slice(0, s) for s in view.shape)] = view  # copy_ casts
            else:
                shard = view.to(dtype).contiguous()  # one copy if it casts or is strided, none otherwise
            made[key] = shard
        shards.append(made[key])
    return shards


def _print_rank() -> bool:
    try:
        import torch_xla.runtime as xr

        return xr.process_index() == 0
    except Exception:
        return True


def _few(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
