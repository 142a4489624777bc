"""Generate with a base checkpoint plus the LoRA weights that `finetune/lora.py` wrote.

    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.pth.lora --prompt_style alpaca --prompt "What food do llamas eat?"

Arguments and output as in `generate/base.py`, plus `--lora_path`. The LoRA updates are merged into the
weights after loading; `scripts/merge_lora.py` writes such a merged checkpoint once and for all.
"""

from pathlib import Path
from typing import Optional

import lightning as L

from lit_gpt import lora
from lit_gpt.lora import merge_lora_weights
from lit_gpt.model import GPT
from lit_gpt.generate import generate_samples, generation_fabric
from lit_gpt.peft import load_variant_model
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


def setup(
    prompt: str = "What food do llamas eat?",
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    lora_path: Path = Path("out/lora/alpaca/final/lit_model.pth.lora"),
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    precision: Optional[str] = None,
    prompt_style: Optional[str] = None,
    seed: int = 1234,
    compile: bool = False,
    accelerator: str = "auto",
) -> None:
    """Generate `num_samples` continuations of a prompt with the LoRA-finetuned model.

    Args:
        prompt: The text to continue (or the instruction, with a chat or alpaca template).
        checkpoint_dir: The base checkpoint the LoRA weights were trained on (lit_model.pth, lit_config.json,
            tokenizer files).
        lora_path: The LoRA weights written by finetune/lora.py.
        num_samples: How many samples to draw, one after the other.
        max_new_tokens: The most tokens to generate per sample; generation also stops at the model's stop tokens.
        temperature: Sampling temperature; 0 is greedy decoding (top_k and top_p then do nothing).
        top_k: Sample among the k most likely tokens only (null: all).
        top_p: Nucleus sampling: among the most likely tokens whose probabilities add up to top_p (1.0: all).
        precision: "32-true", "bf16-true", "16-true" (default: bf16-true on GPUs that support it, else 32-true).
        prompt_style: "chat", "alpaca" or "raw": the style the model was finetuned with; default: chat for
            instruct checkpoints with a template, else raw.
        seed: Seeds the sampling.
        compile: `torch.compile` the decode step (worth it for long generations; the first steps compile).
        accelerator: "cpu", "cuda" or "auto".
    """
    fabric = generation_fabric(accelerator, precision)
    sampling = dict(
        num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        prompt_style=prompt_style, seed=seed, compile=compile,
    )
    main(fabric, prompt, checkpoint_dir, lora_path, sampling)


def main(fabric: L.Fabric, prompt: str, checkpoint_dir: Path, lora_path: Path, sampling: dict) -> None:
    def load_model() -> GPT:
        model = load_variant_model(lora.GPT, lora.Config, checkpoint_dir, lora_path)
        merge_lora_weights(model)  # fold B A into the weights: generation runs at base-model speed
        return model

    generate_samples(fabric, load_model, checkpoint_dir, prompt, **sampling)


if __name__ == "__main__":
    run_cli(setup)
