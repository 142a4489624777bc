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

`generation_fabric` and `generate_samples` are the body of the `generate/{full,adapter,adapter_v2,lora}.py`
recipes, which differ from `generate/base.py` only in how the model is loaded.
"""

import resource
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Type, Union

import torch
import torch.nn as nn

from lit_gpt.config import Config
from lit_gpt.generate import (
    check_lengths,
    check_model_dir,
    check_sampling_args,
    decode_one_token,
    generate,
    load_config,
)
from lit_gpt.model import GPT
from lit_gpt.utils import LitError, check_checkpoint_dir, load_state_dict, save_atomic

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
        first = str(e).strip().splitlines()[0]
        raise LitError(f"checkpoint {str(path)!r} does not match the model config ({first})") from e
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


# ---------------------------------------------------------------------------------------------------------------
# Generation with a finetuned model (what generate/{full,adapter,adapter_v2,lora}.py share)
# ---------------------------------------------------------------------------------------------------------------
def generation_fabric(accelerator: str = "auto", precision: Optional[str] = None):
    """A one-device Fabric for generation: bf16-true on GPUs that support it, else 32-true, unless given."""
    import lightning as L  # here: only the generation recipes need Lightning

    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if precision is None:
        precision = "bf16-true" if accelerator == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    if precision not in ("32-true", "bf16-true", "16-true"):
        raise LitError(f"--precision must be 32-true, bf16-true or 16-true for generation (got {precision!r})")
    return L.Fabric(devices=1, accelerator=accelerator, precision=precision)


def generate_samples(
    fabric: Any,
    load_model: Callable[[], GPT],
    checkpoint_dir: Path,
    prompt: str,
    *,
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    prompt_style: Optional[str] = None,
    seed: int = 1234,
    compile: bool = False,
) -> None:
    """Check the request, then `load_model()`, then print `num_samples` generations to stdout (timings and memory
    to stderr), as generate/base.py does. Every check on the user's input runs before the weights are read."""
    from lit_gpt.prompts import PromptStyle, Raw  # here: only the generation recipes need prompts and tokenizer
    from lit_gpt.tokenizer import Tokenizer

    if num_samples < 1:
        raise LitError(f"--num_samples must be >= 1 (got {num_samples})")
    check_sampling_args(temperature, top_k, top_p)
    check_model_dir(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_checkpoint(checkpoint_dir, prompt_style)
    encoded = tokenizer.encode(style.apply(prompt), device=fabric.device)
    check_lengths(encoded.numel(), max_new_tokens, load_config(checkpoint_dir).block_size)

    t0 = time.perf_counter()
    model = fabric.setup_module(load_model().eval())
    print(f"Loaded the model in {time.perf_counter() - t0:.2f} s", file=sys.stderr)

    # single-token stop sequences end generation on the device; the styles here have no longer ones
    stop_ids = [ids[0] for ids in style.stop_tokens(tokenizer) if len(ids) == 1]
    decode_fn = torch.compile(decode_one_token, dynamic=False) if compile else decode_one_token
    # the CPU reads the stop flag for free; on a GPU reading it every step would stall the queue of kernels
    chunk_size = 1 if fabric.device.type == "cpu" else 16
    fabric.seed_everything(seed)
    for i in range(num_samples):
        t0 = time.perf_counter()
        new_ids = generate(
            model, encoded, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids,
            chunk_size=chunk_size, decode_fn=decode_fn,
        ).tolist()  # a host read: the timing includes all of the device's work
        t = time.perf_counter() - t0
        print(tokenizer.decode(encoded.tolist() + new_ids if isinstance(style, Raw) else new_ids), flush=True)
        print(f"Sample {i + 1}: {len(new_ids)} tokens in {t:.02f} s, {len(new_ids) / t:.02f} tokens/s", file=sys.stderr)
    if fabric.device.type == "cuda":
        print(f"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB (max allocated)", file=sys.stderr)
    else:
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        print(f"Memory used: {peak_rss / 1e9:.02f} GB (peak RSS, includes the mapped weights)", file=sys.stderr)
