"""Picking the next token from the logits, on their device, without reading a value on the host (what a loop on an
asynchronous or tracing device needs); and the check of the sampling arguments the recipes take."""

from typing import Optional

import torch

from lit_gpt.utils import LitError


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` (..., vocab) -> (...) int64, entirely on the logits' device.

    temperature 0 is greedy. Otherwise the filters run in Hugging Face's order (temperature, top-k, top-p) and the
    draw is an exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i, like
    `torch.multinomial` but without its host synchronisation."""
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it already does
        # (the most likely token always stays, its preceding mass is 0)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / noise, dim=-1)


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: float) -> None:
    if temperature < 0:
        raise LitError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise LitError(f"top_k must be a positive number of tokens (or unset), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise LitError(f"top_p must be in (0, 1], got {top_p}")
