"""Export a lit checkpoint (e.g. finetuned, or LoRA-merged by scripts/merge_lora.py) as a Hugging Face model folder,
or LoRA weights alone as a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`, for transformers +
PEFT and vLLM; see tutorials/convert.md, "Share a LoRA").

    python scripts/convert_lit_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --output_dir out/hf --checkpoint_path out/finetune/lora/merged/lit_model.safetensors
    python scripts/convert_lit_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --output_dir out/adapter --lora_path out/lora/alpaca/final/lit_model.lora.safetensors
"""

import sys
from pathlib import Path
from typing import Literal, Optional

from lit_gpt.convert import convert_lit_checkpoint
from lit_gpt.fingerprint import ALLOW_OTHER_BASE_HELP
from lit_gpt.peft_io import export_peft
from lit_gpt.recipes.outputs import check_output_dir
from lit_gpt.utils import LitError, run_cli


def setup(
    checkpoint_dir: Path,
    output_dir: Path,
    checkpoint_path: Optional[Path] = None,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    lora_path: Optional[Path] = None,
    base_model_name_or_path: Optional[str] = None,
    allow_other_base: bool = False,
) -> None:
    """Write `model.safetensors` (sharded above `max_shard_size`), `config.json` and the tokenizer files; with
    `--lora_path`, the PEFT adapter of those LoRA weights instead (`adapter_config.json`, `adapter_model.safetensors`).

    Args:
        checkpoint_dir: folder with `lit_config.json`, the tokenizer files and (by default) its weights
            (`lit_model.safetensors`, the index of its shards, or an earlier version's `lit_model.pth`).
        output_dir: where the HF model folder is written.
        checkpoint_path: weights to export instead of `checkpoint_dir`'s own (a `.safetensors` file or index, or
            an earlier version's `.pth`).
        dtype: cast the weights to this dtype; default: keep the checkpoint's.
        max_shard_size: largest safetensors file, e.g. 5GB or 500MB.
        overwrite: replace an HF model (or adapter) already in `output_dir` (without it that is refused).
        lora_path: LoRA weights trained on `checkpoint_dir` (`lit_model.lora.safetensors`): export them alone, as a
            PEFT LoRA adapter for the HF model `checkpoint_dir` exports to.
        base_model_name_or_path: what the adapter names as its base (default: ORG/NAME of a
            `checkpoints/ORG/NAME` folder, else `checkpoint_dir`).
        allow_other_base: {allow_other_base}
    """
    # before any weights are read: a file, a folder under a file, a read-only folder
    check_output_dir(output_dir, "--output_dir", "the Hugging Face model")
    if lora_path is not None:
        if checkpoint_path is not None or dtype is not None:
            raise LitError("--lora_path exports the LoRA weights alone (as they are): leave out --checkpoint_path and"
                           " --dtype")
        out = export_peft(checkpoint_dir, lora_path, output_dir, base_model_name_or_path=base_model_name_or_path,
                          overwrite=overwrite, allow_other_base=allow_other_base)
        print(f"Saved the PEFT adapter to {out}", file=sys.stderr)
        return
    convert_lit_checkpoint(
        checkpoint_dir,
        output_dir,
        checkpoint_path=checkpoint_path,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )


setup.__doc__ = setup.__doc__.replace("{allow_other_base}", ALLOW_OTHER_BASE_HELP)  # the generate recipes' help

if __name__ == "__main__":
    run_cli(setup, as_positional=False)
