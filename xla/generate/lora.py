"""Generate on XLA devices with a base checkpoint plus the LoRA weights that `finetune/lora.py` or
`xla/finetune/lora.py` wrote.

    python xla/generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/lora/alpaca/final/lit_model.pth.lora \\
        --prompt_style alpaca --prompt "What food do llamas eat?"

Arguments and output as in `xla/generate/base.py`, plus `--lora_path`. The base weights and the LoRA weights are
loaded block by block onto the devices, sharded with FSDP over SPMD.
"""

from pathlib import Path
from typing import Optional, Union

from lit_gpt.generate import check_model_dir
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli


def setup(
    prompt: str = "What food do llamas eat?",
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    lora_path: Path = Path("out/xla/lora/alpaca/final/lit_model.pth.lora"),
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    precision: Optional[str] = None,
    prompt_style: Optional[str] = None,
    seed: int = 1234,
    devices: Union[int, str] = "auto",
    compile_cache_dir: Optional[Path] = None,
    accelerator: str = "auto",
) -> None:
    """Generate `num_samples` continuations of a prompt with the LoRA-finetuned model on XLA devices.

    Args:
        prompt: The text to continue (or the instruction, with a chat or alpaca template).
        checkpoint_dir: The base checkpoint the LoRA weights were trained on (lit_model.pth, lit_config.json,
            tokenizer files).
        lora_path: The LoRA weights written by the lora finetuning recipe.
        num_samples: How many samples to draw, one after the other.
        max_new_tokens: The most tokens to generate per sample; generation also stops at the model's stop tokens.
        temperature: Sampling temperature; 0 is greedy decoding (top_k and top_p then do nothing).
        top_k: Sample among the k most likely tokens only (null: all).
        top_p: Nucleus sampling: among the most likely tokens whose probabilities add up to top_p (1.0: all).
        precision: "32-true" or "bf16-true" (default: bf16-true on TPUs, else 32-true).
        prompt_style: "chat", "alpaca" or "raw": the style the model was finetuned with; default: chat for
            instruct checkpoints with a template, else raw.
        seed: Seeds the sampling.
        devices: "auto" (all devices of the XLA runtime) or their number: the SPMD mesh spans all of them.
        compile_cache_dir: Persistent XLA compilation cache: a second run skips compiling (TPU/GPU).
        accelerator: The PJRT device: "auto" (the TPU when there is one, else the CPU), "tpu", "cpu" or "cuda".
    """
    from lit_gpt.xla import make_fabric
    from lit_gpt.xla.accelerator import select_pjrt_device
    from lit_gpt.xla.generate import default_precision

    check_model_dir(checkpoint_dir)  # before the XLA runtime starts: a typo fails fast
    if not Path(lora_path).is_file():
        raise LitError(
            f"--lora_path {str(lora_path)!r} not found: pass the lit_model.pth.lora file that the lora finetuning wrote"
        )
    select_pjrt_device(accelerator)
    fabric = make_fabric(devices, default_precision(precision), compile_cache_dir=compile_cache_dir)
    sampling = dict(
        num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        prompt_style=prompt_style, seed=seed,
    )
    fabric.launch(main, prompt, checkpoint_dir, lora_path, sampling)


def main(fabric, prompt: str, checkpoint_dir: Path, lora_path: Path, sampling: dict) -> None:
    from lit_gpt import lora
    from lit_gpt.xla.generate import generate_samples, load_variant_staged

    def load_model():
        return load_variant_staged(fabric, lora.GPT, lora.Config, checkpoint_dir, lora_path)

    generate_samples(fabric, load_model, checkpoint_dir, prompt, **sampling)


if __name__ == "__main__":
    run_cli(setup)
