"""Generate with the weights that `finetune/full.py` wrote, on the architecture of their base checkpoint.

    python generate/full.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --checkpoint_path out/full/alpaca/final/lit_model.safetensors --prompt_style alpaca \\
        --prompt "What food do llamas eat?"

Flags and output as in `generate/base.py`, plus `--checkpoint_path`. (`out/full/alpaca/final` is itself a
checkpoint folder: `generate/base.py --checkpoint_dir out/full/alpaca/final` runs it too.)
"""

from pathlib import Path

import lightning as L

from lit_gpt.peft import load_full_finetuned
from lit_gpt.recipes.flags import Flag
from lit_gpt.recipes.generate import GenerationArgs, generate_command, run
from lit_gpt.utils import run_cli

CHECKPOINT_PATH = Flag("checkpoint_path", Path, Path("out/full/alpaca/final/lit_model.safetensors"),
                       "The finetuned weights written by finetune/full.py (lit_model.safetensors).")


def load(args: GenerationArgs):
    # the base checkpoint's architecture (lit_config.json) with every weight from the finetuned file
    return load_full_finetuned(args.checkpoint_dir, args.finetuned_path)


def main(fabric: L.Fabric, args: GenerationArgs) -> None:
    run(fabric, args, load, weights=("--checkpoint_path", "finetune/full.py"))  # generate/base.py's steps, with this load


setup = generate_command("Generate `num_samples` continuations of a prompt with the fully finetuned model.", main,
                         own=[CHECKPOINT_PATH])

if __name__ == "__main__":
    run_cli(setup)
