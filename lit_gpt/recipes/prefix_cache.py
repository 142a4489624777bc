"""The prefix cache's blocks (lit_gpt/recipes/serving.py): a prompt is compared with what a KV-cache row holds in
blocks of PREFIX_BLOCK tokens, by a chain of block hashes (vLLM's), so that the longest shared prefix of two long
sequences is found in a few comparisons; a match is then checked token by token before it is used."""

from typing import List, Sequence

PREFIX_BLOCK = 16  # tokens per prefix-cache block (vLLM's default block size)


def block_hashes(ids: Sequence[int], key: int = 0) -> List[int]:
    """The hash chain of `ids`' full PREFIX_BLOCK blocks: block i's hash covers blocks 0..i, so two sequences with
    equal hashes at block i share their first (i + 1) * PREFIX_BLOCK tokens (vLLM's block hashes; a match is
    checked token by token before it is used). `key` starts the chain: the LoRA adapter that computes the keys and
    values (0: the base model), so the same tokens under two adapters never share a block (vLLM's extra keys)."""
    out, h = [], (0 if not key else hash(("lora", key)))
    for start in range(0, len(ids) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        h = hash((h, tuple(ids[start: start + PREFIX_BLOCK])))
        out.append(h)
    return out


def shared_blocks(have: List[int], want: List[int], start: int = 0) -> int:
    """Leading blocks two hash chains share, given that they share the first `start` (a chain equal at a block is
    equal before it: look for the last equal one)."""
    n = min(len(have), len(want))
    if n <= start:
        return start if n == start else n
    if have[n - 1] == want[n - 1]:
        return n
    lo, hi = start, n - 1  # have[lo - 1] == want[lo - 1] (or lo == 0); have[hi] != want[hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if have[mid] == want[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
