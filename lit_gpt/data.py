"""Instruction data for finetuning: read, check, tokenize, split, save, load and batch.

Preparation (`scripts/prepare_*.py`):
  raw file (JSON array, JSON lines or CSV) -> records with their line numbers -> `Row`s (instruction, input,
  output), every bad record reported with its line number -> token `Sample`s: prompt tokens (the prompt style
  applied to instruction + input) followed by the response tokens and EOS, the prompt masked with -100 in the
  labels -> a deterministic train/val split -> `train.pt` / `val.pt` (lists of {"input_ids", "labels"} int64
  tensors, `torch.save`) and `meta.json` (tokenizer, prompt style, lengths, counts, skipped rows).

Training (the GPU/CPU and the XLA recipes): `load_prepared` checks the files and the tokenizer, `TrainBatches`
is a resumable stream of micro-batches for one rank (shuffled from a seed; its position is part of every
checkpoint), `val_batches` the fixed validation batches. Batches are right-padded to a length from a small set
(`pad_length`) so that a tracing backend compiles a bounded number of step graphs.
"""

import csv
import hashlib
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from lit_gpt.config import next_power_of_two
from lit_gpt.utils import LitError, error_reason, remove_stale_temp_files, write_atomic, write_text_atomic

IGNORE_INDEX = -100
FORMAT_VERSION = 1
META_FILE = "meta.json"
TRAIN_FILE = "train.pt"
VAL_FILE = "val.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

Sample = Dict[str, torch.Tensor]  # {"input_ids": (T,) int64, "labels": (T,) int64}
# (line number where the record starts, the parsed JSON object / CSV row dict[, 1-based element number in a JSON
# array: several elements can start on one line, and a row number finds them where a line number cannot])
Record = Tuple[Any, ...]


