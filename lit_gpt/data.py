"""Instruction data for finetuning: tokenize, split, save and load.

Preparation (`scripts/prepare_*.py`, one table of datasets in `lit_gpt.prepare`):
  raw file (JSON array, JSON lines or CSV) -> records with their line numbers -> `Row`s (instruction, input,
  output), every bad record reported with its line number (`lit_gpt.records`) -> token `Sample`s: prompt tokens
  (the prompt style applied to instruction + input) followed by the response tokens and EOS, the prompt masked
  with -100 in the labels -> a deterministic train/val split -> `train.pt` / `val.pt` (lists of {"input_ids",
  "labels"} int64 tensors, `torch.save`) and `meta.json` (tokenizer, prompt style, lengths, counts, skipped rows).

Training (the GPU/CPU and the XLA recipes): `load_prepared` checks the files and the tokenizer; the batches are
made by `lit_gpt.batches` (`TrainBatches`, `val_batches`).

The names of `lit_gpt.records` and `lit_gpt.batches` are importable from here too, where they lived before the
split: `from lit_gpt.data import TrainBatches` keeps working.
"""

import hashlib
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from lit_gpt.batches import IGNORE_INDEX, Sample, TrainBatches, collate, count_cropped, pad_length, val_batches
from lit_gpt.records import (
    BadRow,
    BadRowError,
    Record,
    Row,
    RowFields,
    check_text,
    conversation_rows,
    download,
    get_text,
    instruction_rows,
    read_csv_records,
    read_json_records,
    read_records,
    records_to_rows,
)
from lit_gpt.utils import LitError, error_reason, write_atomic, write_text_atomic

__all__ = [  # this module's own names, then the re-exported ones (see the module docstring)
    "FORMAT_VERSION", "META_FILE", "TRAIN_FILE", "VAL_FILE", "TOKENIZER_FILES", "PreparedData", "check_destination",
    "check_overwrite", "data_fingerprint", "describe_data", "load_prepared", "prepare", "prepared_record",
    "print_summary", "report_bad_rows", "split_train_val", "tokenize_row", "tokenizer_fingerprint", "write_prepared",
    "IGNORE_INDEX", "Sample", "TrainBatches", "collate", "count_cropped", "pad_length", "val_batches",
    "BadRow", "BadRowError", "Record", "Row", "RowFields", "check_text", "conversation_rows", "download", "get_text",
    "instruction_rows", "read_csv_records", "read_json_records", "read_records", "records_to_rows",
]

FORMAT_VERSION = 1
META_FILE = "meta.json"
TRAIN_FILE = "train.pt"
VAL_FILE = "val.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


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
    overwrite: bool = False,
) -> Dict[str, Any]:
    """Tokenize, split and write `rows`; `bad` are the rows already found unusable while reading. Returns meta.
    A destination that holds other prepared data is refused unless `overwrite` (`check_overwrite`)."""
    from lit_gpt.prompts import PromptStyle

    checkpoint_dir, fingerprint, tokenizer, max_seq_length = tokenizing_setup(checkpoint_dir, max_seq_length)
    style = PromptStyle.from_name(prompt_style, checkpoint_dir)
    with writing_to(destination):
        return _prepare(rows, bad, checkpoint_dir, destination, source, prompt_style, max_seq_length, mask_inputs,
                        val_split_fraction, seed, on_bad_rows, extra_meta, fingerprint, tokenizer, style, overwrite)


