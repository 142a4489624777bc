"""The fingerprint of a base model's weights, and the check that finetuned weights are applied to the base they were
trained on.

    fingerprint("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")   # 'sha256:3f0c...' (16 hex digits)
    fingerprint_state(model_state)                                     # the same, from tensors in memory
    check_base(recorded_base(lora_path), checkpoint_dir, allow_other_base, "the lora weights 'final/...'")

What is hashed: for every tensor, sorted by name, its name and shape and a few slices of its values cast to float32
(integer tensors to int64): for a matrix its first, middle and last rows; in general the vectors along the last
dimension at the first, middle and last index of every other dimension, and of a vector (or a row) longer than
`3 * CHUNK` values its first, middle and last `CHUNK` values. Only those slices are read
(`safetensors.safe_open(...).get_slice`; an earlier version's `lit_model.pth` is memory-mapped), so a 70B model costs
a few MB of reads. The dtype is not hashed and the values are cast: a copy, a re-shard into any number of files, the
same tensors in a `.pth` pickle, or a bf16 checkpoint upcast to fp32 give the same fingerprint; a different value in
a sampled slice, or another shape, gives another. A tied head (`lm_head.weight` equal to `transformer.wte.weight`),
whether stored once (with its alias in the header, or not at all) or twice, is hashed once. Weights in a bucket (a
URL) are read whole (no partial reads there) and hashed the same way.

Where the fingerprint is recorded (`lit_gpt.weights`):
* parameter-efficient methods: `lit_model.<method>.json` has `"base": {"fingerprint": "sha256:...",
  "checkpoint_dir": "checkpoints/..."}`;
* full finetuning: the safetensors header metadata of `lit_model.safetensors` (the index's `"metadata"` when
  sharded) has `"lit_gpt.base_fingerprint"` and `"lit_gpt.base_checkpoint_dir"`.
Files of earlier versions record nothing: they are used without a check.
"""

import hashlib
import itertools
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from lit_gpt.storage import is_url, location
from lit_gpt.utils import LitError
from lit_gpt.weights import (
    INDEX_SUFFIX, SUFFIX, check_checkpoint_dir, is_weights_file, load_state_dict, load_weights, read_json,
)

PathLike = Union[str, Path]
CHUNK = 1024
"""Values read from each end and the middle of a vector (or row) longer than 3 * CHUNK."""
TIED = {"lm_head.weight": "transformer.wte.weight"}
"""A name hashed only where it differs from the other one: a tied head stored once or twice hashes the same."""
ALLOW_OTHER_BASE_HELP = (
    "Use the finetuned weights although --checkpoint_dir holds other base weights than they were finetuned on (their"
    " fingerprints differ): for experts who know the two bases are interchangeable."
)
"""The help of `--allow_other_base` on the recipes that apply finetuned weights to a base (generate, merge)."""

Index = Tuple[slice, ...]