# ---------------------------------------------------------------------------------------------------------------
# Rows and their problems
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One instruction example, with the line of the source file it came from."""

    line: int
    instruction: str
    input: str
    output: str
    history: Tuple[Tuple[str, str], ...] = ()
    """Earlier turns of a conversation as (role, content) pairs, rendered by the prompt style before this one."""
    element: Optional[int] = None
    """1-based element number in a JSON array (None for JSON lines and CSV, where the line is the row)."""


@dataclass
class BadRow:
    line: int
    reason: str
    element: Optional[int] = None  # 1-based element number in a JSON array

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"

    @property
    def where(self) -> str:
        return f"row {self.element} (line {self.line})" if self.element is not None else f"line {self.line}"


class BadRowError(ValueError):
    """Raised by a record-to-rows function: the record is unusable for the given reason."""


def _has_surrogates(text: str) -> bool:
    # bytes that are not UTF-8 are decoded with "surrogateescape" into lone surrogates; JSON "\udXXX" escapes
    # without their pair end up the same way. Neither can be encoded (or tokenized) as UTF-8.
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def check_text(value: Any, what: str, allow_empty: bool = False) -> str:
    """`value` if it is a non-empty UTF-8 string, else BadRowError naming `what`."""
    if not isinstance(value, str):
        raise BadRowError(f"{what} is not a string (got {type(value).__name__})")
    if _has_surrogates(value):
        raise BadRowError(f"{what} is not valid UTF-8")
    if not allow_empty and not value.strip():
        raise BadRowError(f"{what} is empty")
    return value


def get_text(record: Any, key: str, required: bool = True) -> str:
    """`record[key]` as a checked string: raises BadRowError for a missing, non-string, empty or non-UTF-8 value.
    An optional field may be missing or empty ("")."""
    if not isinstance(record, dict):
        raise BadRowError(f"expected an object with fields, got {type(record).__name__}")
    value = record.get(key)
    if value is None:
        if required:
            raise BadRowError(f"missing field {key!r}")
        return ""
    return check_text(value, f"field {key!r}", allow_empty=not required)


RowFields = Tuple[Any, ...]  # (instruction, input, output) or (instruction, input, output, history)


def instruction_rows(
    instruction_key: str = "instruction", input_key: Optional[str] = "input", output_key: str = "output"
) -> Callable[[Any], List[RowFields]]:
    """A record-to-rows function for flat records: instruction (required), input (optional), output (required)."""

    def to_rows(record: Any) -> List[RowFields]:
        instruction = get_text(record, instruction_key)
        inp = get_text(record, input_key, required=False) if input_key else ""
        output = get_text(record, output_key)
        return [(instruction, inp, output)]

    return to_rows


def records_to_rows(
    records: Sequence[Record], to_rows: Callable[[Any], List[RowFields]]
) -> Tuple[List[Row], List[BadRow]]:
    """Apply `to_rows` to every record; a record it rejects (BadRowError) becomes a BadRow with its line."""
    rows: List[Row] = []
    bad: List[BadRow] = []
    for line, record, *rest in records:
        element = rest[0] if rest else None
        try:
            rows.extend(
                Row(line, *r[:3], tuple(tuple(t) for t in (r[3] if len(r) > 3 else ())), element=element)
                for r in to_rows(record)
            )
        except BadRowError as e:
            bad.append(BadRow(line, str(e), element))
    return rows, bad


# ---------------------------------------------------------------------------------------------------------------
# Reading raw files, keeping line numbers
# ---------------------------------------------------------------------------------------------------------------
def _read_text(path: Path) -> str:
    path = Path(path)
    if path.is_dir():
        raise LitError(f"data file {str(path)!r} is a directory: pass the .json / .jsonl / .csv file in it")
    if not path.is_file():
        raise LitError(f"data file {str(path)!r} not found")
    # surrogateescape keeps going past bytes that are not UTF-8, so that the rows holding them can be reported
    # by line instead of failing the whole file
    return path.read_bytes().decode("utf-8", errors="surrogateescape").lstrip("\ufeff")


def _line_counter(text: str) -> Callable[[int], int]:
    """pos -> 1-based line number, for increasing positions (linear overall)."""
    state = {"pos": 0, "line": 1}

    def line_at(pos: int) -> int:
        state["line"] += text.count("\n", state["pos"], pos)
        state["pos"] = pos
        return state["line"]

    return line_at


def read_json_records(path: Path) -> Tuple[List[Record], List[BadRow]]:
    """Records of a JSON array file or a JSON-lines file (detected from the first character).

    In JSON lines each line is independent, so an unparseable line is a bad row. In a JSON array a syntax error
    makes the rest of the file unreadable: that rejects the file, naming the line."""
    text = _read_text(path)
    stripped = text.lstrip()
    if not stripped:
        raise LitError(f"data file {str(path)!r} is empty")
    if stripped[0] == "[":
        return _read_json_array(text, path), []
    return _read_json_lines(text)


def _read_json_array(text: str, path: Path) -> List[Record]:
    decoder = json.JSONDecoder()
    line_at = _line_counter(text)
    records: List[Record] = []

    def skip_ws(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def fail(i: int, what: str) -> LitError:
        return LitError(f"{path}:{line_at(i)}: invalid JSON ({what}); fix the file or convert it to JSON lines")

    i = skip_ws(0) + 1  # past "["
    i = skip_ws(i)
    if i < len(text) and text[i] == "]":
        return records
    while True:
        if i >= len(text):
            raise fail(i, "the array is not closed")
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise fail(e.pos, e.msg) from None
        except RecursionError:
            raise LitError(
                f"{path}:{line_at(i)}: row {len(records) + 1} of the JSON array is nested too deeply to read (more"
                f" than ~{sys.getrecursionlimit()} levels); a training row is an object of strings: fix that row"
            ) from None
        records.append((line_at(i), obj, len(records) + 1))
        i = skip_ws(end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(i + 1)
            continue
        if i < len(text) and text[i] == "]":
            if text[i + 1 :].strip():
                raise fail(i + 1, "extra data after the array")
            return records
        raise fail(i, "the array is not closed" if i >= len(text) else "expected ',' or ']' after an element")


def _read_json_lines(text: str) -> Tuple[List[Record], List[BadRow]]:
    records: List[Record] = []
    bad: List[BadRow] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            bad.append(BadRow(number, f"invalid JSON ({e.msg})"))
        except RecursionError:
            bad.append(BadRow(number, "JSON nested too deeply to read"))
    return records, bad


def read_csv_records(path: Path, delimiter: Optional[str] = None) -> Tuple[List[Record], List[BadRow]]:
    """Rows of a CSV/TSV file with a header line, as dicts keyed by the header; the delimiter is `\\t` for .tsv
    files and `,` otherwise unless given. A row with more cells than the header is a bad row; missing cells are
    None (reported as missing fields by the record-to-rows function)."""
    text = _read_text(path)
    if delimiter is None:
        delimiter = "\t" if Path(path).suffix.lower() == ".tsv" else ","
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    try:
        header = next(reader)
    except StopIteration:
        raise LitError(f"data file {str(path)!r} is empty") from None
    except csv.Error as e:
        raise LitError(f"{path}:1: cannot read the CSV header ({e})") from None
    header = [h.strip() for h in header]
    records: List[Record] = []
    bad: List[BadRow] = []
    prev_end = reader.line_num
    while True:
        start = prev_end + 1
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            # the csv module cannot resynchronise after a malformed quote: reject the file at that line
            raise LitError(f"{path}:{start}: malformed CSV ({e}); fix the quoting of that row") from None
        prev_end = reader.line_num
        if not cells or all(not c.strip() for c in cells):
            continue
        if len(cells) > len(header):
            bad.append(BadRow(start, f"{len(cells)} cells but the header has {len(header)} columns"))
            continue
        records.append((start, {h: (cells[j] if j < len(cells) else None) for j, h in enumerate(header)}))
    return records, bad


def read_records(path: Path) -> Tuple[List[Record], List[BadRow]]:
    """Records of a .json / .jsonl / .csv / .tsv file."""
    suffix = Path(path).suffix.lower()
    if suffix in (".csv", ".tsv"):
        return read_csv_records(path)
    if suffix in (".json", ".jsonl", ".ndjson"):
        return read_json_records(path)
    raise LitError(f"unsupported data file {str(path)!r}: use .json (an array or JSON lines), .jsonl or .csv")


def download(url: str, destination: Path) -> Path:
    """Download `url` to `destination` (atomically, with a progress bar) unless it is already there."""
    destination = Path(destination)
    if destination.is_file():
        return destination
    import urllib.error
    import urllib.request

    from tqdm import tqdm

    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(destination)  # an interrupted earlier download
    tmp = destination.with_name(f".{destination.name}.tmp{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {destination.name}") as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        os.replace(tmp, destination)
    except (urllib.error.URLError, OSError) as e:
        raise LitError(f"cannot download {url} ({e}); offline? pass a local copy with --data_file") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return destination


# ---------------------------------------------------------------------------------------------------------------
# Tokenizing
# ---------------------------------------------------------------------------------------------------------------
def _ids(tokens: Any) -> torch.Tensor:
    return torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)


def tokenize_row(
    row: Row, tokenizer: Any, prompt_style: Any, max_seq_length: int, mask_inputs: bool = True
) -> Tuple[Sample, bool]:
    """The sample of one row and whether it was truncated.

    The prompt and the response are encoded separately and concatenated: the prompt tokens are then exactly
    those the model sees at inference (where only the prompt is encoded), and the mask boundary is exact. Raises
    BadRowError when nothing of the response is left after truncation to `max_seq_length`."""
    history = list(row.history)
    if getattr(prompt_style, "name", "") == "alpaca":
        prompt = prompt_style.apply(row.instruction, history=history, input=row.input)
    else:  # styles without an input block (chat templates, raw) get it as a second paragraph of the message
        prompt = prompt_style.apply(row.instruction + (f"\n\n{row.input}" if row.input else ""), history=history)
    prompt_ids = _ids(tokenizer.encode(prompt, bos=getattr(prompt_style, "bos", None)))
    response_ids = _ids(tokenizer.encode(row.output, bos=False, eos=True))
    ids = torch.cat([prompt_ids, response_ids])
    truncated = ids.numel() > max_seq_length
    if truncated:
        ids = ids[:max_seq_length]
    if mask_inputs and prompt_ids.numel() >= ids.numel():
        raise BadRowError(
            f"the prompt alone has {prompt_ids.numel()} tokens, no room for the response within max_seq_length"
            f" {max_seq_length}"
        )
    labels = ids.clone()
    if mask_inputs:
        labels[: prompt_ids.numel()] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}, truncated


def tokenizer_fingerprint(checkpoint_dir: Path) -> str:
    """sha256 of the checkpoint's tokenizer file(s): data prepared with one tokenizer must not train another."""
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = Path(checkpoint_dir) / name
        if path.is_file():
            h.update(name.encode())
            h.update(path.read_bytes())
            found = True
    if not found:
        raise LitError(
            f"no tokenizer ({' or '.join(TOKENIZER_FILES)}) in {str(checkpoint_dir)!r}: download and convert the"
            " model first"
        )
    return h.hexdigest()