def tokenizing_setup(checkpoint_dir: Path, max_seq_length: Optional[int], what: str = "the data is"
                     ) -> Tuple[Path, str, Any, int]:
    """(checkpoint_dir, tokenizer fingerprint, tokenizer, max_seq_length: the model's context length when None) of a
    preparation, with one line for a missing checkpoint or a bad length."""
    from lit_gpt.tokenizer import Tokenizer

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise LitError(
            f"checkpoint directory {str(checkpoint_dir)!r} does not exist: {what} tokenized with the model's"
            " tokenizer, so download and convert the model first (or pass --checkpoint_dir)"
        )
    fingerprint = tokenizer_fingerprint(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    if max_seq_length is None:
        from lit_gpt.config import load_config

        max_seq_length = load_config(checkpoint_dir).block_size
    if max_seq_length < 2:
        raise LitError(f"--max_seq_length must be >= 2 (got {max_seq_length})")
    return checkpoint_dir, fingerprint, tokenizer, max_seq_length


@contextmanager
def writing_to(destination: Path) -> Iterator[None]:
    """Check the destination (`check_destination`); if the body fails, remove the folders it created (nothing was
    written: no empty folder is left behind)."""
    created = check_destination(destination)
    try:
        yield
    except BaseException:
        _remove_empty(created)
        raise


def _prepare(rows, bad, checkpoint_dir, destination, source, prompt_style, max_seq_length, mask_inputs,
             val_split_fraction, seed, on_bad_rows, extra_meta, fingerprint, tokenizer, style, overwrite
             ) -> Dict[str, Any]:
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
    meta = prepared_meta(source=source, checkpoint_dir=checkpoint_dir, fingerprint=fingerprint, prompt_style=prompt_style,
                         prompt_bos=style.bos, max_seq_length=max_seq_length, mask_inputs=mask_inputs, seed=seed,
                         val_split_fraction=val_split_fraction, split=(len(train), len(val)), truncated=truncated,
                         bad=bad, lengths=lengths, extra=extra_meta)
    write_prepared(destination, train, val, meta, overwrite)
    return meta


def prepared_meta(*, source: str, checkpoint_dir: Path, fingerprint: str, prompt_style: Any, prompt_bos: Any,
                  max_seq_length: Optional[int], mask_inputs: bool, seed: int, val_split_fraction: float,
                  split: Tuple[int, int], truncated: int, bad: Sequence[BadRow], lengths: Sequence[int],
                  extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """meta.json of a prepared folder (instruction data, and preference pairs with `extra` = their kind and counts):
    what was read, how it was tokenized, the split and the lengths, the skipped rows with their lines."""
    n_train, n_val = split
    meta = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "tokenizer": {"checkpoint_dir": str(checkpoint_dir), "sha256": fingerprint},
        "prompt_style": prompt_style,
        # how the prompts were encoded: None = the tokenizer's own BOS rule, False = as the chat template wrote them
        "prompt_bos": prompt_bos,
        "max_seq_length": max_seq_length,
        "mask_inputs": mask_inputs,
        "seed": seed,
        "val_split_fraction": val_split_fraction,
        "counts": {
            "samples": n_train + n_val,
            "train": n_train,
            "val": n_val,
            "truncated": truncated,
            "skipped": len(bad),
            "longest": max(lengths),
            "mean_length": round(sum(lengths) / len(lengths), 1),
        },
        "skipped_rows": [
            {"line": b.line, **({"row": b.element} if b.element is not None else {}), "reason": b.reason}
            for b in sorted(bad, key=_bad_order)
        ],
    }
    for key, value in (extra or {}).items():  # nested dicts (counts) are extended, not replaced
        meta[key] = {**meta[key], **value} if isinstance(value, dict) and isinstance(meta.get(key), dict) else value
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
def write_prepared(destination: Path, train: List[Sample], val: List[Sample], meta: Dict[str, Any],
                   overwrite: bool = False) -> None:
    """Write train.pt, val.pt, then meta.json, each atomically. meta.json goes last and the old one is removed
    first: a directory with a meta.json that names these counts is complete. meta gets the data's fingerprint
    (`data_fingerprint`); a folder that holds other prepared data is refused unless `overwrite` (the same data
    prepared again is written again: nothing that trained on it changes)."""
    destination = Path(destination)
    meta["fingerprint"] = data_fingerprint(train, val, meta)
    check_overwrite(destination, meta, overwrite)
    destination.mkdir(parents=True, exist_ok=True)
    (destination / META_FILE).unlink(missing_ok=True)
    write_atomic(destination / TRAIN_FILE, lambda f: torch.save(train, f))
    write_atomic(destination / VAL_FILE, lambda f: torch.save(val, f))
    write_text_atomic(destination / META_FILE, json.dumps(meta, indent=2) + "\n")


def data_fingerprint(train: Sequence[Sample], val: Sequence[Sample], meta: Dict[str, Any]) -> str:
    """The identity of prepared data: sha256 over every token of every sample (train, then val, in order: the
    rows, their count, the split), the tokenizer, the prompt style and the kind (instructions or preference pairs).
    The source file's path is not part of it: the same rows prepared the same way from a copy of the file, or
    into another folder, are the same data; one other token, row or split is other data."""
    h = hashlib.sha256()
    head = {"kind": meta.get("kind", "instructions"), "tokenizer": (meta.get("tokenizer") or {}).get("sha256"),
            "prompt_style": meta.get("prompt_style"), "prompt_bos": meta.get("prompt_bos")}
    h.update(json.dumps(head, sort_keys=True).encode())
    for split, samples in (("train", train), ("val", val)):
        h.update(f"\n{split} {len(samples)}".encode())
        for sample in samples:
            for key in sorted(k for k, v in sample.items() if isinstance(v, torch.Tensor)):
                ids = sample[key].detach().to(torch.int64).contiguous()
                h.update(f"\n{key} {ids.numel()}\n".encode())
                h.update(ids.numpy().tobytes())
    return "sha256:" + h.hexdigest()[:16]


def describe_data(meta: Dict[str, Any]) -> str:
    """"from 'rows.json', 40 samples, sha256:..." (what a refusal names of prepared data)."""
    samples = (meta.get("counts") or {}).get("samples")
    return f"from {meta.get('source')!r}, {samples} samples, {meta.get('fingerprint')}"


def check_overwrite(destination: Path, meta: Dict[str, Any], overwrite: bool) -> None:
    """Refuse (one LitError line naming both) to replace a complete prepared folder (its meta.json is there) that
    holds other data than `meta` describes, unless `overwrite`. A folder without meta.json holds no complete
    preparation (one that was killed, or only the cached download): written over."""
    if overwrite or not (Path(destination) / META_FILE).is_file():
        return
    try:
        old = json.loads((Path(destination) / META_FILE).read_text(encoding="utf-8"))
        if not isinstance(old, dict):
            raise ValueError("not an object")
        if "fingerprint" not in old:  # prepared by an earlier version: its identity from its files
            old["fingerprint"] = load_prepared(destination).meta["fingerprint"]
    except (LitError, ValueError, UnicodeDecodeError, RecursionError, OSError):
        old = {"source": "unreadable", "fingerprint": "unknown"}  # a damaged folder is not replaced silently either
    if old.get("fingerprint") == meta["fingerprint"]:
        return
    raise LitError(
        f"--destination_path {str(destination)!r} already holds other prepared data ({describe_data(old)}; this is"
        f" {describe_data(meta)}): refusing to overwrite (a run that trained on it could no longer resume). Pass"
        " --destination_path NEW_FOLDER, or --overwrite true to replace it"
    )


def prepared_record(meta: Dict[str, Any], data_dir: Path, packing: bool) -> Dict[str, Any]:
    """What a run's checkpoints record of the prepared data it trains on (finetune.json's "prepared"): its
    fingerprint, where it was, what it was prepared from, and how it was batched (--data.packing). A resumed run
    must train on data with the same fingerprint (`lit_gpt.checkpoints.check_same_run`)."""
    return {"fingerprint": meta.get("fingerprint"), "data_dir": str(data_dir), "source": meta.get("source"),
            "samples": (meta.get("counts") or {}).get("samples"), "prompt_style": meta.get("prompt_style"),
            "packing": bool(packing)}


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
    if not isinstance(meta.get("fingerprint"), str):  # prepared by an earlier version: computed from the files
        meta["fingerprint"] = data_fingerprint(splits[0], splits[1], meta)
    return PreparedData(splits[0], splits[1], meta)
