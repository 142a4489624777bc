"""The KV cache of generation (one per attention layer, preallocated: static shapes) and the attention mask over it.

A cache has rows (sequences; the "slots" of a continuous batch) and positions. Writes go to an `input_pos` tensor:
(T,) positions shared by every row (`index_copy_`), or (B, T) positions per row, into chosen rows (`slots`); the
mask is computed from the same tensor, so a traced graph does not depend on the values.

A sliding-window layer whose window is shorter than the cache holds its window only: a ring of `window` entries,
position p in entry p mod window (transformers' sliding-window cache layers keep the window as well). Which position
an entry holds follows from the queries' positions, so the ring needs no bookkeeping of its own: a one-token step
writes its entry and attends over the ring; a longer forward (a prompt, a chunk of one) attends over the ring as it
was *and* its own keys (so a prompt longer than the window attends over all of it with the sliding mask), then
keeps the last window of them. Such a forward's positions run on from its first, each one more than the last; the
padding after a prompt (a length bucket) carries the position after the prompt's last (`Batch.join`), which the
first decode step overwrites.
"""

from typing import Optional, Tuple

import torch
import torch.nn as nn


def cache_mask(input_pos: torch.Tensor, cache_length: int, sliding_window_size: Optional[int] = None) -> torch.Tensor:
    """Boolean attention mask of the queries at `input_pos` over the KV cache's first `cache_length` positions:
    (T, cache_length) for shared (T,) positions, (B, 1, T, cache_length) for per-row (B, T) ones. Positions are
    tensors: the mask is computed from them, so one traced graph serves every step."""
    k_pos = torch.arange(cache_length, device=input_pos.device)
    mask = input_pos.unsqueeze(-1) >= k_pos
    if sliding_window_size is not None:
        mask = mask & (input_pos.unsqueeze(-1) - k_pos < sliding_window_size)
    return mask.unsqueeze(1) if input_pos.dim() == 2 else mask


def ring_positions(last: torch.Tensor, window: int, entries: int) -> torch.Tensor:
    """The positions the first `entries` ring entries hold when the latest written position is `last` ((B, 1)):
    (B, entries); negative for an entry nothing of this sequence was written to yet."""
    s = torch.arange(entries, device=last.device)
    return last - torch.remainder(last - s, window)


def ring_mask(input_pos: torch.Tensor, window: int, entries: int) -> torch.Tensor:
    """Boolean mask (B, 1, T, entries [+ T]) of the queries at `input_pos` ((T,) or (B, T)) over a ring of `window`
    entries (its first `entries`): one query (T = 1) over the ring after its write; more over the ring before their
    writes followed by their own T keys (`KVCache.forward` returns the keys in that order)."""
    pos = input_pos if input_pos.dim() == 2 else input_pos.unsqueeze(0)
    if pos.size(1) == 1:  # the ring after this step's write: no entry is ahead of the query or out of its window
        return (ring_positions(pos, window, entries) >= 0).view(pos.size(0), 1, 1, entries)
    k_pos = torch.cat((ring_positions(pos[:, :1] - 1, window, entries), pos), dim=1)  # (B, entries + T)
    q = pos.unsqueeze(-1)
    k_pos = k_pos.unsqueeze(1)
    return ((k_pos >= 0) & (k_pos <= q) & (q - k_pos < window)).unsqueeze(1)