def split_train_val(items: Sequence[Any], val_fraction: float, seed: int) -> Tuple[List[Any], List[Any]]:
    """A seeded random split; the validation set gets round(n * val_fraction) items, at least 1 when n >= 2 and
    val_fraction > 0."""
    if not 0.0 <= val_fraction < 1.0:
        raise LitError(f"--val_split_fraction must be in [0, 1), got {val_fraction}")
    n = len(items)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    val = [items[i] for i in sorted(order[:n_val])]
    train = [items[i] for i in sorted(order[n_val:])]
    return train, val


def _bad_order(b: BadRow) -> Tuple[int, int]:
    return (b.line, b.element or 0)


def report_bad_rows(bad: Sequence[BadRow], source: str, on_bad_rows: str, shown: int = 10) -> None:
    """`error`: raise a one-line LitError naming the first bad rows. `skip`: say on stderr which rows are skipped."""
    if on_bad_rows not in ("skip", "error"):
        raise LitError(f"--on_bad_rows must be 'skip' or 'error', got {on_bad_rows!r}")
    if not bad:
        return
    bad = sorted(bad, key=_bad_order)
    listed = "; ".join(str(b) for b in bad[:shown]) + (f"; and {len(bad) - shown} more" if len(bad) > shown else "")
    if on_bad_rows == "error":
        raise LitError(
            f"{source}: {len(bad)} bad row(s): {listed}. Fix them, or pass --on_bad_rows skip to leave them out"
        )
    print(f"warning: {source}: skipping {len(bad)} bad row(s): {listed} (all listed in {META_FILE})", file=sys.stderr)


