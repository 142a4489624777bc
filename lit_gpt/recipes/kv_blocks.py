"""The host side of the server's paged KV cache (`lit_gpt.kv_cache.PagedKVCache`, lit_gpt/recipes/serving.py): which
pool blocks each row holds, and the prefix cache as block sharing with reference counts (vLLM's automatic prefix
caching).

Memory. The pool has `blocks` blocks of `block_size` tokens; block 0 is scratch, never given out (the block table's
entries that hold nothing point to it). A request is admitted, first come first served, when the blocks for its
prompt + max_tokens are free or evictable (below); it takes all of them at admission and gives them back when it
ends. So a request in flight never waits for memory and nobody is preempted; a request that cannot get its blocks
waits in the queue (the one at its head waits, and the ones behind it with it: no overtaking, no starvation), and
one that needs more blocks than a row can ever get is refused (HTTP 400).

Sharing. A full block of a row (`block_size` tokens continuing a prefix of full blocks) is registered under the
hash chain of its tokens (`prefix_cache.block_hashes`) once its keys/values are computed. A prompt whose leading
blocks' hashes are registered, and whose tokens equal the block's (a hash alone is never trusted), takes those blocks
with their reference count raised instead of computing them (never its last token: its logits give the first new
token). A block whose count falls to 0 stays registered ("cached") until an allocation needs it: free blocks go
first, then cached ones, least recently released first; a row releases its blocks last first, so a prefix outlives
the blocks that continue it.

Publication. The device's block table shows a row's blocks from its first prefill call on (`publish`) until it ends
(`release`); before that its entries are scratch. A row waiting for its first prefill call sits in the decode steps
as an idle row, writing at whatever position its previous request left: into scratch, never into a block that
another row shares with it.
"""

import collections
from typing import Any, Callable, Dict, List, Optional, OrderedDict, Sequence, Tuple

import torch

from lit_gpt.kv_cache import is_ring
from lit_gpt.utils import LitError


