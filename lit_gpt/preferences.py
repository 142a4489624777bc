"""Preference pairs for DPO: checked rows, token samples, the prepared folder and its loader.

`scripts/prepare_preferences.py` (`prepare_command`): a JSON array, JSON lines or CSV file of pairs -> records
with their line numbers (`lit_gpt.records`) -> `PreferenceRow`s, every unusable record a `BadRow` naming its line
-> per pair two SFT samples of the same prompt (`lit_gpt.data.tokenize_row`: the prompt rendered by the prompt
style and masked with -100, the reply followed by EOS, cropped to max_seq_length as the SFT data is) -> a seeded
train/val split -> `train.pt` / `val.pt` / `meta.json` (`lit_gpt.data.write_prepared`, meta["kind"] =
"preferences").

A row is one of (the fields of TRL's preference datasets):
  {"prompt": str, "chosen": R, "rejected": R}          standard; or "instruction" (+ optional "input") as the prompt
  {"messages": [msg, ...], "chosen": R, "rejected": R} the conversation up to the reply ("prompt" may be that list)
  {"chosen": [msg, ..., reply], "rejected": [msg, ..., reply]}  TRL's implicit prompt: the shared leading messages
where msg is {"role": "system" | "user" | "assistant", "content": str}, the prompt ends with the user's message and
a reply R is a string, an assistant message, or a list of messages: one assistant message, or the prompt's messages
followed by one (UltraFeedback's layout). The prompt is taken from "prompt", else "messages", else "instruction".
The chat template sees every role; the `alpaca` style renders no system message, `raw` concatenates the contents.

Each sample is four 1-D int64 tensors: "input_ids" / "labels" (prompt + chosen reply + EOS, the prompt masked),
"rejected_input_ids" / "rejected_labels" (the same prompt + rejected reply + EOS): a preference sample is also a
valid SFT sample of its chosen reply. The DPO loop reads the folder with `load_preferences`.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import torch

from lit_gpt import data
from lit_gpt.batches import IGNORE_INDEX, Sample
from lit_gpt.cli import Flag, command
from lit_gpt.prepare import OVERWRITE_HELP
from lit_gpt.records import BadRow, BadRowError, Record, Row, check_text, read_csv_records, read_json_records
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError

KIND = "preferences"  # meta["kind"] of a prepared folder of preference pairs
PAIR_KEYS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
ROLES = ("system", "user", "assistant")
_PROMPT_FIELDS = ("prompt", "messages", "instruction")

Message = Tuple[str, str]  # (role, content)


@dataclass
class PreferenceRow:
    """One preference pair: the prompt (`instruction` with its optional `input` and earlier turns `history`, as an
    SFT `Row`), the chosen and the rejected reply, and where it came from."""

    line: int
    instruction: str
    input: str
    history: Tuple[Message, ...]
    chosen: str
    rejected: str
    element: Optional[int] = None  # 1-based element number in a JSON array

    def sft_row(self, reply: str) -> Row:
        """The SFT row of this prompt and `reply`."""
        return Row(self.line, self.instruction, self.input, reply, self.history, element=self.element)


# ---------------------------------------------------------------------------------------------------------------
# Records -> rows
# ---------------------------------------------------------------------------------------------------------------
def _message(value: Any, what: str) -> Message:
    if not isinstance(value, dict):
        raise BadRowError(f"{what} is not a message {{'role', 'content'}} (got {type(value).__name__})")
    role = value.get("role")
    if role is None:
        raise BadRowError(f"{what} has no 'role'")
    if role not in ROLES:
        raise BadRowError(f"{what} has role {role!r}; the roles are {', '.join(ROLES)}")
    if value.get("content") is None:
        raise BadRowError(f"{what} has no 'content'")
    return role, check_text(value["content"], f"the content of {what}", allow_empty=role == "system")


def _messages(value: Any, key: str) -> List[Message]:
    if not isinstance(value, list):
        raise BadRowError(f"field {key!r} is not a list of messages (got {type(value).__name__})")
    return [_message(m, f"message {i + 1} of {key!r}") for i, m in enumerate(value)]


def _check_prompt(messages: Sequence[Message], what: str) -> List[Message]:
    """`messages` if they are a prompt: a system message first at most, the user's message last."""
    if not messages:
        raise BadRowError(f"{what} has no messages")
    for i, (role, _) in enumerate(messages):
        if role == "system" and i > 0:
            raise BadRowError(f"message {i + 1} of {what} is a system message; only the first message may be one")
    if messages[-1][0] != "user":
        raise BadRowError(
            f"the prompt ({what}) must end with the user's message, not the {messages[-1][0]}'s: it is the"
            " conversation up to the reply"
        )
    return list(messages)