def _samples(shape: Tuple[int, ...]) -> List[Index]:
    """The slices of a tensor of `shape` that are hashed (determined by the shape alone)."""
    if len(shape) == 0:
        return [()]
    if any(d == 0 for d in shape):
        return []

    def ends(n: int) -> List[int]:
        return sorted({0, n // 2, n - 1})

    last = shape[-1]
    if last <= 3 * CHUNK:
        tails = [slice(0, last)]
    else:
        mid = (last - CHUNK) // 2
        tails = [slice(0, CHUNK), slice(mid, mid + CHUNK), slice(last - CHUNK, last)]
    leading = [[slice(i, i + 1) for i in ends(d)] for d in shape[:-1]]
    return [(*lead, tail) for lead in itertools.product(*leading) for tail in tails]


def _canonical(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu")
    t = t.to(torch.float32) if (t.is_floating_point() or t.is_complex()) else t.to(torch.int64)
    return t.contiguous().numpy().tobytes()


def _entries(shapes: Mapping[str, Tuple[int, ...]], read: Any) -> Iterator[Tuple[str, Tuple[int, ...], List[bytes]]]:
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        yield name, shape, [_canonical(read(name, index)) for index in _samples(shape)]


def _digest(shapes: Mapping[str, Tuple[int, ...]], read: Any) -> str:
    entries = {name: (shape, data) for name, shape, data in _entries(shapes, read)}
    for name, other in TIED.items():
        if name in entries and other in entries and entries[name] == entries[other]:
            del entries[name]
    h = hashlib.sha256()
    for name, (shape, data) in entries.items():
        h.update(f"{name}\0{','.join(map(str, shape))}\0{len(data)}\n".encode())
        for chunk in data:
            h.update(len(chunk).to_bytes(8, "little"))
            h.update(chunk)
    return "sha256:" + h.hexdigest()[:16]


def fingerprint_state(state: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of weights in memory ({name: tensor}, whole tensors on any device, not DTensor shards; only the
    sampled slices are copied to the CPU): equal to `fingerprint` of a file that holds the same tensors. Pass the base
    weights only (as loaded from the checkpoint, before a cast to the training precision): a variant's own parameters
    or a bf16 cast of fp32 weights are other weights."""
    state = _unwrap(state)
    bad = [n for n, t in state.items() if not isinstance(t, torch.Tensor) or t.is_meta]
    if bad:
        raise ValueError(f"fingerprint_state needs tensors with values; {bad[0]!r} is not one")
    return _digest({n: tuple(t.shape) for n, t in state.items()}, lambda name, index: state[name][index])


def _unwrap(state: Mapping[str, Any]) -> Mapping[str, Any]:
    # an earlier version's pickle may hold {"model": state dict, ...}
    inner = state.get("model") if isinstance(state, Mapping) else None
    return inner if isinstance(inner, Mapping) else state


def fingerprint(checkpoint_dir_or_weights_path: PathLike) -> str:
    """The fingerprint of a base model's stored weights: a checkpoint folder (its `lit_model.safetensors`, the index of
    its shards, or an earlier version's `lit_model.pth`) or one of those files. A missing or unreadable file is one
    LitError line."""
    path = location(checkpoint_dir_or_weights_path)
    if not is_weights_file(path) and not path.is_file():
        path = check_checkpoint_dir(path)
    if is_url(path):  # no partial reads through fsspec here: read whole, hashed the same way
        return fingerprint_state(load_weights(path))
    if path.name.endswith(INDEX_SUFFIX):
        index = read_json(path, "weights index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LitError(f"weights index {str(path)!r} has no weight_map: re-create it")
        return _fingerprint_files({name: path.parent / shard for name, shard in weight_map.items()},
                                  index.get("metadata") or {})
    if path.name.endswith(SUFFIX):
        if not path.is_file():
            raise LitError(f"weights file {str(path)!r} not found")
        return _fingerprint_files(None, {}, single=path)
    return fingerprint_state(load_state_dict(path, mmap=True))  # an earlier version's torch.save file


def _fingerprint_files(where: Optional[Dict[str, Path]], aliases: Mapping[str, Any],
                       single: Optional[Path] = None) -> str:
    """Hash safetensors files through `safe_open(...).get_slice`: only the sampled slices are read."""
    from contextlib import ExitStack

    from safetensors import SafetensorError, safe_open

    try:
        with ExitStack() as stack:
            opened: Dict[Path, Any] = {}

            def handle(file: Path) -> Any:
                if file not in opened:
                    if not file.is_file():
                        raise LitError(f"the weights index names the shard {file.name!r}, which is missing: copy the"
                                       " whole folder")
                    opened[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                return opened[file]

            files = [single] if single is not None else sorted(set(where.values()))
            owner: Dict[str, Path] = {}
            meta: Dict[str, Any] = dict(aliases)
            for file in files:
                f = handle(file)
                meta.update(f.metadata() or {})
                for name in f.keys():
                    owner[name] = file
            if where is not None:
                missing = [n for n in where if n not in owner and n not in meta]
                if missing:
                    raise LitError(f"the weights index lists {missing[0]!r}, which no shard holds: re-create it")
            # names dropped because they shared storage with a kept tensor hash as that tensor
            source = {name: name for name in owner}
            for dropped, kept in meta.items():
                if isinstance(kept, str) and dropped not in source and kept in owner:
                    source[dropped] = kept
            slices = {name: handle(owner[kept]).get_slice(kept) for name, kept in source.items()}
            shapes = {name: tuple(s.get_shape()) for name, s in slices.items()}
            return _digest(shapes, lambda name, index: slices[name][index] if index else
                           handle(owner[source[name]]).get_tensor(source[name]))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        what = single if single is not None else "the shards of the index"
        raise LitError(f"cannot read weights {str(what)!r} (corrupt or truncated: {first}). Re-create it, e.g. by"
                       " converting the model again") from None


def base_record(checkpoint_dir: PathLike, fingerprint_value: Optional[str] = None) -> Dict[str, str]:
    """What a finetuned file records of its base: {"fingerprint": ..., "checkpoint_dir": ...} (pass the fingerprint
    when it is known already)."""
    return {"fingerprint": fingerprint_value or fingerprint(checkpoint_dir), "checkpoint_dir": str(checkpoint_dir)}


def check_base(recorded: Optional[Mapping[str, Any]], checkpoint_dir: PathLike, allow_other_base: bool, what: str,
               actual: Optional[str] = None) -> Optional[str]:
    """Refuse to apply what `what` names (e.g. "the lora weights file 'out/.../lit_model.lora.safetensors'") to the
    base in `checkpoint_dir` when the base it records (`recorded`: {"fingerprint", "checkpoint_dir"}) has another
    fingerprint: one LitError line that names both and the flag that overrides it. With `allow_other_base` a
    mismatch is one warning line on stderr instead. Nothing recorded (files of earlier versions): no check.
    `actual`: the fingerprint of `checkpoint_dir` if known. Returns the fingerprint of `checkpoint_dir` (None when
    nothing was recorded)."""
    if recorded is None:
        return None
    expected = recorded.get("fingerprint") if isinstance(recorded, Mapping) else None
    recorded_dir = recorded.get("checkpoint_dir") if isinstance(recorded, Mapping) else None
    if not isinstance(expected, str) or not expected:
        if allow_other_base:
            return None
        raise LitError(f"{what} records its base model unreadably ({recorded!r}): re-create it, or pass"
                       " --allow_other_base true to use it without the check")
    actual = actual or fingerprint(checkpoint_dir)
    if actual == expected:
        return actual
    named = f"{str(recorded_dir)!r} ({expected})" if recorded_dir else f"with the fingerprint {expected}"
    mismatch = (f"{what} records the base {named}, but --checkpoint_dir {str(checkpoint_dir)!r} holds"
                f" other weights ({actual})")
    if not allow_other_base:
        raise LitError(f"{mismatch}: pass the base it was finetuned on as --checkpoint_dir, or --allow_other_base true"
                       " if you know the two are interchangeable")
    print(f"warning: {mismatch}; using it anyway (--allow_other_base true)", file=sys.stderr)
    return actual
