"""Raw instruction data -> checked rows: reading JSON / JSON-lines / CSV files with the line number of every
record, turning records into `Row`s (instruction, input, output[, history]) and every unusable record into a
`BadRow` that names its line, and downloading a dataset's file.

`lit_gpt.data` tokenizes the rows; `lit_gpt.prepare` names the datasets and the record-to-rows function of each.
"""

import csv
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from lit_gpt.utils import LitError, remove_stale_temp_files

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


def conversation_rows(multiturn: bool = False) -> Callable[[Any], List[RowFields]]:
    """A record-to-rows function for conversations ({"conversations": [user, assistant, user, ...]}, as LIMA):
    the first (user, assistant) exchange, or with `multiturn` every exchange, each with the earlier turns of its
    conversation as history."""

    def to_rows(record: Any) -> List[RowFields]:
        if not isinstance(record, dict):
            raise BadRowError(f"expected an object, got {type(record).__name__}")
        turns = record.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            raise BadRowError("'conversations' must be a list of at least 2 turns (user, assistant)")
        for i, turn in enumerate(turns):
            check_text(turn, f"turn {i + 1} of 'conversations'")
        pairs = [(turns[i], turns[i + 1]) for i in range(0, len(turns) - 1, 2)]
        if not multiturn:
            pairs = pairs[:1]
        rows: List[RowFields] = []
        history: List[Tuple[str, str]] = []
        for user, assistant in pairs:
            # the earlier exchanges are the history of a later one: its answer is learned in context
            rows.append((user, "", assistant, tuple(history)))
            history += [("user", user), ("assistant", assistant)]
        return rows

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
