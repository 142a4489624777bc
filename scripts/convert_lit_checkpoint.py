"""Export a lit checkpoint (e.g. finetuned, or LoRA-merged by scripts/merge_lora.py) as a Hugging Face model folder.

    python scripts/convert_lit_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --output_dir out/hf --checkpoint_path out/finetune/lora/merged/lit_model.safetensors
"""

from pathlib import Path
from typing import Literal, Optional

from lit_gpt.convert import convert_lit_checkpoint
from lit_gpt.utils import run_cli


def setup(
    checkpoint_dir: Path,
    output_dir: Path,
    checkpoint_path: Optional[Path] = None,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    max_shard_size: str = "5GB",
    overwrite: bool = False,
) -> None:
    """Write `model.safetensors` (sharded above `max_shard_size`), `config.json` and the tokenizer files.

    Args:
        checkpoint_dir: folder with `lit_config.json`, the tokenizer files and (by default) its weights
            (`lit_model.safetensors`, the index of its shards, or an earlier version's `lit_model.pth`).
        output_dir: where the HF model folder is written.
        checkpoint_path: weights to export instead of `checkpoint_dir`'s own (a `.safetensors` file or index, or
            an earlier version's `.pth`).
        dtype: cast the weights to this dtype; default: keep the checkpoint's.
        max_shard_size: largest safetensors file, e.g. 5GB or 500MB.
        overwrite: replace an HF model already in `output_dir` (without it that is refused).
    """
    convert_lit_checkpoint(
        checkpoint_dir,
        output_dir,
        checkpoint_path=checkpoint_path,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
