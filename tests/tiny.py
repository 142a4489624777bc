"""The tiny Llama-style model the tests build (2 layers, 4 heads in 2 query groups, RMSNorm, the LLaMA MLP, tied
embeddings), defined once: a test states only what it changes, as keyword overrides.

    config = tiny_llama_config(vocab_size=320)                   # a lit_gpt.Config
    config = tiny_llama_config(lora.Config, lora_r=2, lora_alpha=4)
    write_checkpoint(random_model(config), directory)            # lit_model.safetensors + lit_config.json
"""

import shutil
from pathlib import Path
from typing import Any, Optional, Type

import torch

from lit_gpt import GPT, Config

TINY = dict(name="tiny-llama", block_size=64, vocab_size=256, n_layer=2, n_head=4, n_query_groups=2, n_embd=64,
            intermediate_size=128, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", tie_embeddings=True)


def tiny_llama_config(config_cls: Optional[Type[Config]] = None, **overrides: Any) -> Config:
    """`TINY` with `overrides`, as `config_cls` (lit_gpt.Config; a variant's Config takes its own fields too)."""
    return (config_cls or Config)(**{**TINY, **overrides})


def random_model(config: Config, seed: int = 0) -> GPT:
    """A `GPT(config)` initialised as lit_gpt initialises one, the same for the same seed."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.apply(model._init_weights)
    return model


def write_checkpoint(model: GPT, directory: Path) -> Path:
    """A lit checkpoint folder: the model's weights (the project's format, `lit_gpt.weights`) and its config
    (tokenizer files are the caller's)."""
    from lit_gpt.weights import save_weights

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_weights(model.state_dict(), directory)
    model.config.save(directory)
    return directory


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def make_tiny_checkpoint(directory: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny Llama-style checkpoint that uses the real SmolLM2 tokenizer (vocab 49152)."""
    config = tiny_llama_config(**{"block_size": 256, "vocab_size": 49152, **overrides})
    write_checkpoint(random_model(config, seed), directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory
