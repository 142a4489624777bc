"""Generate on XLA devices with a base checkpoint plus the LLaMA-Adapter weights that `finetune/adapter.py` or
`xla/finetune/adapter.py` wrote.

    python xla/generate/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --adapter_path out/xla/adapter/alpaca/final/lit_model.adapter.safetensors \\
        --prompt_style alpaca --prompt "What food do llamas eat?"

Flags and output as in `xla/generate/base.py`, plus `--adapter_path` and `--allow_other_base`. The base weights and
the Adapter weights are loaded block by block onto the devices, sharded with FSDP over SPMD.
"""

from pathlib import Path

from lit_gpt import adapter
from lit_gpt.generate import compile_steps
from lit_gpt.recipes.flags import Flag
from lit_gpt.recipes.generate import ALLOW_OTHER_BASE, GenerationArgs, run
from lit_gpt.recipes.xla_generate import load_variant_staged, xla_generate_command
from lit_gpt.utils import run_cli

ADAPTER_PATH = Flag("adapter_path", Path, Path("out/xla/adapter/alpaca/final/lit_model.adapter.safetensors"),
                    "The LLaMA-Adapter weights written by finetune/adapter.py or xla/finetune/adapter.py"
                    " (lit_model.adapter.safetensors).")


def main(fabric, args: GenerationArgs) -> None:
    from lit_gpt.xla.runtime import XLARuntime

    def load(args: GenerationArgs) -> adapter.GPT:  # block by block onto the devices, sharded
        return load_variant_staged(fabric, adapter.GPT, adapter.Config, args.checkpoint_dir, args.finetuned_path,
                                   allow_other_base=args.allow_other_base, quantize=args.quantize)

    # generate/base.py's steps with this load: eager steps that XLA traces and compiles itself, XLA's runtime
    # (host-side prompt buckets, replicated caches, a graph cut per step)
    run(fabric, args, load, runtime=XLARuntime(fabric), steps=compile_steps(None))


setup = xla_generate_command(
    "Generate `num_samples` continuations of a prompt on XLA devices with the base model plus its Adapter weights.",
    main, own=[ADAPTER_PATH, ALLOW_OTHER_BASE],
    writer="the adapter finetuning recipe",
)

if __name__ == "__main__":
    run_cli(setup)
