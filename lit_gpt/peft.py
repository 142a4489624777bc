"""What the parameter-efficient variants (`lit_gpt.adapter`, `lit_gpt.adapter_v2`, `lit_gpt.lora`) share: the
finetuned-weights files and how a variant model is built from a base checkpoint plus them.

A variant model keeps the base state-dict keys and only adds its own parameters (`...attn.adapter_wte.weight`,
`...attn.qkv.lora_A`, ...), so the base `lit_model.safetensors` loads into it unchanged with `strict=False`.

Finetuned weights (`lit_gpt.weights` format), two files side by side, as `save_finetuned` / `export_finetuned`
write them:
    lit_model.<method>.safetensors  only the finetuned parameters, {parameter name: tensor}
    lit_model.<method>.json         {"format": "lit_gpt.finetuned", "version": 1, "method": "adapter" | "adapter_v2"
                                     | "lora", "config": {the variant's Config fields, e.g. "lora_r": 8, ...},
                                     "base": {"fingerprint": "sha256:...", "checkpoint_dir": "..."}}
`generate/{adapter,adapter_v2,lora}.py` and `scripts/merge_lora.py` read them with `load_finetuned`, which also
reads the single `torch.save` pickle that earlier versions wrote (`lit_model.pth.<method>`: `{"method", "config",
"model"}`), weights-only. "base" is the base model the weights were finetuned on (`lit_gpt.fingerprint`):
`load_variant_model` refuses another base in one line unless `allow_other_base`; files without it (earlier versions,
or saved without `base`) load without the check. The training loop picks what it saves with `finetuned_filter` and
records `finetuned_metadata` with it; its final export writes the same two files (`lit_gpt.export`).
"""

import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type, Union

import torch
import torch.nn as nn

from lit_gpt.config import Config
from lit_gpt.config import load_config
from lit_gpt.fingerprint import check_base
from lit_gpt.model import GPT
from lit_gpt.utils import LitError, cannot_write, load_error_detail
from lit_gpt.weights import check_checkpoint_dir, load_state_dict
from lit_gpt.weights import (
    finetuned_json,
    finetuned_stem,
    is_weights_file,
    load_weights,
    read_base_record,
    read_finetuned_metadata,
    save_finetuned_weights,
    weights_name,
)

METHODS = ("adapter", "adapter_v2", "lora")
PathLike = Union[str, Path]


def variant_fields(config: Config) -> Dict[str, Any]:
    """The fields a variant's Config adds to the base Config (what the finetuned file records)."""
    base = {f.name for f in fields(Config)}
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in base}


def base_config(config: Config, **overrides: Any) -> Config:
    """The plain `Config` of a variant config (for writing a standalone `lit_config.json`)."""
    kwargs = {k: v for k, v in config.to_dict().items() if k not in variant_fields(config)}
    kwargs.update(overrides)
    return Config(**kwargs)


def _finetuned_names(model: nn.Module) -> set:
    """The variant's own parameters (its `peft_filter`) plus anything else left trainable (e.g. LoRA biases)."""
    keep = {n for n, p in model.named_parameters() if p.requires_grad}
    keep |= {n for n, p in model.named_parameters(remove_duplicate=False) if model.peft_filter(n, p)}
    return keep


def finetuned_filter(model: nn.Module) -> Callable[[str, Any], bool]:
    """A `(key, value) -> bool` filter for `fabric.save(..., filter={"model": ...})`: the finetuned weights."""
    names = _finetuned_names(model)
    return lambda key, value: key in names


def finetuned_metadata(model: nn.Module) -> Dict[str, Any]:
    return {"method": model.peft_method, "config": variant_fields(model.config)}


def finetuned_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    names = _finetuned_names(model)
    return {k: v for k, v in model.state_dict().items() if k in names}


def finetuned_file_name(method: str) -> str:
    """`lit_model.<method>.safetensors`: the name of a method's finetuned weights in an output folder."""
    return weights_name(finetuned_stem(method))


