"""Merge LoRA weights into the base model: a standalone checkpoint folder that generates like the LoRA model.

    python scripts/merge_lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/finetune/lora/final/lit_model.pth.lora --out_dir out/finetune/lora/merged

Then `generate/base.py --checkpoint_dir out/finetune/lora/merged` runs it like any model, and
`scripts/convert_lit_checkpoint.py --checkpoint_dir out/finetune/lora/merged --output_dir out/hf` exports it.
"""

import sys
from pathlib import Path
from typing import Optional

from lit_gpt.lora import merge_lora_checkpoint
from lit_gpt.utils import run_cli


def setup(checkpoint_dir: Path, lora_path: Path, out_dir: Optional[Path] = None) -> None:
    """Write `lit_model.pth`, `lit_config.json` and the tokenizer files of the merged model.

    Args:
        checkpoint_dir: the base model the LoRA weights were trained on.
        lora_path: the LoRA file the finetuning recipe wrote.
        out_dir: where the merged folder is written; default: the folder of `lora_path`.
    """
    path = merge_lora_checkpoint(checkpoint_dir, lora_path, out_dir)
    print(f"Merged weights written to {path}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