def paging(gpt: Any, slots: int, max_seq_length: int, tokens: Optional[int],
           block_size: int) -> Optional["BlockAllocator"]:
    """The allocator of a paged KV cache of `tokens` positions (default: `slots` rows of `max_seq_length`, rounded up
    to whole blocks) for `gpt`'s layers; None for a model with sliding-window rings, whose rows stay unpaged."""
    if any(is_ring(b.attn.sliding_window, max_seq_length) for b in gpt.transformer.h):
        if tokens is not None:
            raise LitError("--kv_cache_tokens: this model's sliding-window layers keep a ring of their window per"
                           " slot, which is not paged: leave --kv_cache_tokens unset")
        return None
    columns = -(-max_seq_length // block_size)
    if tokens is None:
        tokens = slots * columns * block_size
    if tokens < block_size:
        raise LitError(f"--kv_cache_tokens must be >= {block_size} (one block of the KV cache), got {tokens}")
    return BlockAllocator(tokens // block_size + 1, block_size, slots, columns)  # + the scratch block


class BlockAllocator:
    def __init__(self, blocks: int, block_size: int, rows: int, columns: int) -> None:
        if blocks < 2:
            raise ValueError(f"a paged KV cache needs a scratch block and at least one more, got {blocks} blocks")
        self.blocks, self.block_size, self.columns = blocks, block_size, columns
        self.free: collections.deque = collections.deque(range(1, blocks))  # never registered, or evicted
        self.cached: OrderedDict[int, None] = collections.OrderedDict()  # registered, count 0: oldest first
        self.refs = [0] * blocks
        self.by_hash: Dict[int, int] = {}
        self.key: Dict[int, Tuple[int, Tuple[int, ...]]] = {}  # a registered block's hash and tokens
        self.rows: List[List[int]] = [[] for _ in range(rows)]
        self.published = [False] * rows
        self.table = torch.zeros(rows, columns, dtype=torch.long)  # what the device's table shows
        self.dirty = False  # the device's table is behind `table`

    # ------------------------------------------------------------------ sizes
    @property
    def row_limit(self) -> int:
        """The most blocks one row can ever get."""
        return min(self.columns, self.blocks - 1)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def in_use(self) -> int:
        """Blocks some row holds (shared ones once)."""
        return self.blocks - 1 - len(self.free) - len(self.cached)

    def counts(self) -> Dict[str, int]:
        return {"kv_blocks": self.blocks - 1, "kv_blocks_in_use": self.in_use(), "kv_blocks_cached": len(self.cached)}

    # ------------------------------------------------------------------ admission and release
    def matches(self, hashes: Sequence[int], ids: Sequence[int], start: int, limit: int) -> List[int]:
        """The registered blocks of blocks start.. of a sequence (hash chain `hashes`, tokens `ids`), up to `limit`
        blocks in all, as long as they continue to match (hash and tokens)."""
        out, B = [], self.block_size
        for i in range(start, min(limit, len(hashes))):
            block = self.by_hash.get(hashes[i])
            if block is None or self.key[block][1] != tuple(ids[i * B: (i + 1) * B]):
                break
            out.append(block)
        return out

    def admit(self, row: int, tokens: int, hashes: Sequence[int] = (), ids: Sequence[int] = (),
              reuse: int = 0) -> Optional[int]:
        """Give free row `row` the blocks of `tokens` tokens, the first of them shared where the sequence's leading
        blocks (at most `reuse`) are registered; None (nothing taken) when there are not enough blocks now. Returns
        the blocks shared."""
        shared = self.matches(hashes, ids, 0, reuse)
        new = self.blocks_for(tokens) - len(shared)
        if new > len(self.free) + len(self.cached) - sum(self.refs[b] == 0 for b in shared):
            return None
        for b in shared:
            self._take(b)
        self.rows[row] = shared + [self._allocate() for _ in range(new)]
        return len(shared)

    def share_more(self, row: int, hashes: Sequence[int], ids: Sequence[int], start: int, limit: int) -> int:
        """Before a row's first prefill call: its blocks start.. that are now registered (another row computed them
        meanwhile) replace its own, which go back free. Returns the blocks the row then shares (from `start`)."""
        assert not self.published[row], "a published row's blocks are never swapped"
        shared = self.matches(hashes, ids, start, limit)
        for i, b in enumerate(shared, start):
            self._take(b)
            self._drop(self.rows[row][i])
            self.rows[row][i] = b
        return len(shared)

    def register(self, row: int, hashes: Sequence[int], ids: Sequence[int]) -> None:
        """The row's full blocks whose keys/values are computed (`hashes`: their chain, `ids`: their tokens) become
        shareable, unless an equal block is registered already."""
        B = self.block_size
        for i, h in enumerate(hashes[: len(self.rows[row])]):
            block = self.rows[row][i]
            if h not in self.by_hash and block not in self.key:
                self.by_hash[h] = block
                self.key[block] = (h, tuple(ids[i * B: (i + 1) * B]))

    def publish(self, row: int) -> None:
        """Show the row's blocks in the device's table (its first prefill call is next)."""
        if not self.published[row]:
            self.published[row] = True
            blocks = self.rows[row]
            self.table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            self.dirty = True

    def release(self, row: int) -> None:
        """The row's request ended: its blocks' counts fall, last block first, and its table entries are scratch."""
        for b in reversed(self.rows[row]):
            self._drop(b)
        self.rows[row] = []
        if self.published[row]:
            self.published[row] = False
            self.table[row].zero_()
            self.dirty = True

    def sync(self, set_table: Callable[[torch.Tensor], None]) -> None:
        """Hand `table` to the device (`set_table`) where it changed since the last call."""
        if self.dirty:
            set_table(self.table)
            self.dirty = False

    def reset(self) -> None:
        """Forget what is registered (the warm-up's blocks are nobody's prefix); no row may hold blocks."""
        assert not any(self.rows), "reset with rows in flight"
        self.__init__(self.blocks, self.block_size, len(self.rows), self.columns)  # type: ignore[misc]
        self.dirty = True

    # ------------------------------------------------------------------ counts
    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cached.pop(block, None)
        self.refs[block] += 1

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key:
                self.cached[block] = None  # the most recently released: evicted last
            else:
                self.free.append(block)

    def _allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:  # evict the least recently released cached block
            block, _ = self.cached.popitem(last=False)
            h, _ = self.key.pop(block)
            del self.by_hash[h]
        self.refs[block] = 1
        return block
