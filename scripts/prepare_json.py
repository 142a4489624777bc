"""Prepare your own instruction data from a JSON file for finetuning.

    python scripts/prepare_json.py --data_file my_data.json --destination_path data/mine \
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

The file is a JSON array or JSON lines of objects with an instruction, an optional input and an output (field
names set with --instruction_key / --input_key / --output_key). Bad rows (missing fields, empty output, text that
is not UTF-8, unparseable lines) are reported with their line numbers and skipped, or rejected with
--on_bad_rows error."""

from pathlib import Path
from typing import Literal, Optional

from lit_gpt import data
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli


def prepare(
    data_file: Optional[Path] = None,
    destination_path: Path = Path("data/json"),
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    instruction_key: str = "instruction",
    input_key: Optional[str] = "input",
    output_key: str = "output",
    val_split_fraction: float = 0.1,
    seed: int = 42,
    mask_inputs: bool = True,
    max_seq_length: Optional[int] = None,
    prompt_style: str = "alpaca",
    on_bad_rows: Literal["skip", "error"] = "skip",
) -> None:
    """Tokenize a JSON / JSON-lines file with the checkpoint's tokenizer.

    Args:
        data_file: The .json (array or JSON lines) or .jsonl file.
        destination_path: Where train.pt, val.pt and meta.json go.
        checkpoint_dir: The model whose tokenizer (and default max_seq_length) to use.
        instruction_key: Field holding the instruction.
        input_key: Field holding the optional input/context (null: none).
        output_key: Field holding the response.
        val_split_fraction: Share of the samples held out for validation.
        seed: Seed of the train/val split.
        mask_inputs: Mask the prompt tokens in the labels (train on the responses only).
        max_seq_length: Truncate samples to this many tokens (default: the model's context length).
        prompt_style: How instruction + input become the prompt ("alpaca", "chat", "raw").
        on_bad_rows: "skip" bad rows (listed in the output and in meta.json) or stop with an "error".
    """
    if data_file is None:
        raise LitError("pass your data file with --data_file")
    records, bad = data.read_json_records(data_file)
    rows, bad_fields = data.records_to_rows(records, data.instruction_rows(instruction_key, input_key, output_key))
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