def prepare(
    rows: Sequence[Row],
    bad: Sequence[BadRow],
    *,
    checkpoint_dir: Path,
    destination: Path,
    source: str,
    prompt_style: str = "alpaca",
    max_seq_length: Optional[int] = None,
    mask_inputs: bool = True,
    val_split_fraction: float = 0.05,
    seed: int = 42,
    on_bad_rows: str = "skip",
    extra_meta: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Tokenize, split and write `rows`; `bad` are the rows already found unusable while reading. Returns meta."""
    from tqdm import tqdm

    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise LitError(
            f"checkpoint directory {str(checkpoint_dir)!r} does not exist: the data is tokenized with the model's"
            " tokenizer, so download and convert the model first (or pass --checkpoint_dir)"
        )
    fingerprint = tokenizer_fingerprint(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_name(prompt_style, checkpoint_dir)
    if max_seq_length is None:
        from lit_gpt.config import load_config

        max_seq_length = load_config(checkpoint_dir).block_size
    if max_seq_length < 2:
        raise LitError(f"--max_seq_length must be >= 2 (got {max_seq_length})")
    created = check_destination(destination)
    try:
        return _prepare(rows, bad, checkpoint_dir, destination, source, prompt_style, max_seq_length, mask_inputs,
                        val_split_fraction, seed, on_bad_rows, extra_meta, fingerprint, tokenizer, style)
    except BaseException:
        _remove_empty(created)  # nothing was written: leave no empty folder behind
        raise


def _prepare(rows, bad, checkpoint_dir, destination, source, prompt_style, max_seq_length, mask_inputs,
             val_split_fraction, seed, on_bad_rows, extra_meta, fingerprint, tokenizer, style) -> Dict[str, Any]:
    from tqdm import tqdm

    bad = list(bad)
    total = len(rows) + len(bad)  # rows read (a row that fails tokenizing below is still one row)
    if total == 0:
        raise LitError(f"{source}: no rows at all; nothing to write")
    report_bad_rows(bad if on_bad_rows == "error" else [], source, on_bad_rows)  # fail before the slow part
    samples: List[Sample] = []
    truncated = 0
    for row in tqdm(rows, desc="tokenize", unit="rows", disable=len(rows) < 1000):
        try:
            sample, was_truncated = tokenize_row(row, tokenizer, style, max_seq_length, mask_inputs)
        except BadRowError as e:
            bad.append(BadRow(row.line, str(e), row.element))
            continue
        samples.append(sample)
        truncated += was_truncated
    report_bad_rows(bad, source, on_bad_rows)
    if not samples:
        raise LitError(
            f"{source}: none of the {total} rows is usable ({len(bad)} bad, see above); nothing to write. Fix the"
            " rows, or raise --max_seq_length if they were too long"
        )

    train, val = split_train_val(samples, val_split_fraction, seed)
    lengths = [s["input_ids"].numel() for s in samples]
    meta = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "tokenizer": {"checkpoint_dir": str(checkpoint_dir), "sha256": fingerprint},
        "prompt_style": prompt_style,
        # how the prompts were encoded: None = the tokenizer's own BOS rule, False = as the chat template wrote them
        "prompt_bos": style.bos,
        "max_seq_length": max_seq_length,
        "mask_inputs": mask_inputs,
        "seed": seed,
        "val_split_fraction": val_split_fraction,
        "counts": {
            "samples": len(samples),
            "train": len(train),
            "val": len(val),
            "truncated": truncated,
            "skipped": len(bad),
            "longest": max(lengths),
            "mean_length": round(sum(lengths) / len(lengths), 1),
        },
        "skipped_rows": [
            {"line": b.line, **({"row": b.element} if b.element is not None else {}), "reason": b.reason}
            for b in sorted(bad, key=_bad_order)
        ],
        **(extra_meta or {}),
    }
    write_prepared(destination, train, val, meta)
    return meta


def check_destination(destination: Path) -> List[Path]:
    """The output folder exists or can be made, and is writable: found before the tokenizing, not after it.
    Returns the folders it created (removed again by the caller if nothing gets written)."""
    destination = Path(destination)
    if destination.exists() and not destination.is_dir():
        raise LitError(f"--destination_path {str(destination)!r} is a file, not a folder: pass a folder")
    created = []
    missing = destination
    while not missing.exists():
        created.append(missing)
        missing = missing.parent
    try:
        destination.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LitError(f"cannot write --destination_path {str(destination)!r}: {error_reason(e)}") from None
    if not os.access(destination, os.W_OK | os.X_OK):
        _remove_empty(created)
        raise LitError(f"cannot write --destination_path {str(destination)!r}: permission denied")
    return created


def _remove_empty(folders: List[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            return


def print_summary(meta: Dict[str, Any], destination: Path) -> None:
    c = meta["counts"]
    print(
        f"Wrote {c['train']} training and {c['val']} validation samples to {destination}"
        f" (max_seq_length {meta['max_seq_length']}: {c['truncated']} truncated; longest {c['longest']} tokens,"
        f" mean {c['mean_length']}; {c['skipped']} row(s) skipped)"
    )


# ---------------------------------------------------------------------------------------------------------------
# Writing and reading the prepared split
# ---------------------------------------------------------------------------------------------------------------
def write_prepared(destination: Path, train: List[Sample], val: List[Sample], meta: Dict[str, Any]) -> None:
    """Write train.pt, val.pt, then meta.json, each atomically. meta.json goes last and the old one is removed
    first: a directory with a meta.json that names these counts is complete."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    (destination / META_FILE).unlink(missing_ok=True)
    write_atomic(destination / TRAIN_FILE, lambda f: torch.save(train, f))
    write_atomic(destination / VAL_FILE, lambda f: torch.save(val, f))
    write_text_atomic(destination / META_FILE, json.dumps(meta, indent=2) + "\n")


@dataclass
class PreparedData:
    train: List[Sample]
    val: List[Sample]
    meta: Dict[str, Any] = field(default_factory=dict)


def _check_samples(samples: Any, path: Path) -> List[Sample]:
    if not isinstance(samples, list):
        raise LitError(f"{str(path)!r} is not a prepared data file (expected a list of samples); prepare it again")
    for i, s in enumerate(samples):
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("input_ids"), torch.Tensor)
            and isinstance(s.get("labels"), torch.Tensor)
            and s["input_ids"].dim() == 1
            and s["input_ids"].shape == s["labels"].shape
            and s["input_ids"].numel() >= 2
        )
        if not ok:
            raise LitError(
                f"{str(path)!r}: sample {i} is not {{'input_ids', 'labels'}} 1-D tensors of equal length >= 2;"
                " prepare the data again"
            )
    return samples


