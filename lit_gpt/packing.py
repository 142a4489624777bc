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
import itertools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from lit_gpt.attention import sink_attention, softcapped_attention
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
    (`GPT.segment_attention`: lit_gpt.xla.flash's, on XLA): `attend(q, k, v, segments, scale, **layer)` -> (B,
    n_head, T, head_size), causal within each document. `layer`: the layer's `window`, `softcapping` and `sinks`
    where it has them, for a kernel that takes every layer (`attend.any_layer`); plain causal layers pass none."""

    segments: torch.Tensor
    attend: Callable[..., torch.Tensor]
    window: Optional[int] = None


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


class DocumentSpans(NamedTuple):
    """Packed rows' documents as host-side spans, handed to the attention instead of a dense mask on eager backends
    (`document_attention`): per row, the (start, end) of each run of equal segment ids (the padding run at the end
    of a row is one more "document", as `document_mask` lets padding see padding), and the layer's sliding window."""

    spans: Tuple[Tuple[Tuple[int, int], ...], ...]
    window: Optional[int] = None


def document_spans(segments: torch.Tensor) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """Per row of `segments` (B, T), the (start, end) of each run of equal ids: one host read per forward (not per
    layer), which is why only eager backends take this path (a tracing one would bake the spans into its graph)."""
    out = []
    for row in segments.cpu():
        counts = torch.unique_consecutive(row, return_counts=True)[1].tolist()
        ends = list(itertools.accumulate(counts))
        out.append(tuple(zip([0] + ends[:-1], ends)))
    return tuple(out)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentSpans, scale: float,
                       softcapping: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of packed rows one document at a time: q (B, n_head, T, hs), k/v (B, n_query_groups, T, hs) ->
    (B, n_head, T, hs), equal to SDPA with `document_mask` (the same scores, minus the ones it masks) without its
    (B, 1, T, T) mask. A document of n tokens attends causally within itself: SDPA's causal kernel (memory O(n)),
    or with soft-capped scores or attention sinks the eager computations of `lit_gpt.attention` (O(n^2) per
    document, as unpacked). A sliding-window layer cuts a document longer than its window into chunks of `window`
    positions, each chunk's queries over its own and the previous chunk's keys: a (window, 2 window) mask per
    chunk, O(n window) in all."""
    gqa = k.size(1) != q.size(1)
    W = docs.window

    def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if sinks is not None:
            return sink_attention(qs, ks, vs, mask, scale, sinks)
        if softcapping is not None:
            return softcapped_attention(qs, ks, vs, mask, scale, softcapping)
        if mask is None:
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)

    rows = []
    # `split` into views (not slices): its backward concatenates the pieces' gradients once, where each slice's
    # backward would write a zero tensor of the whole row (time O(documents x T) per layer)
    for qr, kr, vr, spans in zip(q.split(1), k.split(1), v.split(1), docs.spans):
        sizes = [end - start for start, end in spans]
        parts = []
        for qd, kd, vd in zip(qr.split(sizes, 2), kr.split(sizes, 2), vr.split(sizes, 2)):
            n = qd.size(2)
            if W is None or n <= W:
                parts.append(attend(qd, kd, vd, None))
                continue
            # chunks of the window's size: chunk i's queries see the keys of chunks i - 1 and i within the window
            qc, kc, vc = qd.split(W, 2), kd.split(W, 2), vd.split(W, 2)
            parts.append(attend(qc[0], kc[0], vc[0], None))
            for i in range(1, len(qc)):
                m = qc[i].size(2)
                # query t of chunk i is key W + t of the pair of chunks: it sees keys W + t - (W - 1) .. W + t
                diff = torch.arange(W, W + m, device=q.device).unsqueeze(-1) - torch.arange(W + m, device=q.device)
                parts.append(attend(qc[i], torch.cat((kc[i - 1], kc[i]), 2), torch.cat((vc[i - 1], vc[i]), 2),
                                    (diff >= 0) & (diff < W)))
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


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
