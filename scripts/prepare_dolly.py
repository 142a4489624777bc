"""Prepare Databricks' Dolly 15k instruction data for finetuning.

    python scripts/prepare_dolly.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/prepare_dolly.py --data_file my_copy/databricks-dolly-15k.jsonl   # offline

Dolly's fields are instruction, context (optional, used as the input block) and response."""

from pathlib import Path
from typing import Literal, Optional

from lit_gpt import data
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli

DATA_URL = "https://huggingface.co/datasets/databricks/databricks-dolly-15k/resolve/main/databricks-dolly-15k.jsonl"


def prepare(
    destination_path: Path = Path("data/dolly"),
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    data_file: Optional[Path] = None,
    val_split_fraction: float = 0.1,
    seed: int = 42,
    mask_inputs: bool = True,
    max_seq_length: Optional[int] = None,
    prompt_style: str = "alpaca",
    on_bad_rows: Literal["skip", "error"] = "skip",
) -> None:
    """Tokenize Dolly with the checkpoint's tokenizer.

    Args:
        destination_path: Where train.pt, val.pt and meta.json go (the download is cached there too).
        checkpoint_dir: The model whose tokenizer (and default max_seq_length) to use.
        data_file: A local copy of the data (JSON lines of {instruction, context, response}); downloaded if unset.
        val_split_fraction: Share of the samples held out for validation.
        seed: Seed of the train/val split.
        mask_inputs: Mask the prompt tokens in the labels (train on the responses only).
        max_seq_length: Truncate samples to this many tokens (default: the model's context length).
        prompt_style: How instruction + context become the prompt ("alpaca", "chat", "raw").
        on_bad_rows: "skip" bad rows (listed in the output and in meta.json) or stop with an "error".
    """
    if data_file is None:
        data_file = data.download(DATA_URL, Path(destination_path) / "databricks-dolly-15k.jsonl")
    records, bad = data.read_records(data_file)
    rows, bad_fields = data.records_to_rows(records, data.instruction_rows("instruction", "context", "response"))
    meta = data.prepare(
        rows,
        bad + bad_fields,
        checkpoint_dir=checkpoint_dir,
        destination=destination_path,
        source=str(data_file),
        prompt_style=prompt_style,
        max_seq_length=max_seq_length,
        mask_inputs=mask_inputs,
        val_split_fraction=val_split_fraction,
        seed=seed,
        on_bad_rows=on_bad_rows,
    )
    data.print_summary(meta, destination_path)


if __name__ == "__main__":
    run_cli(prepare)
