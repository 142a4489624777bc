"""Convert a downloaded Hugging Face checkpoint into `lit_model.pth` + `lit_config.json` (same folder).

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
"""

from pathlib import Path
from typing import Literal, Optional

from lit_gpt.convert import convert_hf_checkpoint
from lit_gpt.utils import run_cli


def setup(
    checkpoint_dir: Path,
    model_name: Optional[str] = None,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    overwrite: bool = False,
) -> None:
    """Convert the HF weights in `checkpoint_dir`.

    Args:
        checkpoint_dir: folder with `config.json` and `*.safetensors` or `pytorch_model*.bin` files.
        model_name: a registry name (`Config.names()`) to use instead of `config.json`.
        dtype: cast the weights to this dtype; default: keep the checkpoint's.
        overwrite: replace an existing `lit_model.pth` / `lit_config.json` (without it that is refused).
    """
    convert_hf_checkpoint(checkpoint_dir, model_name=model_name, dtype=dtype, overwrite=overwrite)


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
