"""Batches for training: prepared samples -> right-padded, shifted micro-batches.

`TrainBatches` is a resumable stream of micro-batches for one rank (shuffled from a seed; its position is part of
every checkpoint), `val_batches` the fixed validation batches. Batches are right-padded to a length from a small
set (`pad_length`) so that a tracing backend compiles a bounded number of step graphs.
"""

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from lit_gpt.config import next_power_of_two
from lit_gpt.utils import LitError

IGNORE_INDEX = -100  # the label of a position that never counts in the loss (a masked prompt, padding)

Sample = Dict[str, torch.Tensor]  # {"input_ids": (T,) int64, "labels": (T,) int64}


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
        collate_fn: Optional[Callable[..., Dict[str, Any]]] = None,
        packed: bool = False,
    ) -> None:
        self.samples = samples
        self.packed = packed  # the items are packed rows (lit_gpt.packing): a checkpoint's position counts those
        self.micro_batch_size = micro_batch_size
        self.max_seq_length = max_seq_length
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.pad_multiple = pad_multiple
        self.pad_pow2 = pad_pow2
        self.collate_fn = collate_fn or collate  # an objective's (lit_gpt.objectives): DPO stacks pairs
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
        return self.collate_fn(batch, self.max_seq_length, self.pad_multiple, self.pad_pow2)

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "world_size": self.world_size,
                "packed": self.packed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed or state.get("world_size", self.world_size) != self.world_size:
            raise LitError(
                f"the checkpoint's data order (seed {state.get('seed')}, {state.get('world_size')} devices) differs"
                f" from this run's (seed {self.seed}, {self.world_size} devices): resume with the same --train.seed"
                " and --devices"
            )
        if bool(state.get("packed", False)) != self.packed:
            raise LitError(
                f"the checkpoint was trained with --data.packing {str(bool(state.get('packed'))).lower()}: resume with"
                " the same setting (its data position counts packed rows, not samples, or the other way round)"
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
    collate_fn: Optional[Callable[..., Dict[str, Any]]] = None,
) -> List[Dict[str, Any]]:
    """The validation micro-batches of one rank: the first `max_iters` micro-batches of the validation set (all if
    None), batch k going to rank k % world_size. The validation set is thus the same whatever the number of
    devices; a rank may get none: sum losses over ranks, not means."""
    groups = [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
    if max_iters is not None:
        groups = groups[:max_iters]
    mine = groups[rank::world_size]
    return [(collate_fn or collate)(g, max_seq_length, pad_multiple, pad_pow2) for g in mine]
