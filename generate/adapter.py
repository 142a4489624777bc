"""Generate with a base checkpoint plus the LLaMA-Adapter weights that `finetune/adapter.py` wrote.

    python generate/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --adapter_path out/adapter/alpaca/final/lit_model.adapter.safetensors \\
        --prompt_style alpaca --prompt "What food do llamas eat?"

Flags and output as in `generate/base.py`, plus `--adapter_path` and `--allow_other_base` (`--quantize` applies
after the adapter weights are loaded).
"""

from pathlib import Path

import lightning as L

from lit_gpt import adapter
from lit_gpt.peft import load_variant_model
from lit_gpt.recipes.flags import Flag
from lit_gpt.recipes.generate import ALLOW_OTHER_BASE, GenerationArgs, generate_command, run
from lit_gpt.utils import run_cli

ADAPTER_PATH = Flag("adapter_path", Path, Path("out/adapter/alpaca/final/lit_model.adapter.safetensors"),
                    "The LLaMA-Adapter weights written by finetune/adapter.py (lit_model.adapter.safetensors).")


def load(args: GenerationArgs) -> adapter.GPT:
    return load_variant_model(adapter.GPT, adapter.Config, args.checkpoint_dir, args.finetuned_path,
                              allow_other_base=args.allow_other_base)


def main(fabric: L.Fabric, args: GenerationArgs) -> None:
    run(fabric, args, load, weights=("--adapter_path", "finetune/adapter.py"))  # generate/base.py's steps, with this load


setup = generate_command(
    "Generate `num_samples` continuations of a prompt with the adapter-finetuned model.", main,
    own=[ADAPTER_PATH, ALLOW_OTHER_BASE],
)

if __name__ == "__main__":
    run_cli(setup)
