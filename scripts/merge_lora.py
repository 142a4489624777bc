"""Merge LoRA weights into the base model: a standalone checkpoint folder that generates like the LoRA model.

    python scripts/merge_lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/finetune/lora/final/lit_model.lora.safetensors --out_dir out/finetune/lora/merged

Then `generate/base.py --checkpoint_dir out/finetune/lora/merged` runs it like any model, and
`scripts/convert_lit_checkpoint.py --checkpoint_dir out/finetune/lora/merged --output_dir out/hf` exports it.
"""

import sys
from pathlib import Path
from typing import Optional

from lit_gpt.config import CONFIG_FILE
from lit_gpt.convert import HF_SIDE_FILES
from lit_gpt.fingerprint import ALLOW_OTHER_BASE_HELP
from lit_gpt.lora import merge_lora_checkpoint
from lit_gpt.utils import LitError, error_reason, refuse_overwrite, remove_stale_temp_files, run_cli
from lit_gpt.weights import LEGACY, STEM, index_name, weights_name


def setup(checkpoint_dir: Path, lora_path: Path, out_dir: Optional[Path] = None, overwrite: bool = False,
          allow_other_base: bool = False) -> None:
    """Write `lit_model.safetensors`, `lit_config.json` and the tokenizer files of the merged model.

    The weights are written last, into a staging folder, and moved in when complete: a run killed mid-write leaves no
    `lit_model.safetensors` (see `lit_gpt.weights.save_weights`), and the staging folder such a run left behind
    (`.lit_model.tmpPID`, as large as the weights) is removed when the next merge into the same folder starts.

    Args:
        checkpoint_dir: the base model the LoRA weights were trained on.
        lora_path: the LoRA weights the finetuning recipe wrote (`lit_model.lora.safetensors`, with its
            `lit_model.lora.json` beside it; or an earlier version's `lit_model.pth.lora`).
        out_dir: where the merged folder is written; default: the folder of `lora_path`.
        overwrite: replace merged weights already in `out_dir` (without it that is refused).
        allow_other_base: {allow_other_base}
    """
    target = Path(lora_path).parent if out_dir is None else Path(out_dir)
    if target.exists() and not target.is_dir():
        raise LitError(f"--out_dir {str(target)!r} is a file, not a folder: pass a folder")
    created = _first_missing(target)  # removed again (if still empty) when the merge fails
    remove_stale_temp_files(target / STEM)  # what a merge killed mid-write left, before anything else takes time
    if Path(lora_path).is_file():
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LitError(f"cannot write --out_dir {str(target)!r}: {error_reason(e)}") from None
    # a missing LoRA file, or an out_dir that is the base checkpoint or the LoRA file's, get their own errors
    own_error = (target / weights_name()).resolve() == Path(lora_path).resolve() or (
        target.resolve() == Path(checkpoint_dir).resolve()
    )
    if Path(lora_path).is_file() and not own_error:
        refuse_overwrite(
            target,
            [weights_name(), index_name(), LEGACY],
            overwrite,
            "Pass --out_dir NEW_FOLDER for the merged model, or --overwrite true to replace that file",
        )
    before = {p.name for p in target.iterdir()} if target.is_dir() else set()
    try:
        path = merge_lora_checkpoint(checkpoint_dir, lora_path, out_dir, allow_other_base=allow_other_base)
    except BaseException:
        # the config and tokenizer files a failed merge wrote before its weights: a refused or failed merge leaves
        # out_dir as it found it
        for name in MERGE_FILES:
            if name not in before:
                (target / name).unlink(missing_ok=True)
        _remove_empty(created, target)
        raise
    print(f"Merged weights written to {path}", file=sys.stderr)


setup.__doc__ = setup.__doc__.replace("{allow_other_base}", ALLOW_OTHER_BASE_HELP)  # the generate recipes' help

MERGE_FILES = (CONFIG_FILE, "config.json", *HF_SIDE_FILES)
"""What a merge writes beside the weights (lit_gpt.lora.merge_lora_checkpoint), before them."""


def _first_missing(folder: Path) -> Optional[Path]:
    """The outermost folder of `folder`'s path that does not exist yet (None: it exists)."""
    missing = None
    for p in [folder.absolute(), *folder.absolute().parents]:
        if p.exists():
            break
        missing = p
    return missing


def _remove_empty(top: Optional[Path], folder: Path) -> None:
    """Remove the empty folders this run created, from `folder` up to `top`: a refused merge leaves nothing behind."""
    if top is None:
        return
    for p in [folder.absolute(), *folder.absolute().parents]:
        try:
            p.rmdir()  # only an empty folder goes
        except OSError:
            return
        if p == top:
            return


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