def load_prepared(data_dir: Path, checkpoint_dir: Optional[Path] = None) -> PreparedData:
    """Read a prepared directory; with `checkpoint_dir`, check that it was tokenized with that model's tokenizer."""
    data_dir = Path(data_dir)
    meta_path = data_dir / META_FILE
    hint = "prepare it with e.g. python scripts/prepare_alpaca.py --checkpoint_dir <model> --destination_path"
    if not meta_path.is_file():
        raise LitError(f"no prepared data in {str(data_dir)!r} ({META_FILE} missing): {hint} {data_dir}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LitError(f"{str(meta_path)!r} is not valid JSON ({e}): {hint} {data_dir}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise LitError(f"{str(data_dir)!r} was prepared by an incompatible version: {hint} {data_dir}")
    if meta.get("prompt_style") == "chat" and "prompt_bos" not in meta:
        # before 2026-11-25 chat-template prompts got the tokenizer's own BOS as well; generation no longer adds it
        raise LitError(
            f"{str(data_dir)!r} holds chat-template prompts encoded by an earlier version (with the tokenizer's BOS,"
            f" which generation no longer adds, as transformers' apply_chat_template): {hint} {data_dir}"
        )
    if checkpoint_dir is not None:
        expected = meta.get("tokenizer", {}).get("sha256")
        if expected != tokenizer_fingerprint(checkpoint_dir):
            raise LitError(
                f"{str(data_dir)!r} was tokenized with the tokenizer of"
                f" {meta.get('tokenizer', {}).get('checkpoint_dir')!r}, not that of {str(checkpoint_dir)!r}:"
                f" prepare it again with --checkpoint_dir {checkpoint_dir}"
            )
    splits = []
    for name in (TRAIN_FILE, VAL_FILE):
        path = data_dir / name
        if not path.is_file():
            raise LitError(f"{str(path)!r} is missing: {hint} {data_dir}")
        try:
            samples = torch.load(path, weights_only=True)
        except Exception as e:  # torch raises several types for corrupt files; all mean "prepare again"
            raise LitError(f"cannot read {str(path)!r} ({type(e).__name__}): {hint} {data_dir}") from None
        splits.append(_check_samples(samples, path))
    return PreparedData(splits[0], splits[1], meta)


# ---------------------------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------------------------
def pad_length(length: int, max_seq_length: int, pad_multiple: int = 1, pad_pow2: bool = False) -> int:
    """The padded length of a batch whose longest input has `length` tokens.

    `pad_pow2` rounds up to a power of two, `pad_multiple` to a multiple; both are capped at `max_seq_length`
    (never below `length`). With powers of two the lengths form a set of ~log2(max_seq_length) buckets."""
    padded = length
    if pad_pow2:
        padded = next_power_of_two(padded)
    if pad_multiple > 1:
        padded = math.ceil(padded / pad_multiple) * pad_multiple
    return max(length, min(padded, max_seq_length))


def collate(
    samples: Sequence[Sample],
    max_seq_length: int,
    pad_multiple: int = 1,
    pad_pow2: bool = False,
    pad_id: int = 0,
) -> Dict[str, Any]:
    """Stack samples into a right-padded batch, shifted for next-token prediction: `input_ids` are tokens
    0..T-2 of each sample and `labels` tokens 1..T-1 (padding is IGNORE_INDEX in the labels, so it never counts
    in the loss; right padding never influences the real positions under the causal mask). Samples are cropped
    to `max_seq_length` inputs. `n_tokens` counts the real (unpadded) input tokens."""
    inputs = [s["input_ids"][: max_seq_length + 1] for s in samples]
    labels = [s["labels"][: max_seq_length + 1] for s in samples]
    longest = max(x.numel() for x in inputs) - 1
    length = pad_length(longest, max_seq_length, pad_multiple, pad_pow2)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.int64)
    targets = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.int64)
    n_tokens = 0
    for i, (x, y) in enumerate(zip(inputs, labels)):
        n = x.numel() - 1
        input_ids[i, :n] = x[:-1]
        targets[i, :n] = y[1:]
        n_tokens += n
    return {"input_ids": input_ids, "labels": targets, "n_tokens": n_tokens}