def _reply(value: Any, key: str, prompt: Sequence[Message]) -> str:
    """The reply text of field `key`: a string, an assistant message, or a list of messages (one assistant message,
    or the prompt's messages followed by one)."""
    if isinstance(value, str):
        return check_text(value, f"field {key!r}")
    if isinstance(value, dict):
        messages = [_message(value, f"field {key!r}")]
    elif isinstance(value, list):
        messages = _messages(value, key)
    else:
        raise BadRowError(f"field {key!r} is not a string or an assistant message (got {type(value).__name__})")
    if len(messages) > 1 and prompt and messages[: len(prompt)] == list(prompt):
        messages = messages[len(prompt):]
    if len(messages) != 1:
        raise BadRowError(f"field {key!r} must hold one assistant message after the prompt, got {len(messages)}")
    role, content = messages[0]
    if role != "assistant":
        raise BadRowError(f"field {key!r} must be the assistant's reply, not a {role} message")
    return check_text(content, f"field {key!r}")


def preference_fields(record: Any) -> Tuple[str, str, Tuple[Message, ...], str, str]:
    """(instruction, input, history, chosen, rejected) of one record, or BadRowError saying what is wrong."""
    if not isinstance(record, dict):
        raise BadRowError(f"expected an object with fields, got {type(record).__name__}")
    for key in ("chosen", "rejected"):
        if record.get(key) is None:
            raise BadRowError(f"missing field {key!r}")
    inp = ""
    key = next((k for k in _PROMPT_FIELDS if record.get(k) is not None), None)
    if key is None:
        chosen, rejected = record["chosen"], record["rejected"]
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise BadRowError("missing the prompt: a 'prompt', 'messages' or 'instruction' field")
        # TRL's implicit prompt: the messages both conversations start with
        c, r = _messages(chosen, "chosen"), _messages(rejected, "rejected")
        shared = next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r)))
        if shared == 0:
            raise BadRowError("missing the prompt: 'chosen' and 'rejected' share no leading messages, and there is"
                              " no 'prompt' or 'messages' field")
        if c == r:
            raise BadRowError("'chosen' and 'rejected' are the same reply")
        prompt = _check_prompt(c[:shared], "the messages 'chosen' and 'rejected' start with")
    elif key == "instruction":
        instruction = check_text(record["instruction"], "field 'instruction'")
        if record.get("input") is not None:
            inp = check_text(record["input"], "field 'input'", allow_empty=True)
        prompt = [("user", instruction + (f"\n\n{inp}" if inp else ""))]
    elif isinstance(record[key], str):
        prompt = [("user", check_text(record[key], f"field {key!r}"))]
    elif isinstance(record[key], list):
        prompt = _check_prompt(_messages(record[key], key), f"field {key!r}")
    else:
        raise BadRowError(f"field {key!r} is not a string or a list of messages (got {type(record[key]).__name__})")
    chosen = _reply(record["chosen"], "chosen", prompt)
    rejected = _reply(record["rejected"], "rejected", prompt)
    if chosen == rejected:
        raise BadRowError("'chosen' and 'rejected' are the same reply")
    if key == "instruction":
        return instruction, inp, (), chosen, rejected
    return prompt[-1][1], "", tuple(prompt[:-1]), chosen, rejected


def records_to_preferences(records: Sequence[Record]) -> Tuple[List[PreferenceRow], List[BadRow]]:
    """`preference_fields` of every record; a record it rejects becomes a BadRow with its line (and element)."""
    rows: List[PreferenceRow] = []
    bad: List[BadRow] = []
    for line, record, *rest in records:
        element = rest[0] if rest else None
        try:
            rows.append(PreferenceRow(line, *preference_fields(record), element=element))
        except BadRowError as e:
            bad.append(BadRow(line, str(e), element))
    return rows, bad


