"""What the parameter-efficient variants (`lit_gpt.adapter`, `lit_gpt.adapter_v2`, `lit_gpt.lora`) share: the
finetuned-weights file and how a variant model is built from a base checkpoint plus that file.

A variant model keeps the base state-dict keys and only adds its own parameters (`...attn.adapter_wte.weight`,
`...attn.qkv.lora_A`, ...), so the base `lit_model.pth` loads into it unchanged with `strict=False`.

Finetuned-weights file (`torch.save` of a dict, written atomically by `save_finetuned`):
    {"method": "adapter" | "adapter_v2" | "lora",
     "config": {the variant's Config fields, e.g. "lora_r": 8, "lora_alpha": 16, ...},
     "model":  {parameter name: tensor} -- only the finetuned parameters}
`generate/{adapter,adapter_v2,lora}.py` and `scripts/merge_lora.py` read it with `load_finetuned`. Recipes that
save through Fabric write the same layout with
    fabric.save(path, {"model": model, **finetuned_metadata(model)}, filter={"model": finetuned_filter(model)})
"""

from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Type, Union

import torch
import torch.nn as nn

from lit_gpt.config import Config
from lit_gpt.config import load_config
from lit_gpt.model import GPT
from lit_gpt.utils import LitError, load_error_detail, check_checkpoint_dir, load_state_dict, save_atomic

METHODS = ("adapter", "adapter_v2", "lora")


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


def save_finetuned(model: nn.Module, path: Union[str, Path]) -> None:
    """Write only the finetuned weights (plus method and variant config) to `path`, atomically."""
    save_atomic({**finetuned_metadata(model), "model": finetuned_state_dict(model)}, path)


def load_finetuned(path: Union[str, Path], method: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(state dict, variant config fields) of a finetuned-weights file; a clear error for a file of another kind."""
    obj = load_state_dict(path, mmap=False)
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise LitError(f"{str(path)!r} is not a finetuned-weights file (no 'model' entry); pass the file that the"
                       f" {method} finetuning recipe wrote")
    found = obj.get("method")
    if found != method:
        if found in METHODS:
            raise LitError(f"{str(path)!r} holds {found} weights, not {method}: use generate/{found}.py")
        raise LitError(f"{str(path)!r} has no 'method' entry: it was not written by lit_gpt.peft.save_finetuned")
    return obj["model"], dict(obj.get("config") or {})


def load_variant_model(
    model_cls: Type[GPT],
    config_cls: Type[Config],
    checkpoint_dir: Union[str, Path],
    finetuned_path: Optional[Union[str, Path]] = None,
    **config_overrides: Any,
) -> GPT:
    """Build `model_cls` on the meta device and load the base `lit_model.pth`, then the finetuned file, with
    `assign=True`: no weight is allocated twice, and every tensor ends up as loaded (CPU, checkpoint dtype).

    Without `finetuned_path` the variant's own parameters keep no values (they stay on the meta device): use that
    form only to load into the variant afterwards (e.g. staged loading on XLA)."""
    base_path = check_checkpoint_dir(checkpoint_dir)
    state, fields_ = ({}, {}) if finetuned_path is None else load_finetuned(finetuned_path, model_cls.peft_method)
    try:
        config = config_cls.from_checkpoint(checkpoint_dir, **{**fields_, **config_overrides})
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise LitError(f"cannot build the {model_cls.peft_method} model from {str(checkpoint_dir)!r}: {e}") from e
    with torch.device("meta"):
        model = model_cls(config)
    own = {n for n, p in model.named_parameters(remove_duplicate=False) if model.peft_filter(n, p)}
    _load_part(model, load_state_dict(base_path), base_path, allowed_missing=own)
    if finetuned_path is not None:
        _load_part(model, state, Path(finetuned_path), allowed_missing=None)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise LitError(f"{str(finetuned_path)!r} lacks {len(left)} finetuned weights (e.g. {left[0]!r}): it does"
                           " not match the variant config it records")
    return model


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
    (a state dict, or `{"model": state dict, ...}` as finetune/full.py writes), built on the meta device."""
    config = load_config(checkpoint_dir)
    state = load_state_dict(checkpoint_path)
    if state.get("method") in METHODS:  # a finetuned-weights file of a PEFT method, not a whole model
        flag = "--lora_path" if state["method"] == "lora" else "--adapter_path"
        raise LitError(f"{str(checkpoint_path)!r} holds {state['method']} weights, not a whole model: use"
                       f" generate/{state['method']}.py {flag} {checkpoint_path}")
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
