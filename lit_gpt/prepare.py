"""The instruction datasets of `scripts/prepare_*.py`, in one table, and the one implementation behind them.

Each script is `prepare = make_prepare(NAME)` then `run_cli(prepare)`. Its command-line flags (their order,
types, defaults and `--help` texts) are built from its `DATASETS` entry and the common flags below, so the
scripts cannot drift apart. A new dataset is a new entry plus a three-line script.

Steps of every script: get the file (`--data_file`, or download it), read its records by line
(`lit_gpt.records`), turn them into rows (fixed fields, fields chosen by flags, or conversations), then
tokenize, split and write them (`lit_gpt.data.prepare`).
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

from lit_gpt import data
from lit_gpt.cli import Flag, command
from lit_gpt.records import (
    conversation_rows,
    download,
    instruction_rows,
    read_csv_records,
    read_json_records,
    read_records,
    records_to_rows,
)
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError


OVERWRITE_HELP = ("Replace prepared data of other rows already in --destination_path (without it that is refused;"
                  " the same data prepared again is always written).")
"""The help of --overwrite, the same on every prepare script (scripts/prepare_preferences.py too)."""


@dataclass(frozen=True)
class Dataset:
    """Where one dataset comes from and how its records become rows."""

    title: str
    """What `--help` says is tokenized: "Tokenize {title} with the checkpoint's tokenizer."."""
    destination: str
    """The default --destination_path."""
    data_file_doc: str
    """The help of --data_file (what the file holds)."""
    val_split_fraction: float = 0.1
    """The default --val_split_fraction."""
    url: Optional[str] = None
    """Downloaded into --destination_path (under the URL's file name) when --data_file is not given."""
    gated_hub_file: Optional[Tuple[str, str]] = None
    """(dataset repo, file) on the Hugging Face Hub, downloaded into --destination_path when --data_file is not
    given; gated, so with --access_token. Without `url` and this, --data_file is required (and comes first)."""
    file_format: Literal["any", "json", "csv"] = "any"
    """"any": by the file's suffix; "json": a JSON array or JSON lines whatever the suffix; "csv": with a header
    line, and --delimiter."""
    fields: Tuple[str, Optional[str], str] = ("instruction", "input", "output")
    """The instruction, input (optional) and output fields of a record; with `field_flags` the flags' defaults."""
    field_flags: bool = False
    """--instruction_key / --input_key / --output_key choose the fields (the user's own files)."""
    conversations: bool = False
    """Records are {"conversations": [user, assistant, ...]} instead of fields; --include_multiturn_conversations
    makes every exchange a sample."""

    @property
    def downloads(self) -> bool:
        return self.url is not None or self.gated_hub_file is not None


DATASETS: Dict[str, Dataset] = {
    "alpaca": Dataset(
        title="Alpaca",
        destination="data/alpaca",
        data_file_doc="A local copy of the data (a JSON array of {instruction, input, output}); downloaded if unset.",
        val_split_fraction=0.03865,  # 2000 of the ~52k samples
        url="https://raw.githubusercontent.com/tloen/alpaca-lora/main/alpaca_data_cleaned_archive.json",
    ),
    "dolly": Dataset(
        title="Dolly",
        destination="data/dolly",
        data_file_doc="A local copy of the data (JSON lines of {instruction, context, response}); downloaded if unset.",
        url="https://huggingface.co/datasets/databricks/databricks-dolly-15k/resolve/main/databricks-dolly-15k.jsonl",
        fields=("instruction", "context", "response"),
    ),
    "lima": Dataset(
        title="LIMA",
        destination="data/lima",
        data_file_doc="A local copy of LIMA's train.jsonl; downloaded from the Hub if unset.",
        gated_hub_file=("GAIR/lima", "train.jsonl"),
        conversations=True,
    ),
    "json": Dataset(
        title="a JSON / JSON-lines file",
        destination="data/json",
        data_file_doc="The .json (array or JSON lines) or .jsonl file.",
        file_format="json",
        field_flags=True,
    ),
    "csv": Dataset(
        title="a CSV/TSV file",
        destination="data/csv",
        data_file_doc="The .csv or .tsv file, with a header line.",
        file_format="csv",
        field_flags=True,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# The flags of a dataset's script
# ---------------------------------------------------------------------------------------------------------------
def flags(dataset: Dataset) -> List[Flag]:
    """The flags of the script of `dataset`, in `--help` order."""
    cached = " (the download is cached there too)" if dataset.downloads else ""
    where = [
        Flag("destination_path", Path, Path(dataset.destination), f"Where train.pt, val.pt and meta.json go{cached}."),
        Flag("checkpoint_dir", Path, DEFAULT_CHECKPOINT_DIR,
             "The model whose tokenizer (and default max_seq_length) to use."),
    ]
    data_file = Flag("data_file", Optional[Path], None, dataset.data_file_doc)
    # the user's own file is the one thing to pass: it comes first; a downloaded dataset's copy is an option
    out = [*where, data_file] if dataset.downloads else [data_file, *where]
    if dataset.gated_hub_file:
        out.append(Flag("access_token", Optional[str], None,
                        "Hugging Face token for the gated dataset (default: the HF_TOKEN environment variable)."))
    if dataset.conversations:
        out.append(Flag("include_multiturn_conversations", bool, False,
                        "Use every exchange of a conversation, not only the first."))
    if dataset.field_flags:
        noun = "Column" if dataset.file_format == "csv" else "Field"
        instruction, inp, output = dataset.fields
        out += [
            Flag("instruction_key", str, instruction, f"{noun} holding the instruction."),
            Flag("input_key", Optional[str], inp, f"{noun} holding the optional input/context (null: none)."),
            Flag("output_key", str, output, f"{noun} holding the response."),
        ]
    if dataset.file_format == "csv":
        out.append(Flag("delimiter", Optional[str], None,
                        "Cell separator (default: a tab for .tsv files, a comma otherwise)."))
    if dataset.conversations:
        prompt = "How a turn (and its history) becomes the prompt"
    else:
        prompt = f"How instruction + {dataset.fields[1] or 'input'} become the prompt"
    out += [
        Flag("val_split_fraction", float, dataset.val_split_fraction, "Share of the samples held out for validation."),
        Flag("seed", int, 42, "Seed of the train/val split."),
        Flag("mask_inputs", bool, True, "Mask the prompt tokens in the labels (train on the responses only)."),
        Flag("max_seq_length", Optional[int], None,
             "Truncate samples to this many tokens (default: the model's context length)."),
        Flag("prompt_style", str, "alpaca", f'{prompt} ("alpaca", "chat", "raw").'),
        Flag("on_bad_rows", Literal["skip", "error"], "skip",
             '"skip" bad rows (listed in the output and in meta.json) or stop with an "error".'),
        Flag("overwrite", bool, False, OVERWRITE_HELP),
    ]
    return out


def make_prepare(name: str) -> Callable[..., None]:
    """The entry function of `scripts/prepare_{name}.py`.

    jsonargparse builds the command line from a function's signature and docstring, so both are built here from
    `flags(DATASETS[name])`: `--help` lists every flag with its default and text, and a call checks its arguments
    as a written-out signature would (`prepare(data_file=..., seed=1)`; unknown names raise TypeError)."""
    dataset = DATASETS[name]
    return command(f"Tokenize {dataset.title} with the checkpoint's tokenizer.", flags(dataset),
                   lambda **values: _prepare(dataset, **values), name="prepare", returns=None)


def prepare_dataset(name: str, **flag_values: Any) -> None:
    """Prepare DATASETS[name] as `python scripts/prepare_{name}.py --FLAG VALUE ...` does (unset flags: their
    defaults)."""
    make_prepare(name)(**flag_values)


# ---------------------------------------------------------------------------------------------------------------
# The one implementation
# ---------------------------------------------------------------------------------------------------------------
def _prepare(
    dataset: Dataset,
    *,
    destination_path: Path,
    checkpoint_dir: Path,
    data_file: Optional[Path],
    val_split_fraction: float,
    seed: int,
    mask_inputs: bool,
    max_seq_length: Optional[int],
    prompt_style: str,
    on_bad_rows: str,
    overwrite: bool = False,
    access_token: Optional[str] = None,
    include_multiturn_conversations: bool = False,
    instruction_key: Optional[str] = None,
    input_key: Optional[str] = None,
    output_key: Optional[str] = None,
    delimiter: Optional[str] = None,
) -> None:
    if data_file is None:
        data_file = _fetch(dataset, Path(destination_path), access_token)
    if dataset.file_format == "csv":
        records, bad = read_csv_records(data_file, delimiter)
    elif dataset.file_format == "json":
        records, bad = read_json_records(data_file)
    else:
        records, bad = read_records(data_file)
    if dataset.conversations:
        to_rows = conversation_rows(include_multiturn_conversations)
    elif dataset.field_flags:
        to_rows = instruction_rows(instruction_key, input_key, output_key)
    else:
        to_rows = instruction_rows(*dataset.fields)
    rows, bad_fields = records_to_rows(records, to_rows)
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
        overwrite=overwrite,
    )
    data.print_summary(meta, destination_path)


def _fetch(dataset: Dataset, destination: Path, access_token: Optional[str]) -> Path:
    """The dataset's file, downloaded into `destination` (kept there: a second run reads it again)."""
    if dataset.url is not None:
        return download(dataset.url, destination / dataset.url.rsplit("/", 1)[-1])
    if dataset.gated_hub_file is not None:
        return _download_gated(*dataset.gated_hub_file, destination, access_token or os.environ.get("HF_TOKEN"))
    raise LitError("pass your data file with --data_file")


def _download_gated(repo_id: str, filename: str, destination: Path, token: Optional[str]) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, filename, repo_type="dataset", token=token, local_dir=destination))
    except Exception as e:  # huggingface_hub raises many types (gated, offline, 404); all mean the same to the user
        raise LitError(
            f"cannot download {repo_id}/{filename} ({type(e).__name__}); it is gated: accept its terms on the Hub and"
            " pass --access_token (or set HF_TOKEN), or give a local copy with --data_file"
        ) from None