def read_preferences(path: Path) -> Tuple[List[PreferenceRow], List[BadRow]]:
    """The pairs of a .csv / .tsv file (with a header line), or of a JSON array / JSON-lines file (any other
    suffix). A file none of whose records has the fields of a pair is refused in one line (LitError)."""
    path = Path(path)
    if path.suffix.lower() in (".csv", ".tsv"):
        records, bad = read_csv_records(path)
    else:
        records, bad = read_json_records(path)
    objects = [r[1] for r in records if isinstance(r[1], dict)]
    if records and not any(("chosen" in o or "rejected" in o) for o in objects):
        found = sorted({k for o in objects[:100] for k in o})
        have = f"its rows have the fields {', '.join(map(repr, found[:8]))}" if found else "its rows are not objects"
        hint = "; for instruction data use scripts/prepare_json.py" if {"instruction", "output"} <= set(found) else ""
        raise LitError(
            f"{path}: no row has 'chosen' and 'rejected' replies ({have}): a preference pair is"
            f" {{\"prompt\" or \"messages\", \"chosen\", \"rejected\"}}{hint}"
        )
    rows, bad_fields = records_to_preferences(records)
    return rows, bad + bad_fields


# ---------------------------------------------------------------------------------------------------------------
# Rows -> samples
# ---------------------------------------------------------------------------------------------------------------
def prompt_length(sample: Sample, key: str = "labels") -> int:
    """The number of masked tokens that start `sample[key]`: its prompt."""
    labels = sample[key]
    unmasked = (labels != IGNORE_INDEX).nonzero()
    return int(unmasked[0]) if unmasked.numel() else labels.numel()


def tokenize_pair(row: PreferenceRow, tokenizer: Any, prompt_style: Any, max_seq_length: int) -> Tuple[Sample, bool]:
    """The sample of one pair and whether a reply was cropped to `max_seq_length` (as `lit_gpt.data.tokenize_row`
    crops an SFT row). BadRowError when the prompt leaves no room for a reply, or the replies are the same within
    `max_seq_length` tokens (nothing to prefer)."""
    try:
        chosen, cut_chosen = data.tokenize_row(row.sft_row(row.chosen), tokenizer, prompt_style, max_seq_length)
        rejected, cut_rejected = data.tokenize_row(row.sft_row(row.rejected), tokenizer, prompt_style, max_seq_length)
    except LitError as e:  # the chat template refused this conversation (raise_exception): this row is bad
        raise BadRowError(str(e)) from None
    if torch.equal(chosen["input_ids"], rejected["input_ids"]):
        raise BadRowError(
            f"'chosen' and 'rejected' are the same within max_seq_length {max_seq_length} tokens; raise"
            " --max_seq_length or shorten the prompt"
        )
    sample = {"input_ids": chosen["input_ids"], "labels": chosen["labels"],
              "rejected_input_ids": rejected["input_ids"], "rejected_labels": rejected["labels"]}
    return sample, cut_chosen or cut_rejected


def pair_halves(sample: Sample) -> Tuple[Sample, Sample]:
    """The chosen and the rejected SFT samples ({"input_ids", "labels"}) of a preference sample."""
    return ({"input_ids": sample["input_ids"], "labels": sample["labels"]},
            {"input_ids": sample["rejected_input_ids"], "labels": sample["rejected_labels"]})


# ---------------------------------------------------------------------------------------------------------------
# Preparing a file
# ---------------------------------------------------------------------------------------------------------------
def prepare_preferences(
    data_file: Path,
    *,
    checkpoint_dir: Path,
    destination: Path,
    prompt_style: Optional[str] = None,
    max_seq_length: Optional[int] = None,
    val_split_fraction: float = 0.1,
    seed: int = 42,
    on_bad_rows: str = "skip",
    overwrite: bool = False,
) -> Dict[str, Any]:
    """Read, tokenize, split and write the pairs of `data_file` into `destination`; returns meta. `prompt_style`
    None: the checkpoint's (its chat template for an instruct/chat model that has one, else raw). Every error is one
    LitError line, and nothing is written. A destination that holds other prepared data is refused unless
    `overwrite` (`lit_gpt.data.check_overwrite`)."""
    from lit_gpt.prompts import PromptStyle

    if data_file is None:
        raise LitError("pass your preference file with --data_file")
    if on_bad_rows not in ("skip", "error"):
        raise LitError(f"--on_bad_rows must be 'skip' or 'error', got {on_bad_rows!r}")
    if not 0.0 <= val_split_fraction < 1.0:
        raise LitError(f"--val_split_fraction must be in [0, 1), got {val_split_fraction}")
    source = str(data_file)
    rows, bad = read_preferences(data_file)
    if not rows and not bad:
        raise LitError(f"{source}: no rows at all; nothing to write")
    data.report_bad_rows(bad if on_bad_rows == "error" else [], source, on_bad_rows)  # fail before the slow part
    checkpoint_dir, fingerprint, tokenizer, max_seq_length = data.tokenizing_setup(checkpoint_dir, max_seq_length,
                                                                                   "the pairs are")
    style = PromptStyle.from_checkpoint(checkpoint_dir, prompt_style)
    with data.writing_to(destination):
        return _tokenize_and_write(rows, list(bad), tokenizer, style, max_seq_length, source=source,
                                   destination=Path(destination), checkpoint_dir=checkpoint_dir,
                                   fingerprint=fingerprint, val_split_fraction=val_split_fraction, seed=seed,
                                   on_bad_rows=on_bad_rows, overwrite=overwrite)


