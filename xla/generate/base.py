"""Generate text on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), the model sharded over all of them.

    python xla/generate/base.py --prompt "What food do llamas eat?"
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python xla/generate/base.py --prompt "The capital of France is" \\
        --prompt_style raw --temperature 0 --max_new_tokens 8

Flags and output as in `generate/base.py` (text on stdout; timings on stderr), less `--compile` and `--quantize`,
plus `--devices` (an SPMD mesh spans every device: "auto" or their number) and `--compile_cache_dir`. The weights
are loaded block by block onto the devices (`lit_gpt.xla.load_staged`) and sharded with FSDP over SPMD. The prompt
is padded to a power-of-two bucket, so XLA compiles two graphs (prefill, decode step) per bucket, whatever
--max_new_tokens is; stderr reports the time to the first token (compilation included), the steady decode speed
and the number of compilations.
"""

from pathlib import Path
from typing import Optional, Union

from lit_gpt.generate import compile_steps
from lit_gpt.recipes.generate import (
    XLA_FLAG_HELP, GenerationArgs, check_request, flag_help, generate_sample, loading, prepare_for_device,
    print_sample, report,
)
from lit_gpt.recipes.xla_generate import default_precision, load_base_staged
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


@flag_help(XLA_FLAG_HELP)
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
    devices: Union[int, str] = "auto",
    compile_cache_dir: Optional[Path] = None,
    accelerator: str = "auto",
) -> None:
    """Generate `num_samples` continuations of a prompt on XLA devices."""
    from lit_gpt.xla import make_fabric
    from lit_gpt.xla.accelerator import select_pjrt_device

    args = GenerationArgs(
        prompt=prompt, checkpoint_dir=checkpoint_dir, num_samples=num_samples, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, prompt_style=prompt_style, seed=seed,
    )
    check_request(args)  # before the XLA runtime starts: bad input fails fast
    select_pjrt_device(accelerator)
    fabric = make_fabric(devices, default_precision(precision), compile_cache_dir=compile_cache_dir)
    fabric.launch(main, args)


def main(fabric, args: GenerationArgs) -> None:
    from lit_gpt.xla.runtime import XLARuntime

    steps = compile_steps(None)  # eager steps: XLA traces and compiles the loop's graphs itself
    request = check_request(args)

    with loading(fabric, args.checkpoint_dir):
        model = load_base_staged(fabric, args.checkpoint_dir)  # block by block onto the devices, sharded
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
