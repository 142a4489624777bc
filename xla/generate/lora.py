"""Generate on XLA devices with a base checkpoint plus the LoRA weights that `finetune/lora.py` or
`xla/finetune/lora.py` wrote.

    python xla/generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/lora/alpaca/final/lit_model.lora.safetensors \\
        --prompt_style alpaca --prompt "What food do llamas eat?"

Flags and output as in `xla/generate/base.py`, plus `--lora_path` and `--allow_other_base`. The base weights and the
LoRA weights are loaded block by block onto the devices, sharded with FSDP over SPMD.
"""

from pathlib import Path

from lit_gpt import lora
from lit_gpt.generate import compile_steps
from lit_gpt.recipes.flags import Flag
from lit_gpt.recipes.generate import ALLOW_OTHER_BASE, GenerationArgs, run
from lit_gpt.recipes.xla_generate import load_variant_staged, xla_generate_command
from lit_gpt.utils import run_cli

LORA_PATH = Flag("lora_path", Path, Path("out/xla/lora/alpaca/final/lit_model.lora.safetensors"),
                 "The LoRA weights written by finetune/lora.py or xla/finetune/lora.py"
                 " (lit_model.lora.safetensors).")


def main(fabric, args: GenerationArgs) -> None:
    from lit_gpt.xla.runtime import XLARuntime

    def load(args: GenerationArgs) -> lora.GPT:  # block by block onto the devices, sharded; LoRA merged in
        return load_variant_staged(fabric, lora.GPT, lora.Config, args.checkpoint_dir, args.finetuned_path,
                                   allow_other_base=args.allow_other_base, quantize=args.quantize)

    # generate/base.py's steps with this load: eager steps that XLA traces and compiles itself, XLA's runtime
    # (host-side prompt buckets, replicated caches, a graph cut per step)
    run(fabric, args, load, runtime=XLARuntime(fabric), steps=compile_steps(None))


setup = xla_generate_command(
    "Generate `num_samples` continuations of a prompt with the LoRA-finetuned model on XLA devices.", main,
    own=[LORA_PATH, ALLOW_OTHER_BASE],
    writer="the lora finetuning recipe",
)

if __name__ == "__main__":
    run_cli(setup)
