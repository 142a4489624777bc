"""Generate text from a prompt with a converted checkpoint, on the CPU or a CUDA GPU (through Lightning Fabric).

    python generate/base.py --prompt "What food do llamas eat?"
    python generate/base.py --checkpoint_dir out/full/alpaca/final --prompt_style alpaca --prompt "..."
    python generate/base.py --prompt "The capital of France is" --prompt_style raw --temperature 0
    python generate/base.py --quantize torchao.int8wo --compile default --prompt "..."   # int8 weights (lit_gpt/quantize.py)

The generated text goes to stdout (with `raw` prompts, the prompt and its continuation; with a chat or alpaca
template, the reply only); time, tokens/s and memory go to stderr. The flags are the same in every generate recipe
(`lit_gpt.recipes.generate.GENERATE`; `--help` lists them); the XLA recipe is `xla/generate/base.py`.
"""

import lightning as L

from lit_gpt.loading import load_model, scale_rope
from lit_gpt.recipes.generate import (
    GenerationArgs, check_request, generate_command, generate_sample, generation_steps, loading, prepare_for_device,
    print_sample, print_style, quantize_weights, report,
)
from lit_gpt.runtime import Runtime
from lit_gpt.utils import run_cli


def main(fabric: L.Fabric, args: GenerationArgs) -> None:
    steps = generation_steps(args, fabric.device.type)  # --compile: the loop's two steps, eager or compiled
    request = check_request(args)  # every input checked and the prompt encoded, before any weights are read

    with loading(fabric, args.checkpoint_dir):
        # built on the meta device and given the memory-mapped weights: they exist once in memory
        # --rope_scaling: a longer context; --quantize mxfp4: the experts loaded packed
        model = scale_rope(load_model(args.checkpoint_dir, args.quantize), args.rope_scaling)
        model = quantize_weights(fabric, model, args.quantize)
        model = prepare_for_device(fabric, model, steps)
    print_style(fabric, request)  # which prompt style, and why (stderr)

    runtime = Runtime(fabric)
    runtime.seed(args.seed)
    results = []
    for i in range(args.num_samples):
        results.append(generate_sample(model, request, runtime, steps))
        print_sample(fabric, request, results[-1], i, steps, runtime)
    report(fabric, runtime, results)


setup = generate_command("Generate `num_samples` continuations of a prompt.", main)

if __name__ == "__main__":
    run_cli(setup)
