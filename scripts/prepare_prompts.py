"""Prepare prompts with their answers for GRPO (finetune/grpo.py): the model writes the replies itself, the reward
functions score them against the row's fields.

    python scripts/prepare_prompts.py --data_file additions.jsonl --destination_path data/prompts \\
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

The file is a JSON array, JSON lines or a CSV file of rows {"prompt": str, "answer": ..., other fields...}; the
prompt may also be a conversation, a list of {"role", "content"} messages ending with the user's (TRL's
conversational prompts). The prompt is rendered with the checkpoint's prompt style (its chat template for an instruct
model, the generation prompt included) and tokenized; every other field (the answer first) is kept and passed to the
reward functions by name, as TRL passes a dataset's columns. Bad rows (not an object, a missing or empty prompt, a
missing answer, a prompt too long for --max_seq_length) are reported with their line numbers and skipped, or rejected
with --on_bad_rows error, as scripts/prepare_json.py and prepare_preferences.py do."""

from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple

from lit_gpt import data
from lit_gpt.cli import Flag, command
from lit_gpt.grpo import KIND, prompt_sample
from lit_gpt.prepare import OVERWRITE_HELP
from lit_gpt.records import BadRow, BadRowError, check_text, read_records
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError

ROLES = ("system", "user", "assistant")


def _prompt(value: Any, field: str) -> Tuple[str, Tuple[Tuple[str, str], ...]]:
    """(the user's message, the conversation before it) of a prompt field."""
    if isinstance(value, list):
        if not value:
            raise BadRowError(f"field {field!r} is an empty conversation")
        turns = []
        for i, m in enumerate(value):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise BadRowError(f"message {i + 1} of {field!r} is not {{'role': system|user|assistant, 'content'}}")
            turns.append((m["role"], check_text(m.get("content"), f"message {i + 1} of {field!r}")))
        if turns[-1][0] != "user":
            raise BadRowError(f"the conversation in {field!r} must end with the user's message")
        return turns[-1][1], tuple(turns[:-1])
    if value is None:
        raise BadRowError(f"missing field {field!r}")
    return check_text(value, f"field {field!r}"), ()


def _fields(record: Dict[str, Any], prompt_field: str, answer_field: str) -> Dict[str, Any]:
    if record.get(answer_field) is None or (isinstance(record[answer_field], str) and not record[answer_field].strip()):
        raise BadRowError(f"missing field {answer_field!r}")
    out = {}
    for key, value in record.items():
        if key == prompt_field:
            continue
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            value = str(value)  # lists, objects: their text (the reward functions get plain values)
        out[key] = value
    if answer_field != "answer":
        out.setdefault("answer", out[answer_field])  # the built-in answer_match reads "answer"
    return out


