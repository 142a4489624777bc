"""Convert a downloaded Hugging Face checkpoint into `lit_model.safetensors` + `lit_config.json` (same folder), or a
PEFT LoRA adapter for a converted checkpoint into `lit_model.lora.safetensors` + `lit_model.lora.json`.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --peft_path checkpoints/someone/smollm2-lora --out_dir out/imported
"""

import sys
from pathlib import Path
from typing import Literal, Optional

from lit_gpt.convert import convert_hf_checkpoint
from lit_gpt.peft_io import import_peft
from lit_gpt.utils import LitError, run_cli


def setup(
    checkpoint_dir: Path,
    model_name: Optional[str] = None,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    peft_path: Optional[Path] = None,
    out_dir: Optional[Path] = None,
    dequantize_mxfp4: bool = False,
) -> None:
    """Convert the HF weights in `checkpoint_dir`; with `--peft_path`, the LoRA adapter in that folder instead.

    Args:
        checkpoint_dir: folder with `config.json` and `*.safetensors` or `pytorch_model*.bin` files.
        model_name: a registry name (`Config.names()`) to use instead of `config.json`.
        dtype: cast the weights to this dtype; default: keep the checkpoint's.
        max_shard_size: largest weights file, e.g. 5GB or 500MB; above it the weights are written as
            `lit_model-0000k-of-0000n.safetensors` shards with a `lit_model.safetensors.index.json`.
        overwrite: replace existing lit weights / `lit_config.json` (without it that is refused).
        peft_path: a PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`) for the model in
            `checkpoint_dir`, converted already: written as `lit_model.lora.safetensors` + `lit_model.lora.json`
            (recording `checkpoint_dir`'s fingerprint) for generate/lora.py, the eval recipes and serve/base.py.
        out_dir: where the imported LoRA weights go (with `--peft_path`; default: the adapter's folder).
        dequantize_mxfp4: gpt-oss: write the experts decoded to --dtype (else bf16), as earlier versions did, instead
            of the Hub's MXFP4 bytes as they are (the default: 3.8x smaller; every recipe loads either, decoding or,
            with --quantize mxfp4, keeping them packed). For a file that any safetensors reader takes as the model's
            float weights.
    """
    if peft_path is not None:
        if model_name is not None or dtype is not None or dequantize_mxfp4:
            raise LitError("--peft_path imports the adapter for the converted model in --checkpoint_dir: leave out"
                           " --model_name, --dtype and --dequantize_mxfp4")
        path = import_peft(peft_path, checkpoint_dir, out_dir, overwrite=overwrite)
        print(f"Saved the LoRA weights to {path}", file=sys.stderr)
        return
    if out_dir is not None:
        raise LitError("--out_dir is for --peft_path; a checkpoint is converted in its own folder")
    convert_hf_checkpoint(checkpoint_dir, model_name=model_name, dtype=dtype, overwrite=overwrite,
                          max_shard_size=max_shard_size, dequantize_mxfp4=dequantize_mxfp4)


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