def count_cropped(samples: Sequence[Sample], max_seq_length: int) -> int:
    """Samples longer than the model will see (max_seq_length inputs + the last target)."""
    return sum(s["input_ids"].numel() > max_seq_length + 1 for s in samples)


class TrainBatches:
    """The training micro-batches of one rank, epoch after epoch, deterministic and resumable.

    Epoch e uses the permutation drawn from `seed + e` (or the file order without `shuffle`). Each step of all
    ranks consumes `micro_batch_size * world_size` consecutive samples of the permutation; rank r takes its slice
    r of them. The tail that does not fill such a group is left out of that epoch (a different tail each epoch),
    so every rank runs the same number of micro-batches. `state_dict()` is (epoch, index): `load_state_dict`
    continues exactly where the saved run stopped."""

    def __init__(
        self,
        samples: Sequence[Sample],
        micro_batch_size: int,
        max_seq_length: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        pad_multiple: int = 1,
        pad_pow2: bool = False,
        batches_per_epoch: Optional[int] = None,
    ) -> None:
        self.samples = samples
        self.micro_batch_size = micro_batch_size
        self.max_seq_length = max_seq_length
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.pad_multiple = pad_multiple
        self.pad_pow2 = pad_pow2
        # micro-batches per epoch on each rank: as many as fit, or fewer (whole optimizer steps; the training loop
        # asks for those, so that every step of an epoch has a full global batch on any device layout)
        fit = len(samples) // (micro_batch_size * world_size)
        self.batches_per_epoch = fit if batches_per_epoch is None else min(batches_per_epoch, fit)
        if self.batches_per_epoch == 0:
            raise LitError(
                f"the training set has {len(samples)} samples, fewer than micro_batch_size ({micro_batch_size}) x"
                f" devices ({world_size}): lower --train.micro_batch_size or add data"
            )
        self.epoch = 0
        self.index = 0  # micro-batches of this epoch already returned
        self._order_epoch: Optional[int] = None
        self._order: List[int] = []

    def _permutation(self) -> List[int]:
        if self._order_epoch != self.epoch:
            n = len(self.samples)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(n, generator=g).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return self

    def __next__(self) -> Dict[str, Any]:
        if self.index >= self.batches_per_epoch:
            self.epoch += 1
            self.index = 0
        order = self._permutation()
        start = (self.index * self.world_size + self.rank) * self.micro_batch_size
        batch = [self.samples[i] for i in order[start : start + self.micro_batch_size]]
        self.index += 1
        return collate(batch, self.max_seq_length, self.pad_multiple, self.pad_pow2)

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed or state.get("world_size", self.world_size) != self.world_size:
            raise LitError(
                f"the checkpoint's data order (seed {state.get('seed')}, {state.get('world_size')} devices) differs"
                f" from this run's (seed {self.seed}, {self.world_size} devices): resume with the same --train.seed"
                " and --devices"
            )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])


def val_batches(
    samples: Sequence[Sample],
    micro_batch_size: int,
    max_seq_length: int,
    *,
    max_iters: Optional[int] = None,
    rank: int = 0,
    world_size: int = 1,
    pad_multiple: int = 1,
    pad_pow2: bool = False,
) -> List[Dict[str, Any]]:
    """The validation micro-batches of one rank: the first `max_iters` micro-batches of the validation set (all if
    None), batch k going to rank k % world_size. The validation set is thus the same whatever the number of
    devices; a rank may get none: sum losses over ranks, not means."""
    groups = [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
    if max_iters is not None:
        groups = groups[:max_iters]
    mine = groups[rank::world_size]
    return [collate(g, max_seq_length, pad_multiple, pad_pow2) for g in mine]
