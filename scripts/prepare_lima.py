"""Prepare LIMA (1k curated conversations, GAIR/lima on the Hugging Face Hub) for finetuning.

    HF_TOKEN=... python scripts/prepare_lima.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/prepare_lima.py --data_file my_copy/train.jsonl   # offline

LIMA is a gated dataset: accept its terms on the Hub and pass a token (--access_token or HF_TOKEN). Each record
holds "conversations", alternating user and assistant turns. By default only the first exchange of each is used;
with --include_multiturn_conversations every (user, assistant) pair becomes a sample, with the earlier turns of
its conversation as history in the prompt."""

import os
from pathlib import Path
from typing import Any, List, Literal, Optional, Tuple

from lit_gpt import data
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

REPO_ID = "GAIR/lima"
FILENAME = "train.jsonl"


def prepare(
    destination_path: Path = Path("data/lima"),
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    data_file: Optional[Path] = None,
    access_token: Optional[str] = None,
    include_multiturn_conversations: bool = False,
    val_split_fraction: float = 0.1,
    seed: int = 42,
    mask_inputs: bool = True,
    max_seq_length: Optional[int] = None,
    prompt_style: str = "alpaca",
    on_bad_rows: Literal["skip", "error"] = "skip",
) -> None:
    """Tokenize LIMA with the checkpoint's tokenizer.

    Args:
        destination_path: Where train.pt, val.pt and meta.json go.
        checkpoint_dir: The model whose tokenizer (and default max_seq_length) to use.
        data_file: A local copy of LIMA's train.jsonl; downloaded from the Hub if unset.
        access_token: Hugging Face token for the gated dataset (default: the HF_TOKEN environment variable).
        include_multiturn_conversations: Use every exchange of a conversation, not only the first.
        val_split_fraction: Share of the samples held out for validation.
        seed: Seed of the train/val split.
        mask_inputs: Mask the prompt tokens in the labels (train on the responses only).
        max_seq_length: Truncate samples to this many tokens (default: the model's context length).
        prompt_style: How a turn (and its history) becomes the prompt ("alpaca", "chat", "raw").
        on_bad_rows: "skip" bad rows (listed in the output and in meta.json) or stop with an "error".
    """
    if data_file is None:
        data_file = download(Path(destination_path), access_token or os.environ.get("HF_TOKEN"))
    records, bad = data.read_records(data_file)
    rows, bad_fields = data.records_to_rows(records, conversation_rows(include_multiturn_conversations))
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


def conversation_rows(multiturn: bool):
    def to_rows(record: Any) -> List[Tuple[str, str, str]]:
        if not isinstance(record, dict):
            raise data.BadRowError(f"expected an object, got {type(record).__name__}")
        turns = record.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            raise data.BadRowError("'conversations' must be a list of at least 2 turns (user, assistant)")
        for i, turn in enumerate(turns):
            data.check_text(turn, f"turn {i + 1} of 'conversations'")
        pairs = [(turns[i], turns[i + 1]) for i in range(0, len(turns) - 1, 2)]
        if not multiturn:
            pairs = pairs[:1]
        rows: List[Tuple[Any, ...]] = []
        history: List[Tuple[str, str]] = []
        for user, assistant in pairs:
            # the earlier exchanges are the history of a later one: its answer is learned in context
            rows.append((user, "", assistant, tuple(history)))
            history += [("user", user), ("assistant", assistant)]
        return rows

    return to_rows


def download(destination: Path, token: Optional[str]) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(REPO_ID, FILENAME, repo_type="dataset", token=token, local_dir=destination))
    except Exception as e:  # huggingface_hub raises many types (gated, offline, 404); all mean the same to the user
        raise LitError(
            f"cannot download {REPO_ID}/{FILENAME} ({type(e).__name__}); it is gated: accept its terms on the Hub and"
            " pass --access_token (or set HF_TOKEN), or give a local copy with --data_file"
        ) from None


if __name__ == "__main__":
    run_cli(prepare)
