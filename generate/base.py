"""Generate text from a prompt with a converted checkpoint, on the CPU or a CUDA GPU (through Lightning Fabric).

    python generate/base.py --prompt "What food do llamas eat?"
    python generate/base.py --checkpoint_dir out/full/alpaca/final --prompt_style alpaca --prompt "..."
    python generate/base.py --prompt "The capital of France is" --prompt_style raw --temperature 0
    python generate/base.py --quantize torchao.int8wo --compile default --prompt "..."   # int8 weights (lit_gpt/quantize.py)

The generated text goes to stdout (with `raw` prompts, the prompt and its continuation; with a chat or alpaca
template, the reply only); time, tokens/s and memory go to stderr. The flags are the same in every generate recipe
(`lit_gpt.recipes.generate.FLAG_HELP`); the XLA recipe is `xla/generate/base.py`.
"""

from pathlib import Path
from typing import Optional, Union

import lightning as L

from lit_gpt.loading import load_model
from lit_gpt.recipes.generate import (
    FLAG_HELP, GenerationArgs, check_request, flag_help, generate_sample, generation_fabric, generation_steps,
    loading, prepare_for_device, print_sample, quantize_weights, report,
)
from lit_gpt.runtime import Runtime
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


@flag_help(FLAG_HELP)
def setup(
    prompt: str = "What food do llamas eat?",
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
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
    """Generate `num_samples` continuations of a prompt."""
    fabric = generation_fabric(accelerator, precision, quantize)
    args = GenerationArgs(
        prompt=prompt, checkpoint_dir=checkpoint_dir, num_samples=num_samples, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, prompt_style=prompt_style, seed=seed, compile=compile,
        quantize=quantize,
    )
    main(fabric, args)


def main(fabric: L.Fabric, args: GenerationArgs) -> None:
    steps = generation_steps(args, fabric.device.type)  # --compile: the loop's two steps, eager or compiled
    request = check_request(args)  # every input checked and the prompt encoded, before any weights are read

    with loading(fabric, args.checkpoint_dir):
        # built on the meta device and given the memory-mapped weights: they exist once in memory
        model = load_model(args.checkpoint_dir)
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