def _run(*, data_file: Optional[Path], destination_path: Path, checkpoint_dir: Path, prompt_field: str,
         answer_field: str, val_split_fraction: float, seed: int, max_seq_length: Optional[int],
         prompt_style: Optional[str], on_bad_rows: str, overwrite: bool) -> None:
    from lit_gpt.prompts import PromptStyle

    if data_file is None:
        raise LitError("pass your prompt file with --data_file")
    data.report_bad_rows([], str(data_file), on_bad_rows)  # a bad --on_bad_rows value: one line, first
    if not 0.0 <= val_split_fraction < 1.0:
        raise LitError(f"--val_split_fraction must be in [0, 1), got {val_split_fraction}")
    source = str(data_file)
    records, bad = read_records(Path(data_file))
    if not records and not bad:
        raise LitError(f"{source}: no rows at all; nothing to write")
    rows: List[Tuple[int, Optional[int], str, Tuple, Dict[str, Any]]] = []
    for line, record, *rest in records:
        element = rest[0] if rest else None
        try:
            if not isinstance(record, dict):
                raise BadRowError(f"expected an object with fields, got {type(record).__name__}")
            text, history = _prompt(record.get(prompt_field), prompt_field)
            rows.append((line, element, text, history, _fields(record, prompt_field, answer_field)))
        except BadRowError as e:
            bad.append(BadRow(line, str(e), element))
    data.report_bad_rows(bad if on_bad_rows == "error" else [], source, on_bad_rows)  # fail before the slow part
    checkpoint_dir, fingerprint, tokenizer, max_seq_length = data.tokenizing_setup(checkpoint_dir, max_seq_length,
                                                                                   "the prompts are")
    style = PromptStyle.from_checkpoint(checkpoint_dir, prompt_style)
    samples = []
    for line, element, text, history, fields in rows:
        try:
            ids = data._ids(tokenizer.encode(style.apply(text, history=list(history)), bos=style.bos))
        except LitError as e:  # the chat template refused this conversation: this row is bad
            bad.append(BadRow(line, str(e), element))
            continue
        if ids.numel() >= max_seq_length or ids.numel() < 2:
            bad.append(BadRow(line, f"the prompt has {ids.numel()} tokens, no room for a reply within max_seq_length"
                                    f" {max_seq_length}", element))
            continue
        samples.append(prompt_sample(ids, fields))
    data.report_bad_rows(bad, source, on_bad_rows)
    if not samples:
        raise LitError(f"{source}: none of the {len(rows) + len(bad)} rows is usable ({len(bad)} bad, see above);"
                       " nothing to write")
    with data.writing_to(destination_path):
        train, val = data.split_train_val(samples, val_split_fraction, seed)
        meta = data.prepared_meta(
            source=source, checkpoint_dir=checkpoint_dir, fingerprint=fingerprint, prompt_style=style.name,
            prompt_bos=style.bos, max_seq_length=max_seq_length, mask_inputs=True, seed=seed,
            val_split_fraction=val_split_fraction, split=(len(train), len(val)), truncated=0, bad=bad,
            lengths=[s["input_ids"].numel() for s in samples], extra={"kind": KIND})
        data.write_prepared(Path(destination_path), train, val, meta, overwrite)
    c = meta["counts"]
    print(f"Wrote {c['train']} training and {c['val']} validation prompts to {destination_path} (prompt style"
          f" {meta['prompt_style']}; longest {c['longest']} tokens; {c['skipped']} row(s) skipped)")


FLAGS = [
    Flag("data_file", Optional[Path], None, "The .json (an array or JSON lines), .jsonl or .csv file of prompt rows."),
    Flag("destination_path", Path, Path("data/prompts"), "Where train.pt, val.pt and meta.json go."),
    Flag("checkpoint_dir", Path, DEFAULT_CHECKPOINT_DIR, "The model whose tokenizer and prompt style to use."),
    Flag("prompt_field", str, "prompt", "The field that holds the prompt (a string or a list of messages)."),
    Flag("answer_field", str, "answer", "The field that holds the answer (required; passed to the rewards)."),
    Flag("val_split_fraction", float, 0.1, "Share of the prompts held out for validation (the held-out reward)."),
    Flag("seed", int, 42, "Seed of the train/val split."),
    Flag("max_seq_length", Optional[int], None,
         "The longest prompt allowed, in tokens (default: the model's context)."),
    Flag("prompt_style", Optional[str], None,
         'How the prompt is rendered ("chat", "alpaca", "raw"; default: the checkpoint\'s chat template for'
         " instruct/chat models, else raw)."),
    Flag("on_bad_rows", Literal["skip", "error"], "skip",
         '"skip" bad rows (listed in the output and in meta.json) or stop with an "error".'),
    Flag("overwrite", bool, False, OVERWRITE_HELP),
]

prepare = command("Tokenize prompts (with their answers) for GRPO with the checkpoint's tokenizer and prompt style.",
                  FLAGS, _run, name="prepare", returns=None)

if __name__ == "__main__":
    from lit_gpt.utils import run_cli

    run_cli(prepare)