def _tokenize_and_write(rows: List[PreferenceRow], bad: List[BadRow], tokenizer: Any, style: Any,
                        max_seq_length: int, *, source: str, destination: Path, checkpoint_dir: Path,
                        fingerprint: str, val_split_fraction: float, seed: int, on_bad_rows: str,
                        overwrite: bool = False) -> Dict[str, Any]:
    from tqdm import tqdm

    total = len(rows) + len(bad)
    samples: List[Sample] = []
    truncated = 0
    for row in tqdm(rows, desc="tokenize", unit="pairs", disable=len(rows) < 1000):
        try:
            sample, was_truncated = tokenize_pair(row, tokenizer, style, max_seq_length)
        except BadRowError as e:
            bad.append(BadRow(row.line, str(e), row.element))
            continue
        samples.append(sample)
        truncated += was_truncated
    data.report_bad_rows(bad, source, on_bad_rows)
    if not samples:
        raise LitError(
            f"{source}: none of the {total} rows is usable ({len(bad)} bad, see above); nothing to write. Fix the"
            " rows, or raise --max_seq_length if they were too long"
        )
    train, val = data.split_train_val(samples, val_split_fraction, seed)
    lengths = [s[k].numel() for s in samples for k in ("input_ids", "rejected_input_ids")]
    prompts = [prompt_length(s) for s in samples]
    meta = data.prepared_meta(
        source=source, checkpoint_dir=checkpoint_dir, fingerprint=fingerprint, prompt_style=style.name,
        prompt_bos=style.bos,  # None = the tokenizer's own BOS rule, False = as the chat template wrote them
        max_seq_length=max_seq_length, mask_inputs=True,  # the prompt is always masked: DPO scores the replies only
        seed=seed, val_split_fraction=val_split_fraction, split=(len(train), len(val)), truncated=truncated, bad=bad,
        lengths=lengths, extra={"kind": KIND, "counts": {"longest_prompt": max(prompts)}})
    data.write_prepared(destination, train, val, meta, overwrite)
    return meta


def print_summary(meta: Dict[str, Any], destination: Path) -> None:
    c = meta["counts"]
    print(
        f"Wrote {c['train']} training and {c['val']} validation preference pairs to {destination}"
        f" (prompt style {meta['prompt_style']}, max_seq_length {meta['max_seq_length']}: {c['truncated']} pair(s)"
        f" cropped; longest {c['longest']} tokens, mean {c['mean_length']}; {c['skipped']} row(s) skipped)"
    )


# ---------------------------------------------------------------------------------------------------------------
# Loading (the DPO loop)
# ---------------------------------------------------------------------------------------------------------------
def _check_pairs(samples: List[Sample], path: Path) -> None:
    for i, s in enumerate(samples):
        ok = all(isinstance(s.get(k), torch.Tensor) and s[k].dim() == 1 for k in PAIR_KEYS)
        ok = ok and s["rejected_input_ids"].shape == s["rejected_labels"].shape and s["rejected_input_ids"].numel() >= 2
        if ok:
            n = prompt_length(s)
            shortest = min(s["labels"].numel(), s["rejected_labels"].numel())
            ok = (n == prompt_length(s, "rejected_labels") and n < shortest
                  and torch.equal(s["input_ids"][:n], s["rejected_input_ids"][:n]))
        if not ok:
            raise LitError(
                f"{str(path)!r}: sample {i} is not a preference pair ({', '.join(PAIR_KEYS)}: 1-D tensors, the same"
                " masked prompt, a reply in each); prepare the data again with scripts/prepare_preferences.py"
            )


