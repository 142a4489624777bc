"""Generate text on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), the model sharded over all of them.

    python xla/generate/base.py --prompt "What food do llamas eat?"
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python xla/generate/base.py --prompt "The capital of France is" \\
        --prompt_style raw --temperature 0 --max_new_tokens 8

Flags and output as in `generate/base.py` (text on stdout; timings on stderr), less `--compile` (and `--quantize`
takes mxfp4 only: gpt-oss's experts kept packed on the devices), plus `--devices` (an SPMD mesh spans every device: "auto" or their number) and `--compile_cache_dir`. The weights
are loaded block by block onto the devices (`lit_gpt.xla.load_staged`) and sharded with FSDP over SPMD. The prompt
is padded to a power-of-two bucket, so XLA compiles two graphs (prefill, decode step) per bucket, whatever
--max_new_tokens is; stderr reports the time to the first token (compilation included), the steady decode speed
and the number of compilations.
"""

from lit_gpt.generate import compile_steps
from lit_gpt.recipes.generate import GenerationArgs, run
from lit_gpt.recipes.xla_generate import load_base_staged, xla_generate_command
from lit_gpt.utils import run_cli


def main(fabric, args: GenerationArgs) -> None:
    from lit_gpt.xla.runtime import XLARuntime

    # generate/base.py's steps (lit_gpt.recipes.generate.run) with XLA's parts: the weights loaded block by block
    # onto the devices, sharded; eager steps that XLA traces and compiles itself; XLA's runtime (host-side prompt
    # buckets, replicated caches, a graph cut per step)
    run(fabric, args, lambda args: load_base_staged(fabric, args.checkpoint_dir, args.quantize),
        runtime=XLARuntime(fabric), steps=compile_steps(None))


setup = xla_generate_command("Generate `num_samples` continuations of a prompt on XLA devices.", main)

if __name__ == "__main__":
    run_cli(setup)
