"""Generation on XLA devices: the XLA recipes' loading and set-up around the one generation loop.

The loop itself is `lit_gpt.generate.generate_stream` (the same code as on the CPU and CUDA); `XLARuntime`
(lit_gpt/xla/runtime.py) gives it what keeps the graphs fixed: prompts padded on the host to power-of-two
buckets, caches built on the host and transferred replicated, a graph cut per step, host reads as transfers.
Result: two compilations per prompt-length bucket (prefill + decode), whatever max_new_tokens is.

    runtime = XLARuntime(fabric)
    model = fabric.setup_module(load_staged(config, checkpoint_dir / "lit_model.pth", fabric))
    result = timed_generate(model, tokenizer.encode(prompt), 50, runtime, stop_ids=tokenizer.stop_ids)
    result.tokens, result.time_to_first_token, result.decode_tokens_per_sec, result.compiles
"""

from pathlib import Path
from typing import Any, Callable, List, Optional

import torch.nn as nn

from lit_gpt.model import GPT


def default_precision(precision: Optional[str]) -> str:
    """The generation recipes' precision: bf16-true on TPUs, else 32-true (no mixed precision: no training)."""
    from lit_gpt.xla.accelerator import default_precision as choose

    return choose(precision, ("32-true", "bf16-true"), "for generation on XLA")


def load_variant_staged(
    fabric: Any, model_cls: Any, config_cls: Any, checkpoint_dir: Path, finetuned_path: Path
) -> GPT:
    """An Adapter / LoRA model (`lit_gpt.adapter.GPT`, `lit_gpt.lora.GPT`, ...) with the base weights and the
    finetuned-weights file (`lit_gpt.peft` format) loaded block by block onto the devices. The variant's settings
    (e.g. lora_r) come from the file; nothing may be missing from the two files together. LoRA updates are merged
    into the weights, as on the CPU/GPU: generation runs at the base model's cost."""
    from lit_gpt.lora import GPT as LoRAGPT
    from lit_gpt.lora import merge_lora_weights
    from lit_gpt.peft import load_finetuned
    from lit_gpt.utils import check_checkpoint_dir
    from lit_gpt.xla.loader import load_staged

    base_path = check_checkpoint_dir(checkpoint_dir)
    _, fields = load_finetuned(finetuned_path, model_cls.peft_method)  # also checks the file's method
    config = config_cls.from_checkpoint(checkpoint_dir, **fields)
    # the later file overrides: the finetuned weights on top of the base checkpoint
    model = load_staged(lambda: model_cls(config), [base_path, finetuned_path], fabric)
    if isinstance(model, LoRAGPT):
        merge_lora_weights(model)
    return model


def generate_samples(fabric: Any, load_model: Callable[[], nn.Module], checkpoint_dir: Path, prompt: str,
                     **sampling: Any) -> List[str]:
    """`lit_gpt.generate.generate_samples` (the one recipe body) with the XLA runtime: to stderr it adds, per
    sample, the compilations, and the total at the end (2 per prompt-length bucket)."""
    from lit_gpt.generate import generate_samples as body
    from lit_gpt.xla.runtime import XLARuntime

    return body(fabric, load_model, checkpoint_dir, prompt, runtime=XLARuntime(fabric), **sampling)
