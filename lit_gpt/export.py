"""The final export of a finetuning run (`out_dir/final/`), committed like a checkpoint: the weights in the
project's format (`lit_gpt.weights`) plus the run's files (base config, tokenizer, finetune.json).

    export_final_folder(final, write_files, lambda stage: save_weights(state, stage)[-1])

On a disk everything goes into `.final.partial` and is renamed into place when complete (`lit_gpt.state`); in a
bucket (no renames) it is written in a local staging folder and uploaded with the weights file last, an older
export's weights file deleted first, so a reader never takes a half export for a complete one.
"""

import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from lit_gpt.state import commit_folder
from lit_gpt.storage import is_url, location, remove, staging_dir, upload
from lit_gpt.weights import base_metadata, save_finetuned_weights, save_weights


def export_final_folder(final: Path, write_files: Callable[[Path], None], write_weights: Callable[[Path], Path]) -> Path:
    """Write the run's files and then the weights (`write_weights(folder)` returns the weights file, or the index of
    its shards) into a staging folder and commit it as `final`. Returns the committed weights path."""
    final = location(final)
    if is_url(final):
        stage = staging_dir("lit-gpt-final-")
        try:
            write_files(stage)
            name = write_weights(stage).name
            remove(final, first=[name])
            upload(stage, final, last=[name])
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return final / name
    tmp = final.with_name(f".{final.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_files(tmp)
        name = write_weights(tmp).name
        commit_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final / name


def export_weights(
    state: Mapping[str, torch.Tensor], final: Path, method: str, method_config: Optional[Dict[str, Any]],
    write_files: Callable[[Path], None], base: Optional[Mapping[str, str]] = None,
) -> Path:
    """`final/lit_model.safetensors` (full finetuning) or `final/lit_model.METHOD.safetensors` + its JSON (the
    parameter-efficient methods: only their tensors), with the run's files, committed as one folder. `base`: the base
    model the run finetuned ({"fingerprint", "checkpoint_dir"}: `lit_gpt.fingerprint.base_record`), recorded in the
    JSON's "base" or, for full finetuning, in the header metadata (`lit_gpt.weights.base_metadata`)."""
    if method == "full":
        return export_final_folder(
            final, write_files, lambda stage: save_weights(state, stage, metadata=base_metadata(base))[-1]
        )
    return export_final_folder(
        final, write_files, lambda stage: save_finetuned_weights(state, stage, method, method_config or {}, base=base)
    )