def export_finetuned(state: Mapping[str, torch.Tensor], directory: PathLike, method: str,
                     config: Mapping[str, Any], base: Optional[Mapping[str, str]] = None) -> Path:
    """Write finetuned tensors (already picked, e.g. with `finetuned_filter`) and their JSON (method, the variant's
    config fields, the base model: `lit_gpt.fingerprint.base_record`) into `directory`. Returns the weights path
    (`finetuned_file_name(method)` in `directory`)."""
    if method not in METHODS:
        raise ValueError(f"unknown parameter-efficient method {method!r}; one of {', '.join(METHODS)}")
    try:
        return save_finetuned_weights(state, directory, method, config, base=base)
    except OSError as e:  # a full disk, a read-only folder: one line, and no partial weights file
        raise cannot_write(e, directory, finetuned_file_name(method)) from None


def save_finetuned(model: nn.Module, directory_or_path: PathLike, base: Optional[Mapping[str, str]] = None) -> Path:
    """Write only the finetuned weights (plus method, variant config and `base`, the base model's
    `lit_gpt.fingerprint.base_record`) of `model` into a folder, or to the path
    `<folder>/lit_model.<method>.safetensors` (a name with a suffix is taken for a file). Returns the weights
    path."""
    target = Path(directory_or_path)
    method = model.peft_method
    if target.suffix and not target.is_dir():
        if target.name != finetuned_file_name(method):  # e.g. an earlier version's lit_model.pth.lora
            raise ValueError(f"{method} weights are named {finetuned_file_name(method)}, not {target.name}: pass"
                             " their folder")
        target = target.parent
    meta = finetuned_metadata(model)
    return export_finetuned(finetuned_state_dict(model), target, meta["method"], meta["config"], base=base)


def _recipe(method: str, path: PathLike) -> str:
    flag = "--lora_path" if method == "lora" else "--adapter_path"
    return f"generate/{method}.py {flag} {path}"


_NAMED = re.compile(r"lit_model\.(\w+)\.safetensors(?:\.index\.json)?")


def load_finetuned(path: PathLike, method: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(state dict, variant config fields) of a method's finetuned weights: `lit_model.<method>.safetensors` (or the
    index of its shards) with its JSON beside it, or an earlier version's pickle. A file of another method, a whole
    model, or weights without their JSON are one LitError line that says what to run instead."""
    path = Path(path)
    if not is_weights_file(path):
        return _load_legacy_finetuned(path, method)
    if not path.is_file():
        raise LitError(f"finetuned weights {str(path)!r} not found: pass the {finetuned_file_name(method)} that"
                       f" finetune/{method}.py wrote")
    named = _NAMED.fullmatch(path.name)
    if not finetuned_json(path).is_file():
        if named is None or named.group(1) not in METHODS:  # e.g. lit_model.safetensors: a whole model
            raise LitError(f"{str(path)!r} is not a finetuned-weights file (no {finetuned_json(path).name} beside"
                           f" it): pass the {finetuned_file_name(method)} that finetune/{method}.py wrote")
        found = named.group(1)
        raise LitError(f"{str(path)!r} has no {finetuned_json(path).name} beside it (the method and its settings):"
                       f" copy it along with the weights as finetune/{found}.py wrote them, then use"
                       f" {_recipe(found, path)}")
    meta = read_finetuned_metadata(path)
    _check_method(path, meta["method"], method)
    return load_weights(path), dict(meta["config"])


def _check_method(path: Path, found: Any, method: str) -> None:
    if found == method:
        return
    if found in METHODS:
        raise LitError(f"{str(path)!r} holds {found} weights, not {method}: use {_recipe(found, path)}")
    raise LitError(f"{str(path)!r} records the method {found!r}, not one of {', '.join(METHODS)}: it was not written"
                   " by a finetuning recipe of this project")


def _load_legacy_finetuned(path: Path, method: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """An earlier version's finetuned file: a `torch.save` pickle of {"method", "config", "model"} (read-only)."""
    obj = load_state_dict(path, mmap=False)
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise LitError(f"{str(path)!r} is not a finetuned-weights file (no 'model' entry); pass the"
                       f" {finetuned_file_name(method)} that finetune/{method}.py wrote")
    if obj.get("method") is None:
        raise LitError(f"{str(path)!r} has no 'method' entry: it was not written by lit_gpt.peft.save_finetuned")
    _check_method(path, obj["method"], method)
    return obj["model"], dict(obj.get("config") or {})


