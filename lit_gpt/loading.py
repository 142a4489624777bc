"""A converted checkpoint folder's model, loaded for inference: the folder checked with errors that say what to do
(`check_model_dir`), then the model built on the meta device and given the folder's weights (`load_model`).

A folder holds `lit_model.safetensors` (or its shards with an index, or an earlier version's `lit_model.pth`; see
`lit_gpt.weights`) and `lit_config.json`. The finetuned weights of a parameter-efficient method
(`lit_model.lora.safetensors`, or an earlier version's `lit_model.pth.lora`) are not a model: they need their base
model, through the method's generate recipe (`check_checkpoint_dir` says which). The variant models are loaded by
`lit_gpt.peft`.
"""

import difflib
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from lit_gpt.config import Config, load_config, with_rope_scaling
from lit_gpt.model import GPT
from lit_gpt.utils import LitError, download_command
from lit_gpt.weights import check_checkpoint_dir, load_checkpoint

PathLike = Union[str, Path]


def check_model_dir(checkpoint_dir: PathLike) -> Path:
    """The weights file of a model folder, or one LitError line that says what to do: `check_checkpoint_dir`'s (how
    to download or convert the model; the recipe to use for a folder of finetuned weights only), plus the nearest
    known model names when the folder does not exist and its name is not a known model (a typo in
    --checkpoint_dir)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir() and checkpoint_dir.name not in Config.names():
        close = difflib.get_close_matches(checkpoint_dir.name, Config.names(), n=3, cutoff=0.5)
        if close:
            raise LitError(
                f"checkpoint directory {str(checkpoint_dir)!r} does not exist and {checkpoint_dir.name!r} is not a"
                f" known model name. Did you mean: {', '.join(close)}? Then download it with:"
                f" {download_command(checkpoint_dir.with_name(close[0]))}"
            )
    return check_checkpoint_dir(checkpoint_dir)


def load_model(checkpoint_dir: PathLike, quantize: Optional[str] = None) -> GPT:
    """Build the model on the meta device and assign the weights as read (memory-mapped: they exist once, in the page
    cache, instead of once initialised and once loaded). Tied embeddings stay one tensor. In eval mode. `quantize`:
    the run's --quantize; with "mxfp4" the experts are built packed (`lit_gpt.mxfp4.packed_shells`) and take the
    checkpoint's MXFP4 bytes as they are (the float experts are never made); other modes apply after loading."""
    path = check_model_dir(checkpoint_dir)
    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        model = GPT(config)
    if quantize == "mxfp4":
        from lit_gpt.mxfp4 import packed_shells

        packed_shells(model)
    load_checkpoint(model, path, assign=True)
    return model.eval()


def scale_rope(model: GPT, scaling: Optional[Mapping[str, Any]]) -> GPT:
    """--rope_scaling: `model`'s context extended (`lit_gpt.config.with_rope_scaling`, whose ValueErrors are one line)
    in the Config every module shares, and its RoPE tables rebuilt on the host and moved (on XLA a transfer, not a
    computation folded into the first graph). None: the model as it is."""
    if scaling:
        scaled = with_rope_scaling(model.config, scaling)
        model.config.rope_scaling, model.config.block_size = scaled.rope_scaling, scaled.block_size
        device = model.cos.device
        model.reset_rope_cache(None if model.cos.is_meta else torch.device("cpu"))
        model.cos, model.sin = model.cos.to(device), model.sin.to(device)
    return model
