"""Convert a downloaded Hugging Face checkpoint into `lit_model.safetensors` + `lit_config.json` (same folder).

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
    max_shard_size: str = "5GB",
    overwrite: bool = False,
) -> None:
    """Convert the HF weights in `checkpoint_dir`.

    Args:
        checkpoint_dir: folder with `config.json` and `*.safetensors` or `pytorch_model*.bin` files.
        model_name: a registry name (`Config.names()`) to use instead of `config.json`.
        dtype: cast the weights to this dtype; default: keep the checkpoint's.
        max_shard_size: largest weights file, e.g. 5GB or 500MB; above it the weights are written as
            `lit_model-0000k-of-0000n.safetensors` shards with a `lit_model.safetensors.index.json`.
        overwrite: replace existing lit weights / `lit_config.json` (without it that is refused).
    """
    convert_hf_checkpoint(checkpoint_dir, model_name=model_name, dtype=dtype, overwrite=overwrite,
                          max_shard_size=max_shard_size)


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