def finetuned_method_of(path: PathLike, state: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """The parameter-efficient method whose finetuned weights `path` holds (its JSON, its name, or an earlier
    version's pickle entry `state["method"]`), or None for other weights (a whole model)."""
    path = Path(path)
    if is_weights_file(path):
        if finetuned_json(path).is_file():
            try:
                found = read_finetuned_metadata(path)["method"]
            except LitError:  # some other JSON beside a whole model's weights
                return None
            return found if found in METHODS else None
        named = _NAMED.fullmatch(path.name)
        return named.group(1) if named and named.group(1) in METHODS else None
    found = (state or {}).get("method")
    return found if found in METHODS else None


def load_variant_model(
    model_cls: Type[GPT],
    config_cls: Type[Config],
    checkpoint_dir: Union[str, Path],
    finetuned_path: Optional[Union[str, Path]] = None,
    allow_other_base: bool = False,
    **config_overrides: Any,
) -> GPT:
    """Build `model_cls` on the meta device and load the base weights, then the finetuned ones, with
    `assign=True`: no weight is allocated twice, and every tensor ends up as loaded (CPU, checkpoint dtype). Finetuned
    weights that record another base than `checkpoint_dir` holds are refused in one line before the base is read
    (`check_finetuned_base`; `allow_other_base`: a warning line instead).

    Without `finetuned_path` the variant's own parameters keep no values (they stay on the meta device): use that
    form only to load into the variant afterwards (e.g. staged loading on XLA)."""
    base_path = check_checkpoint_dir(checkpoint_dir)
    state, fields_ = ({}, {}) if finetuned_path is None else load_finetuned(finetuned_path, model_cls.peft_method)
    if finetuned_path is not None:
        check_finetuned_base(finetuned_path, checkpoint_dir, allow_other_base, model_cls.peft_method)
    try:
        config = config_cls.from_checkpoint(checkpoint_dir, **{**fields_, **config_overrides})
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise LitError(f"cannot build the {model_cls.peft_method} model from {str(checkpoint_dir)!r}: {e}") from e
    with torch.device("meta"):
        model = model_cls(config)
    own = {n for n, p in model.named_parameters(remove_duplicate=False) if model.peft_filter(n, p)}
    _load_part(model, load_weights(base_path), base_path, allowed_missing=own)
    if finetuned_path is not None:
        _load_part(model, state, Path(finetuned_path), allowed_missing=None)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise LitError(f"{str(finetuned_path)!r} lacks {len(left)} finetuned weights (e.g. {left[0]!r}): it does"
                           " not match the variant config it records")
    return model


def check_finetuned_base(finetuned_path: PathLike, checkpoint_dir: PathLike, allow_other_base: bool,
                         method: str) -> Optional[str]:
    """Refuse (one LitError line naming both) finetuned weights whose JSON records another base than the weights of
    `checkpoint_dir` (`lit_gpt.fingerprint.check_base`); an earlier version's file records none and passes. Returns
    the fingerprint of `checkpoint_dir`, or None when nothing was recorded."""
    path = Path(finetuned_path)
    recorded = read_base_record(path) if is_weights_file(path) else None  # an earlier version's pickle: none
    return check_base(recorded, checkpoint_dir, allow_other_base, f"the {method} weights file {str(path)!r}")


# settings a run may change from the weights it starts from: dropout acts in training only, the update is the same
_TRAINING_ONLY = ("lora_dropout",)


def check_init_from(path: PathLike, config: Config, checkpoint_dir: PathLike, allow_other_base: bool,
                    method: str, flag: str) -> Path:
    """The finetuned-weights file a run starts its method's parameters from (`flag`, e.g. --lora_init_from: a run's
    `lit_model.lora.safetensors`, its folder, or a PEFT adapter imported by `lit_gpt.peft_io.import_peft`), checked
    before anything loads: it must record the base in `checkpoint_dir` (`check_finetuned_base`; `allow_other_base`:
    a warning line) and the run's variant settings (`config`: r, alpha, the adapted layers), each refusal one line."""
    path = Path(path)
    if path.is_dir():
        if not (path / finetuned_file_name(method)).exists() and (path / "adapter_config.json").is_file():
            raise LitError(f"{flag} {str(path)!r} is a PEFT adapter folder: import it first with python"
                           f" scripts/convert_hf_checkpoint.py --checkpoint_dir {checkpoint_dir} --peft_path {path},"
                           f" then pass {str(path / finetuned_file_name(method))!r}")
        path = path / finetuned_file_name(method)
    _, recorded = load_finetuned(path, method)
    check_finetuned_base(path, checkpoint_dir, allow_other_base, method)
    defaults = {f.name: f.default for f in fields(config)}
    wanted = variant_fields(config)
    differ = {k: recorded.get(k, defaults[k]) for k in wanted
              if k not in _TRAINING_ONLY and recorded.get(k, defaults[k]) != wanted[k]}
    if differ:
        def cli(v: Any) -> str:
            return str(v).lower() if isinstance(v, bool) else str(v)

        theirs = " ".join(f"--{k} {cli(v)}" for k, v in differ.items())
        ours = ", ".join(f"--{k} {cli(wanted[k])}" for k in differ)
        raise LitError(f"{flag} {str(path)!r} holds a {method} of other settings than this run's ({ours}): pass"
                       f" {theirs} to continue it")
    return path


def _load_part(model: nn.Module, state: Dict[str, torch.Tensor], path: Path, allowed_missing: Optional[set]) -> None:
    state = state.get("model", state)
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise LitError(f"checkpoint {str(path)!r} does not match the model config ({load_error_detail(e)})") from e
    if result.unexpected_keys:
        raise LitError(f"checkpoint {str(path)!r} has weights the model lacks (e.g. {result.unexpected_keys[0]!r}):"
                       " it belongs to another model or variant config")
    if allowed_missing is not None:
        missing = [k for k in result.missing_keys if k not in allowed_missing]
        if missing:
            raise LitError(f"checkpoint {str(path)!r} lacks {len(missing)} base weights (e.g. {missing[0]!r})")


def load_full_finetuned(checkpoint_dir: Union[str, Path], checkpoint_path: Union[str, Path]) -> GPT:
    """The base architecture (`checkpoint_dir/lit_config.json`) with all weights from a full-finetuning file
    (`lit_model.safetensors` or its index as finetune/full.py writes; an earlier version's `.pth`: a state dict, or
    `{"model": state dict, ...}`), built on the meta device."""
    config = load_config(checkpoint_dir)
    state = load_weights(checkpoint_path)
    method = finetuned_method_of(checkpoint_path, state)
    if method is not None:  # a finetuned-weights file of a PEFT method, not a whole model
        raise LitError(f"{str(checkpoint_path)!r} holds {method} weights, not a whole model: use"
                       f" {_recipe(method, checkpoint_path)}")
    state = state["model"] if isinstance(state.get("model"), dict) else state
    head, wte = state.get("lm_head.weight"), state.get("transformer.wte.weight")
    if config.tie_embeddings and head is not None and wte is not None and not torch.equal(head, wte):
        # loading would silently re-tie the head to the embeddings
        raise LitError(f"{str(checkpoint_path)!r} has an lm_head of its own but {str(checkpoint_dir)!r} ties it to the"
                       " embeddings: pass the folder with the file's own lit_config.json to generate/base.py")
    with torch.device("meta"):
        model = GPT(config)
    _load_part(model, state, Path(checkpoint_path), allowed_missing=set())
    return model
