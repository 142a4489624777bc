"""The training losses: summed next-token cross-entropy over the labelled positions, in float32 and in chunks.

`lit_gpt.training.fit` divides the sums by the optimizer step's target-token count, so the logged loss is the mean
per target token over the whole step on every backend."""

from typing import Optional

import torch
import torch.nn as nn

from lit_gpt.batches import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-ignored labels, in float32, in chunks of rows so that the
    float32 copy of a (rows, vocab) block never exists whole."""
    logits = logits.reshape(-1, logits.size(-1))
    labels = labels.reshape(-1)
    parts = [
        nn.functional.cross_entropy(lc.float(), tc, ignore_index=IGNORE_INDEX, reduction="sum")
        for lc, tc in zip(logits.split(chunk_rows), labels.split(chunk_rows))
    ]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def labelled_rows(labels: torch.Tensor) -> Optional[torch.Tensor]:
    """Flat indices of the positions that have a label, or None when all have one. The loop takes them from the
    host batch before it goes to the device: a `nonzero` of device labels makes the host wait for the GPU (the
    result's size must be known) once per micro-batch."""
    flat = labels.reshape(-1)
    rows = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    return None if rows.numel() == flat.numel() else rows


def loss_sum(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, targets_only: bool = True,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy over the labelled positions of a batch.

    With `targets_only` the vocabulary projection (the largest matmul of a small model) runs only on the positions
    that have a label: not on the masked prompts nor on the padding. That makes the shape data-dependent, which
    tracing backends avoid (their runtime says `targets_only = False`). `rows`: `labelled_rows(labels)`, already
    on the device (computed from `labels` here when not given)."""
    if targets_only:
        rows = labelled_rows(labels) if rows is None else rows
        if rows is not None:
            if rows.numel() == 0:  # nothing to learn in this batch: a zero loss that still has a graph
                return model(input_ids[:, :1]).sum() * 0.0
            logits = model(input_ids, head_rows=rows)
            return cross_entropy_sum(logits, labels.reshape(-1).index_select(0, rows))
    return cross_entropy_sum(model(input_ids), labels)
