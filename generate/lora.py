"""Generate with a base checkpoint plus the LoRA weights that `finetune/lora.py` wrote.

    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.lora.safetensors --prompt_style alpaca \\
        --prompt "What food do llamas eat?"

Flags and output as in `generate/base.py`, plus `--lora_path`. The LoRA updates are merged into the weights after
loading (then `--quantize` applies); `scripts/merge_lora.py` writes such a merged checkpoint once and for all.
"""

from pathlib import Path
from typing import Optional, Union

import lightning as L

from lit_gpt import lora
from lit_gpt.peft import load_variant_model
from lit_gpt.recipes.generate import (
    FLAG_HELP, GenerationArgs, check_file, check_request, flag_help, generate_sample, generation_fabric,
    generation_steps, loading, prepare_for_device, print_sample, quantize_weights, report,
)
from lit_gpt.runtime import Runtime
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


@flag_help(FLAG_HELP, lora_path="The LoRA weights written by finetune/lora.py (lit_model.lora.safetensors).")
def setup(
    prompt: str = "What food do llamas eat?",
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    lora_path: Path = Path("out/lora/alpaca/final/lit_model.lora.safetensors"),
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    precision: Optional[str] = None,
    prompt_style: Optional[str] = None,
    seed: int = 1234,
    compile: Union[bool, str] = "auto",
    accelerator: str = "auto",
    quantize: Optional[str] = None,
) -> None:
    """Generate `num_samples` continuations of a prompt with the LoRA-finetuned model."""
    fabric = generation_fabric(accelerator, precision, quantize)
    args = GenerationArgs(
        prompt=prompt, checkpoint_dir=checkpoint_dir, finetuned_path=lora_path, num_samples=num_samples,
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, prompt_style=prompt_style,
        seed=seed, compile=compile, quantize=quantize,
    )
    main(fabric, args)


def main(fabric: L.Fabric, args: GenerationArgs) -> None:
    steps = generation_steps(args, fabric.device.type)  # --compile: the loop's two steps, eager or compiled
    request = check_request(args)  # every input checked and the prompt encoded, before any weights are read
    check_file(args.finetuned_path, "--lora_path", "finetune/lora.py")

    with loading(fabric, args.finetuned_path):
        model = load_variant_model(lora.GPT, lora.Config, args.checkpoint_dir, args.finetuned_path)
        lora.merge_lora_weights(model)  # fold B A into the weights: generation runs at base-model speed
        model = quantize_weights(fabric, model, args.quantize)
        model = prepare_for_device(fabric, model, steps)

    runtime = Runtime(fabric)
    runtime.seed(args.seed)
    results = []
    for i in range(args.num_samples):
        results.append(generate_sample(model, request, runtime, steps))
        print_sample(fabric, request, results[-1], i, steps, runtime)
    report(fabric, runtime, results)


if __name__ == "__main__":
    run_cli(setup)
