"""Generate on XLA devices with a base checkpoint plus the LoRA weights that `finetune/lora.py` or
`xla/finetune/lora.py` wrote.

    python xla/generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/lora/alpaca/final/lit_model.lora.safetensors \\
        --prompt_style alpaca --prompt "What food do llamas eat?"

Flags and output as in `xla/generate/base.py`, plus `--lora_path`. The base weights and the LoRA weights are
loaded block by block onto the devices, sharded with FSDP over SPMD.
"""

from pathlib import Path
from typing import Optional, Union

from lit_gpt.generate import compile_steps
from lit_gpt.recipes.generate import (
    XLA_FLAG_HELP, GenerationArgs, check_file, check_request, flag_help, generate_sample, loading,
    prepare_for_device, print_sample, report,
)
from lit_gpt.recipes.xla_generate import default_precision, load_variant_staged
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


@flag_help(
    XLA_FLAG_HELP,
    lora_path="The LoRA weights written by finetune/lora.py or xla/finetune/lora.py"
    " (lit_model.lora.safetensors).",
)
def setup(
    prompt: str = "What food do llamas eat?",
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    lora_path: Path = Path("out/xla/lora/alpaca/final/lit_model.lora.safetensors"),
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
    """Generate `num_samples` continuations of a prompt with the LoRA-finetuned model on XLA devices."""
    from lit_gpt.xla import make_fabric
    from lit_gpt.xla.accelerator import select_pjrt_device

    args = GenerationArgs(
        prompt=prompt, checkpoint_dir=checkpoint_dir, finetuned_path=lora_path, num_samples=num_samples,
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, prompt_style=prompt_style,
        seed=seed,
    )
    check_request(args)  # before the XLA runtime starts: bad input fails fast
    check_file(lora_path, "--lora_path", "the lora finetuning recipe")
    select_pjrt_device(accelerator)
    fabric = make_fabric(devices, default_precision(precision), compile_cache_dir=compile_cache_dir)
    fabric.launch(main, args)


def main(fabric, args: GenerationArgs) -> None:
    from lit_gpt import lora
    from lit_gpt.xla.runtime import XLARuntime

    steps = compile_steps(None)  # eager steps: XLA traces and compiles the loop's graphs itself
    request = check_request(args)

    with loading(fabric, args.finetuned_path):
        # block by block onto the devices, sharded; LoRA updates merged into the weights
        model = load_variant_staged(fabric, lora.GPT, lora.Config, args.checkpoint_dir, args.finetuned_path)
        model = prepare_for_device(fabric, model, steps)

    runtime = XLARuntime(fabric)  # host-side prompt buckets, replicated caches, a graph cut per step
    runtime.seed(args.seed)
    results = []
    for i in range(args.num_samples):
        results.append(generate_sample(model, request, runtime, steps))
        print_sample(fabric, request, results[-1], i, steps, runtime)
    report(fabric, runtime, results)


if __name__ == "__main__":
    run_cli(setup)
