"""The KV cache of generation (one per attention layer, preallocated: static shapes) and the attention mask over it.

A cache has rows (sequences; the "slots" of a continuous batch) and positions. Writes go to an `input_pos` tensor:
(T,) positions shared by every row (`index_copy_`), or (B, T) positions per row, into chosen rows (`slots`); the
mask is computed from the same tensor, so a traced graph does not depend on the values.
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


class KVCache(nn.Module):
    def __init__(
        self,
        batch_size: int,
        n_groups: int,
        max_seq_length: int,
        head_size: int,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        shape = (batch_size, n_groups, max_seq_length, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

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
        is those rows' first `length` positions (default all), gathered only when `slots` is given."""
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