class KVCache(nn.Module):
    def __init__(
        self,
        batch_size: int,
        n_groups: int,
        max_seq_length: int,
        head_size: int,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        window: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.length = max_seq_length  # positions a sequence may reach (the entries, unless a ring holds fewer)
        self.sliding_window = window
        # a ring of the window's entries where the window is shorter than the cache (else a plain cache)
        self.ring = window if window is not None and window < max_seq_length else None
        shape = (batch_size, n_groups, self.ring or max_seq_length, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def mask(self, input_pos: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
        """The attention mask over what `forward` returns for the same `input_pos` and `length`."""
        length = self.length if length is None else length
        if self.ring is None:
            return cache_mask(input_pos, length, self.sliding_window)
        return ring_mask(input_pos, self.ring, min(self.ring, length))

    def forward(
        self,
        input_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: Optional[torch.Tensor] = None,
        length: Optional[int] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write the (B, groups, T, hs) keys and values at `input_pos` and return the cache to attend over.

        (T,) positions: every row of the cache at the same positions (B = the cache's rows). (B, T) positions: row b
        at its own positions, in cache row `slots[b]` (default b; B may be fewer than the cache's rows); the result
        is those rows' first `length` positions (default all), gathered only when `slots` is given. A ring (see the
        module's docstring) returns its first `length` entries, followed by the T keys themselves when T > 1."""
        if self.ring is not None:
            return self._ring_forward(input_pos, k, v, slots, length)
        if input_pos.dim() == 1:
            if k.size(0) != self.k.size(0):
                raise ValueError(f"batch size {k.size(0)} does not match the KV cache's {self.k.size(0)}")
            self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
            self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
            return self.k, self.v
        B = k.size(0)
        rows = slots if slots is not None else torch.arange(B, device=input_pos.device)
        rows = rows.unsqueeze(1)  # (B, 1) with (B, T) positions: one (groups, hs) vector per (row, position)
        self.k[rows, :, input_pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[rows, :, input_pos] = v.transpose(1, 2).to(self.v.dtype)
        keys, values = self.k, self.v
        if length is not None and length < keys.size(2):
            keys, values = keys[:, :, :length], values[:, :, :length]
        if slots is not None:
            return keys.index_select(0, slots), values.index_select(0, slots)
        return keys[:B], values[:B]

    def _ring_forward(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: Optional[torch.Tensor],
        length: Optional[int],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        W, (B, _, T, _) = self.ring, k.shape
        if input_pos.dim() == 1:
            if B != self.k.size(0):
                raise ValueError(f"batch size {B} does not match the KV cache's {self.k.size(0)}")
            input_pos = input_pos.unsqueeze(0).expand(B, T)
        entries = W if length is None else min(W, length)
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        rows = slots if slots is not None else torch.arange(B, device=input_pos.device)
        if T == 1:  # a decode step: write the entry of its position (the one that left the window), attend the ring
            at = torch.remainder(input_pos, W)
            self.k[rows.unsqueeze(1), :, at] = k.transpose(1, 2)
            self.v[rows.unsqueeze(1), :, at] = v.transpose(1, 2)
            keys, values = self.k[:, :, :entries], self.v[:, :, :entries]
            if slots is not None:
                return keys.index_select(0, slots), values.index_select(0, slots)
            return keys[:B], values[:B]
        if slots is not None:
            old_k, old_v = self.k.index_select(0, slots), self.v.index_select(0, slots)
        else:
            old_k, old_v = self.k[:B], self.v[:B]
        out = torch.cat((old_k[:, :, :entries], k), dim=2), torch.cat((old_v[:, :, :entries], v), dim=2)
        # each entry takes the latest of these positions that falls in it, if any: position p(s) = newest - ((newest
        # - s) mod W) sits at index p(s) - first of the chunk (a gather: no two writes to one entry)
        first, newest = input_pos[:, :1], input_pos.amax(dim=1, keepdim=True)
        index = ring_positions(newest, W, W) - first  # (B, W)
        take = (index >= 0).view(B, 1, W, 1)
        index = index.clamp(0, T - 1).view(B, 1, W, 1).expand(B, k.size(1), W, k.size(3))
        new_k = torch.where(take, k.gather(2, index), old_k)
        new_v = torch.where(take, v.gather(2, index), old_v)
        if slots is not None:
            self.k.index_copy_(0, slots, new_k)
            self.v.index_copy_(0, slots, new_v)
        else:  # the views old_k/old_v are read above (the result is a copy), so they may be overwritten now
            self.k[:B].copy_(new_k)
            self.v[:B].copy_(new_v)
        return out
