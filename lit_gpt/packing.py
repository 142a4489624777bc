"""Sequence packing (`--data.packing true`): samples concatenated into rows of exactly `max_seq_length` positions, so
that a training step computes tokens instead of padding, and every micro-batch has one shape (one compiled train
step on XLA).

    rows = pack(samples, max_seq_length)       # [[i, j, k], ...]: the samples of each row, deterministic
    batch = collate_packed([[samples[i] for i in row] for row in rows[:4]], max_seq_length)
    # input_ids, labels (B, max_seq_length) as `lit_gpt.batches.collate` shifts them, per document;
    # positions (B, L): each document's own 0, 1, 2, ... (RoPE); segments (B, L): 1, 2, ... per document, 0 = padding

What stays as without packing: each sample is shifted on its own (its last token is no input, its first no label),
cropped to `max_seq_length` inputs as `collate` crops it, and its labels (masked prompt, EOS) are its own, so the
loss is the same sum over the same target tokens, averaged per target token by the loop. A document attends to
itself only (`document_mask`; positions restart at 0 in each), which makes a packed forward equal to the samples'
unpacked forwards. What changes: `--train.micro_batch_size` and `--train.global_batch_size` count rows.

Packing is best-fit decreasing over the whole set (longest sample first, each into the fullest row it still fits),
done once: the same rows every epoch and after a resume (the loop shuffles the rows' order per epoch from the seed).
An epoch is still one pass over the samples: each is in exactly one row.
"""

import bisect
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from lit_gpt.batches import IGNORE_INDEX, Sample
from lit_gpt.utils import LitError


def sample_positions(sample: Sample, max_seq_length: int) -> int:
    """The input positions a sample takes in a row: its tokens but the last, cropped to `max_seq_length`."""
    return min(sample["input_ids"].numel() - 1, max_seq_length)


def pack(samples: Sequence[Sample], max_seq_length: int) -> List[List[int]]:
    """Rows of sample indices (each row's inputs fit `max_seq_length`), by best-fit decreasing: the samples from
    the longest down (ties in file order), each into the row with the least room that still takes it, else a new
    row. Deterministic; each row lists its samples in file order."""
    lengths = [sample_positions(s, max_seq_length) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: (-lengths[i], i))
    rows: List[List[int]] = []
    room: List[int] = []  # sorted free positions of the open rows
    which: List[int] = []  # row index of each entry of `room`
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(room, n)
        if at == len(room):
            rows.append([i])
            left, row = max_seq_length - n, len(rows) - 1
        else:
            row, left = which.pop(at), room.pop(at) - n
            rows[row].append(i)
        if left > 0:
            at = bisect.bisect_left(room, left)
            room.insert(at, left)
            which.insert(at, row)
    return [sorted(r) for r in rows]


def collate_packed(rows: Sequence[Sequence[Sample]], max_seq_length: int, pad_multiple: int = 1,
                   pad_pow2: bool = False, pad_id: int = 0) -> Dict[str, Any]:
    """A micro-batch of packed rows, each exactly `max_seq_length` positions (`pad_multiple` and `pad_pow2` do not
    apply: there is one length). Keys: input_ids, labels (as `collate`), positions, segments, n_tokens."""
    B, L = len(rows), max_seq_length
    input_ids = torch.full((B, L), pad_id, dtype=torch.int64)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros((B, L), dtype=torch.int64)
    segments = torch.zeros((B, L), dtype=torch.int64)
    n_tokens = 0
    for b, row in enumerate(rows):
        at = 0
        for d, sample in enumerate(row, start=1):
            n = sample_positions(sample, max_seq_length)
            if at + n > L:
                raise ValueError(f"a packed row holds {at + n} positions, more than {L}")
            input_ids[b, at : at + n] = sample["input_ids"][:n]
            labels[b, at : at + n] = sample["labels"][1 : n + 1]
            positions[b, at : at + n] = torch.arange(n)
            segments[b, at : at + n] = d
            at += n
        n_tokens += at
    return {"input_ids": input_ids, "labels": labels, "positions": positions, "segments": segments,
            "n_tokens": n_tokens}


class SegmentIds(NamedTuple):
    """Packed rows' document ids handed to the attention instead of a dense mask, with the kernel that takes them
    (`GPT.segment_attention`: torch_xla's flash attention on TPUs, lit_gpt.xla.flash): `attend(q, k, v, segments,
    scale)` -> (B, n_head, T, head_size), causal within each document."""

    segments: torch.Tensor
    attend: Callable[..., torch.Tensor]


def document_mask(segments: torch.Tensor, positions: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """(B, 1, T, T) boolean attention mask of packed rows: a query sees the keys of its own document (same segment
    id) at or before it (and, with a sliding `window`, fewer than `window` positions back). Padding (segment 0)
    sees padding: no row of the mask is empty."""
    same = segments.unsqueeze(-1) == segments.unsqueeze(-2)
    T = segments.size(-1)
    idx = torch.arange(T, device=segments.device)
    causal = idx.unsqueeze(-1) >= idx
    mask = same & causal
    if window is not None:
        mask = mask & (idx.unsqueeze(-1) - idx < window)
    return mask.unsqueeze(1)


def useful_fraction(batches: Sequence[Dict[str, Any]]) -> float:
    """Real input tokens over computed positions (rows x length) of some collated batches."""
    computed = sum(b["input_ids"].numel() for b in batches)
    return sum(int(b["n_tokens"]) for b in batches) / max(computed, 1)


def rows_of(samples: Sequence[Sample], rows: Sequence[Sequence[int]]) -> List[List[Sample]]:
    return [[samples[i] for i in row] for row in rows]


def pack_for_training(objective_name: str, train: Sequence[Sample], val: Sequence[Sample], max_seq_length: int,
                      say: Any = print) -> "tuple[List[List[Sample]], List[List[Sample]]]":
    """The training and validation samples packed into rows (each a list of samples) for `--data.packing true`,
    with a note of how full the rows are. Only supervised finetuning packs (one line otherwise)."""
    if objective_name != "sft":
        raise LitError(f"--data.packing packs instruction samples; {objective_name.upper()} trains on pairs, which"
                       " are not packed: leave --data.packing false")
    train_rows = rows_of(train, pack(train, max_seq_length))
    val_rows = rows_of(val, pack(val, max_seq_length)) if val else []
    used = sum(sample_positions(s, max_seq_length) for s in train)
    say(f"packing: {len(train)} training samples into {len(train_rows)} rows of {max_seq_length} positions"
        f" ({used / (len(train_rows) * max_seq_length):.1%} of the positions hold tokens)")
    return train_rows, val_rows
