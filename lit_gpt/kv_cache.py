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

A paged cache (`PagedKVCache`, the server's: lit_gpt/recipes/kv_blocks.py allocates) keeps every row's positions in
blocks of a pool shared by the rows, through a `BlockTable`; it returns what a plain cache returns (entry s holds
position s), so the masks below and `Prefill` serve both. Rings are not paged. An eager decode step whose rows
reach very different lengths gathers and attends them in two groups by length on the CPU (`PagedDecode`), so
short streams beside one long row do not pay for the long row's length.

A `Ragged` forward lays several sequences' tokens end to end in one row (a decode step's rows and the prompt chunks
riding along with it, the server's): each group of them is written and attended as its own forward would be.

A prompt (T > 1) on an eager backend attends without the dense (T, S) mask (`Prefill`, made by `GPT.forward`): plain
causal SDPA over its own keys where that is exactly the mask, else chunks of queries over the keys they can see, each
with its own small mask; tracing backends (XLA, torch.compile) keep `KVCache.mask`, whose graph does not depend on the
positions' values.
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

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
        self.ring = window if is_ring(window, max_seq_length) else None
        shape = (batch_size, n_groups, self.ring or max_seq_length, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    @property
    def rows(self) -> int:
        return self.k.size(0)

    def mask(self, input_pos: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
        """The attention mask over what `forward` returns for the same `input_pos` and `length`."""
        length = self.length if length is None else length
        if self.ring is None:
            return cache_mask(input_pos, length, self.sliding_window)
        return ring_mask(input_pos, self.ring, min(self.ring, length))

    def key_positions(self, input_pos: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
        """The position each key of what `forward` returns for the same `input_pos` and `length` holds, (B or 1, S):
        negative for an entry nothing was written to (a ring's); a plain cache's entry s holds position s (entries
        past the queries' positions hold nothing of theirs: the causal condition drops them)."""
        pos = input_pos if input_pos.dim() == 2 else input_pos.unsqueeze(0)
        if self.ring is None:
            S = self.k.size(2) if input_pos.dim() == 1 or length is None else min(length, self.k.size(2))
            return torch.arange(S, device=pos.device).unsqueeze(0)
        entries = self.ring if length is None else min(self.ring, length)
        if pos.size(1) == 1:
            return ring_positions(pos, self.ring, entries)
        return torch.cat((ring_positions(pos[:, :1] - 1, self.ring, entries), pos), dim=1)

    def forward(
        self,
        input_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: Optional[torch.Tensor] = None,
        length: Optional[int] = None,
        plan: Any = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write the (B, groups, T, hs) keys and values at `input_pos` and return the cache to attend over.

        (T,) positions: every row of the cache at the same positions (B = the cache's rows). (B, T) positions: row b
        at its own positions, in cache row `slots[b]` (default b; B may be fewer than the cache's rows); the result
        is those rows' first `length` positions (default all), gathered only when `slots` is given. A ring (see the
        module's docstring) returns its first `length` entries, followed by the T keys themselves when T > 1.
        `plan`: the layer's mask or attention plan for these queries (what `mask` returned; a paged cache's grouped
        decode step reads it)."""
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


def is_ring(window: Optional[int], length: int) -> bool:
    """Whether a layer with this sliding window keeps a ring of its window in a cache of `length` positions."""
    return window is not None and window < length


class BlockTable:
    """The block table of a paged KV cache, shared by every layer's `PagedKVCache`: `table` (rows, columns) holds the
    pool block of each row's positions c * block_size .. (c + 1) * block_size - 1 in column c, on the device. Block 0
    is scratch: the entries of rows and positions that hold nothing point to it (an idle row's writes land there,
    and no query sees it unmasked). The host's allocator (lit_gpt.recipes.kv_blocks) replaces `table` with a new
    tensor of the same shape when rows get or give up blocks: a transfer, not a graph (one decode graph on XLA)."""

    def __init__(self, table: torch.Tensor, block_size: int) -> None:
        self.table, self.block_size = table, block_size


class PagedKVCache(nn.Module):
    """A KV cache allocated in blocks (vLLM's paged cache): k/v pools of (blocks, block_size, groups, head_size)
    shared by all rows, and the `BlockTable` that says which blocks are a row's. It takes what `KVCache` takes with
    per-row (B, T) positions: position p of row r is written at (table[r, p // block_size], p % block_size), and the
    rows' first `length` positions are gathered into (B, groups, length, head_size) (one `index_select` of the pool
    by the table's columns: a fixed shape on XLA), so entry s of the result holds position s as in a plain cache and
    `cache_mask` (or the eager mask-free `Prefill`) applies unchanged. Sliding windows shorter than the cache (rings)
    are not paged."""

    ring = None

    def __init__(self, pages: BlockTable, blocks: int, n_groups: int, max_seq_length: int, head_size: int,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
                 window: Optional[int] = None) -> None:
        super().__init__()
        if is_ring(window, max_seq_length):
            raise ValueError(f"a sliding window of {window} in a cache of {max_seq_length} positions is a ring:"
                             " rings are not paged")
        self.pages, self.length, self.sliding_window = pages, max_seq_length, window
        shape = (blocks, pages.block_size, n_groups, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    @property
    def rows(self) -> int:
        return self.pages.table.size(0)

    def mask(self, input_pos: torch.Tensor, length: Optional[int] = None) -> Any:
        """`cache_mask` over the rows' first `length` positions; for an eager decode step (T = 1) whose rows'
        lengths differ enough, a `PagedDecode` instead (rows grouped by length, each gathered only as far as it
        reaches)."""
        S = self.length if length is None else min(length, self.length)
        decode = PagedDecode.plan(input_pos, S, self.pages.block_size, self.sliding_window)
        if decode is None:
            return cache_mask(input_pos, S, self.sliding_window)
        decode.pages = self.pages
        return decode

    def key_positions(self, input_pos: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
        S = self.length if length is None else min(length, self.length)
        return torch.arange(S, device=input_pos.device).unsqueeze(0)

    def forward(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: Optional[torch.Tensor] = None,
                length: Optional[int] = None, plan: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write the (B, groups, T, hs) keys and values of rows `slots` (default 0..B-1) at their (B, T) positions;
        return those rows' first `length` positions (default all), (B, groups, length, hs) each, or, for a grouped
        decode step (`plan`, a `PagedDecode` that `mask` made for these positions), the pools themselves (its `attend`
        gathers them by group)."""
        if input_pos.dim() != 2:
            raise ValueError("a paged KV cache takes per-row positions: input_pos of shape (B, T)")
        B, bs = k.size(0), self.pages.block_size
        table = self.pages.table
        table = table.index_select(0, slots) if slots is not None else table[:B]
        block = table.gather(1, torch.div(input_pos, bs, rounding_mode="floor"))
        offset = torch.remainder(input_pos, bs)
        self.k[block, offset] = k.transpose(1, 2).to(self.k.dtype)  # (B, T, groups, hs) at (B, T) entries
        self.v[block, offset] = v.transpose(1, 2).to(self.v.dtype)
        if isinstance(plan, PagedDecode):  # `mask` planned a grouped decode step: its `attend` gathers by group
            plan.pools = plan.input_pos is input_pos and slots is None
            if plan.pools:
                return self.k, self.v
        S = self.length if length is None else min(length, self.length)
        n = -(-S // bs)
        ids = table[:, :n].reshape(-1)

        def gather(pool: torch.Tensor) -> torch.Tensor:
            return pool.index_select(0, ids).view(B, n * bs, *pool.shape[2:])[:, :S].transpose(1, 2)

        return gather(self.k), gather(self.v)


def allocate_paged_kv_cache(gpt: nn.Module, rows: int, length: int, blocks: int, block_size: int,
                            device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
                            place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> BlockTable:
    """Give every layer of `gpt` a `PagedKVCache` of `blocks` blocks (block 0 scratch) for `rows` rows of `length`
    positions, sharing one `BlockTable` (every entry scratch); `place` moves a host-built tensor to the device (XLA
    builds on the host and transfers: no compilation). Returns the table."""
    pages = BlockTable(place(torch.zeros(rows, -(-length // block_size), dtype=torch.long)), block_size)
    c = gpt.config
    for b in gpt.transformer.h:
        kv = PagedKVCache(pages, blocks, c.n_query_groups, length, c.head_size, device, dtype, b.attn.sliding_window)
        kv.k, kv.v = place(kv.k), place(kv.v)
        b.attn.kv_cache = kv
    return pages


# a prefill's queries go in chunks whose (rows, keys) mask holds about this many entries (booleans, plus SDPA's float
# copy of them on the CPU: ~80 MiB): O(rows x keys) per chunk instead of the whole prompt's (T, S)
PREFILL_MASK_ENTRIES = 2**24


class Prefill:
    """A forward of T > 1 queries over a KV cache without its dense (T, S) mask (eager backends; `GPT.forward` makes
    one per window kind, each layer's `CausalSelfAttention` calls `attend` after its cache write). The keys a query
    may see: `key_positions` (B or 1, S) <= its position, >= 0, and within the window. Which keys each chunk of
    queries can see is worked out once here (host reads of O(T + S) values, never O(T x S)):

    - plain causal: the queries' keys are exactly their own positions in order (the first prompt of a plain cache, or a
      ring's first prompt up to its window): one SDPA call with `is_causal`, no mask at all (the CPU's and CUDA's flash
      kernels); not for soft-capped or sink layers, whose eager attention would build the (T, T) mask itself;
    - otherwise chunks of queries, each over the contiguous range of keys any of its queries can see (a prefix in the
      cache, a sliding window, a ring's old entries), with the chunk's own (rows, keys) mask: the same mask entries
      as `KVCache.mask`, so the same softmax over the same keys."""

    def __init__(self, input_pos: torch.Tensor, key_positions: torch.Tensor, window: Optional[int],
                 causal_ok: bool) -> None:
        self.q_pos = input_pos if input_pos.dim() == 2 else input_pos.unsqueeze(0)  # (B or 1, T)
        self.k_pos = key_positions  # (B or 1, S)
        self.window = window
        T, S = self.q_pos.size(1), self.k_pos.size(1)
        self.causal: Optional[Tuple[int, int]] = None  # the key range [lo, hi) of the plain causal case
        lo, hi = self._columns(self.q_pos)
        if causal_ok and hi - lo == T:
            own = self.k_pos.expand(self.q_pos.size(0), -1)[:, lo:hi]
            rising = T == 1 or bool((self.q_pos[:, 1:] > self.q_pos[:, :-1]).all())
            span = int((self.q_pos[:, -1] - self.q_pos[:, 0]).max())
            if rising and bool(torch.equal(own, self.q_pos)) and (window is None or span < window):
                self.causal = (lo, hi)
        self._masks: dict = {}  # each chunk's mask, built by the first layer that asks (`attend`)
        rows = max(1, min(T, PREFILL_MASK_ENTRIES // max(S, 1)))
        if window is not None:  # a chunk sees its own keys and the window's before them: chunks about the window's size
            rows = min(rows, max(window, 256))
        self.chunks = [] if self.causal else [(a, min(a + rows, T)) + self._columns(self.q_pos[:, a:a + rows])
                                              for a in range(0, T, rows)]

    def _columns(self, q_pos: torch.Tensor) -> Tuple[int, int]:
        """The smallest contiguous range of keys that holds every key one of these queries may see (a superset: the
        chunk's mask drops the rest)."""
        lo_q, hi_q = q_pos.amin(dim=1, keepdim=True), q_pos.amax(dim=1, keepdim=True)
        seen = (self.k_pos >= 0) & (self.k_pos <= hi_q)
        if self.window is not None:
            seen = seen & (lo_q - self.k_pos < self.window)
        cols = seen.any(dim=0).nonzero()
        return (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 1)

    def mask(self, q_pos: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """(B or 1, 1, rows, hi - lo) booleans of these queries over keys lo..hi (`KVCache.mask`'s entries)."""
        k = self.k_pos[:, lo:hi].unsqueeze(1)
        q = q_pos.unsqueeze(-1)
        m = (k >= 0) & (k <= q)
        if self.window is not None:
            m = m & (q - k < self.window)
        return m.unsqueeze(1)

    def attend(self, attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, additive: bool = False) -> torch.Tensor:
        """`attention(q, k, v, mask)` (a layer's `scaled_dot_product_attention`; mask None = causal) over what the
        cache returned, chunk by chunk: q (B, heads, T, hs), k/v (B, groups, S, hs). The chunks' masks are built
        once per forward (every layer sees the same); `additive` (a layer whose attention is SDPA's): as SDPA's
        own float mask in q's dtype (0 or -inf, what it turns a boolean mask into on every call)."""
        if self.causal is not None:
            lo, hi = self.causal
            return attention(q, k[:, :, lo:hi], v[:, :, lo:hi], None)
        return torch.cat([attention(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi],
                                    self._mask(i, q.dtype if additive else None))
                          for i, (a, b, lo, hi) in enumerate(self.chunks)], dim=2)

    def _mask(self, i: int, dtype: Optional[torch.dtype]) -> torch.Tensor:
        mask = self._masks.get((i, dtype))
        if mask is None:
            a, b, lo, hi = self.chunks[i]
            mask = self.mask(self.q_pos[:, a:b], lo, hi)
            if dtype is not None:
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._masks[(i, dtype)] = mask
        return mask


class PagedDecode(Prefill):
    """A decode step (one query per row) over a paged cache whose rows reach very different lengths (e.g. short chat
    streams beside a row that just took a 2,000-token prompt), on eager backends: the rows are split into two groups
    by length, and each group gathers its rows' blocks only up to its own longest row (rounded up to a block) and
    attends with its own `cache_mask`, instead of every row gathering (and attending over) the longest row's length.
    Each row attends over exactly the keys it sees in the plain step (the positions beyond its own are masked there),
    through the layer's own attention (GQA, soft-capping, sinks alike). `PagedKVCache.mask` plans it once per forward
    (a read of the B positions) when it saves at least `MIN_SAVED` gathered positions; else the plain mask. CPU
    only: on a GPU that read would be a device sync before every decode step (the positions live on the device).
    Tracing backends (XLA, torch.compile) never get one: their decode step keeps one shape."""

    MIN_SAVED = 1024  # gathered row-positions saved below which one gather is cheaper than two (small ops per layer)

    def __init__(self, input_pos: torch.Tensor, groups: list, window: Optional[int]) -> None:
        self.input_pos, self.groups, self.window = input_pos, groups, window  # groups: [(rows tensor, length)]
        self.pools = False  # set by each layer's `PagedKVCache.forward`: it returned its pools, not gathered rows
        self.pages: Optional[BlockTable] = None

    @classmethod
    def plan(cls, input_pos: torch.Tensor, S: int, bs: int, window: Optional[int]) -> Optional["PagedDecode"]:
        if input_pos.dim() != 2 or input_pos.size(1) != 1 or input_pos.size(0) < 2 or \
                input_pos.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        need = [min(S, -(-(p + 1) // bs) * bs) for p in input_pos.view(-1).tolist()]  # each row's blocks, in tokens
        order = sorted(range(len(need)), key=need.__getitem__)
        B, best, cut = len(need), len(need) * max(need), None
        for i in range(1, B):  # the short group: the i shortest rows
            cost = i * need[order[i - 1]] + (B - i) * need[order[-1]]
            if cost < best:
                best, cut = cost, i
        if cut is None or B * max(need) - best < cls.MIN_SAVED:
            return None
        device = input_pos.device
        groups = [(torch.tensor(sorted(rows), device=device), need[rows[-1]]) for rows in (order[:cut], order[cut:])]
        return cls(input_pos, groups, window)

    def attend(self, attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, additive: bool = False) -> torch.Tensor:
        """q (B, heads, 1, hs); k/v the layer's pools (blocks, block_size, groups, hs) when `PagedKVCache.forward`
        returned them, else its gathered (B, groups, S, hs) rows (a call with `slots`: the plain step)."""
        if not self.pools:
            return attention(q, k, v, cache_mask(self.input_pos, k.size(2), self.window))
        table, bs = self.pages.table, self.pages.block_size
        y = torch.empty_like(q)
        for rows, length in self.groups:
            n = -(-length // bs)
            ids = table.index_select(0, rows)[:, :n].reshape(-1)

            def gather(pool: torch.Tensor) -> torch.Tensor:
                return pool.index_select(0, ids).view(rows.numel(), n * bs, *pool.shape[2:])[:, :length].transpose(1, 2)

            pos = self.input_pos.index_select(0, rows)
            y.index_copy_(0, rows, attention(q.index_select(0, rows), gather(k), gather(v),
                                             cache_mask(pos, length, self.window)))
        return y


class RaggedGroup(NamedTuple):
    """Tokens `start` .. `start + rows * width` of a `Ragged` forward: `rows` sequences of `width` tokens each at
    their (rows, width) positions `input_pos`, in the KV cache rows `slots` (None: rows 0..rows-1), whose queries
    see the cache's first `length` positions (None: all)."""

    start: int
    rows: int
    width: int
    input_pos: torch.Tensor
    slots: Optional[torch.Tensor]
    length: Optional[int]


class Ragged:
    """One forward over several sequences' tokens laid end to end in one row: (1, N) ids and positions, in groups
    of equal-width sequences (`RaggedGroup`), e.g. a decode step's rows (one token each) and the prompt chunks that
    ride along with it (the server's chunked prefill, as Sarathi-Serve and vLLM batch them). What costs most at
    small batch, reading the weights, then happens once per step boundary instead of once for the chunks and again
    for the decode step; no token is padding. Every layer but attention sees the N tokens as one sequence (RoPE takes
    each token's own position); attention (`RaggedMasks.attend`) goes group by group, in order: the group's cache
    write, then its queries over what the cache returns, exactly as a forward of that group alone would (its
    `KVCache.mask`, or a `Prefill` for prompt chunks on eager backends). A later group's write lands after an earlier
    one's, so a row that is in the decode group and also prefills a chunk (it sits through the step like an idle
    row, lit_gpt.recipes.serving) ends with its chunk's keys. Eager backends (CPU, CUDA): the groups follow the
    step's host-side plan."""

    def __init__(self, groups: Sequence[RaggedGroup], ids: torch.Tensor, input_pos: torch.Tensor,
                 heads: Optional[torch.Tensor] = None, owners: Sequence[Tuple[int, int]] = ()) -> None:
        self.groups = list(groups)
        self.ids, self.input_pos = ids, input_pos  # (1, N) each
        self.heads = heads  # the positions (indices into N) whose logits the caller wants (GPT.forward's head_rows)
        self.owners = list(owners)  # (cache row, tokens) per sequence, in order (e.g. each row's LoRA adapter)

    def row_max(self) -> torch.Tensor:
        """(N,): the last position of each token's own sequence in this forward (LongRoPE picks its factors by it)."""
        return torch.cat([g.input_pos.amax(1, keepdim=True).expand(g.rows, g.width).reshape(-1) for g in self.groups])

    def masks(self, kv: nn.Module, window: Optional[int], prefill: bool, causal_ok: bool) -> "RaggedMasks":
        """Each group's mask over what `kv` returns for it (`GPT.forward` calls this once per window kind):
        `prefill` (an eager backend): groups of more than one token attend without their dense mask (`Prefill`)."""
        return RaggedMasks(self.groups, [
            Prefill(g.input_pos, kv.key_positions(g.input_pos, g.length), window, causal_ok)
            if prefill and g.width > 1 else kv.mask(g.input_pos, g.length) for g in self.groups])


class RaggedMasks:
    """A `Ragged` forward's masks for one window kind, and its attention (`CausalSelfAttention` calls `attend`)."""

    def __init__(self, groups: List[RaggedGroup], masks: List[Any]) -> None:
        self.groups, self.masks = groups, masks

    def attend(self, kv_cache: nn.Module, attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, additive: bool = False) -> torch.Tensor:
        """q (1, heads, N, hs), k/v (1, groups, N, hs): each group written into the cache and attended, in order;
        returns (1, heads, N, hs). `additive` as in `Prefill.attend`."""
        out = []
        for g, mask in zip(self.groups, self.masks):
            def part(t: torch.Tensor) -> torch.Tensor:  # (rows, heads, width, hs)
                return t[0, :, g.start:g.start + g.rows * g.width].unflatten(1, (g.rows, g.width)).transpose(0, 1)

            keys, values = kv_cache(g.input_pos, part(k), part(v), g.slots, g.length, plan=mask)
            qg = part(q)
            if isinstance(mask, Prefill):
                y = mask.attend(attention, qg, keys, values, additive)
            else:
                y = attention(qg, keys, values, mask)
            out.append(y.transpose(0, 1).flatten(1, 2))
        return torch.cat(out, dim=1).unsqueeze(0)