def load_preferences(data_dir: Path, checkpoint_dir: Optional[Path] = None) -> "data.PreparedData":
    """A folder written by scripts/prepare_preferences.py, checked as `lit_gpt.data.load_prepared` checks SFT data
    (format, tokenizer of `checkpoint_dir`), plus: meta["kind"] is "preferences" and every sample is a pair."""
    data_dir = Path(data_dir)
    prepared = data.load_prepared(data_dir, checkpoint_dir)
    if prepared.meta.get("kind") != KIND:
        raise LitError(
            f"{str(data_dir)!r} holds instruction data, not preference pairs: prepare a file of"
            f" {{prompt, chosen, rejected}} rows with python scripts/prepare_preferences.py --data_file FILE"
            f" --checkpoint_dir {checkpoint_dir or '<model>'} --destination_path DIR"
        )
    _check_pairs(prepared.train, data_dir / data.TRAIN_FILE)
    _check_pairs(prepared.val, data_dir / data.VAL_FILE)
    return prepared


def check_replies_fit(samples: Sequence[Sample], max_seq_length: int, what: str = "training") -> None:
    """LitError unless every reply keeps at least one token where the loop crops a sample (to max_seq_length
    inputs + the last target, `lit_gpt.batches.collate`): the prompt must be shorter than max_seq_length + 1."""
    longest = max((prompt_length(s) for s in samples), default=0)
    if longest > max_seq_length:
        raise LitError(
            f"a {what} pair has a prompt of {longest} tokens, which leaves no reply within --train.max_seq_length"
            f" {max_seq_length}: raise it to at least {longest}, or prepare the data with a smaller --max_seq_length"
        )


# ---------------------------------------------------------------------------------------------------------------
# The command line of scripts/prepare_preferences.py
# ---------------------------------------------------------------------------------------------------------------
FLAGS: List[Flag] = [
    Flag("data_file", Optional[Path], None,
         "The .json (an array or JSON lines), .jsonl or .csv file of {prompt or messages, chosen, rejected} rows."),
    Flag("destination_path", Path, Path("data/preferences"), "Where train.pt, val.pt and meta.json go."),
    Flag("checkpoint_dir", Path, DEFAULT_CHECKPOINT_DIR,
         "The model whose tokenizer, prompt style and default max_seq_length to use."),
    Flag("val_split_fraction", float, 0.1, "Share of the pairs held out for validation."),
    Flag("seed", int, 42, "Seed of the train/val split."),
    Flag("max_seq_length", Optional[int], None,
         "Crop each prompt + reply to this many tokens (default: the model's context length); a prompt must leave"
         " room for a reply."),
    Flag("prompt_style", Optional[str], None,
         'How the prompt (and the conversation before it) is rendered ("chat", "alpaca", "raw"; default: the'
         " checkpoint's chat template for instruct/chat models, else raw). Always masked in the labels."),
    Flag("on_bad_rows", Literal["skip", "error"], "skip",
         '"skip" bad rows (listed in the output and in meta.json) or stop with an "error".'),
    Flag("overwrite", bool, False, OVERWRITE_HELP),
]


def _run(*, data_file: Optional[Path], destination_path: Path, checkpoint_dir: Path, val_split_fraction: float,
         seed: int, max_seq_length: Optional[int], prompt_style: Optional[str], on_bad_rows: str,
         overwrite: bool) -> None:
    meta = prepare_preferences(data_file, checkpoint_dir=checkpoint_dir, destination=destination_path,
                               prompt_style=prompt_style, max_seq_length=max_seq_length,
                               val_split_fraction=val_split_fraction, seed=seed, on_bad_rows=on_bad_rows,
                               overwrite=overwrite)
    print_summary(meta, destination_path)


def prepare_command() -> Callable[..., None]:
    """The entry function of scripts/prepare_preferences.py (its signature and docstring are its command line)."""
    return command("Tokenize preference pairs (a prompt, a chosen and a rejected reply) for DPO with the"
                   " checkpoint's tokenizer and prompt style.", FLAGS, _run, name="prepare", returns=None)

