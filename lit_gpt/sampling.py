"""Picking the next token from the logits, on their device, without reading a value on the host (what a loop on an
asynchronous or tracing device needs); and the check of the sampling arguments the recipes take."""

from typing import Optional, Union

import torch

from lit_gpt.utils import LitError

Setting = Union[float, torch.Tensor]
"""A sampling setting: one number for every row, or a (rows,) tensor with a value per row (a continuous batch, whose
rows are requests with their own settings)."""


def sample(
    logits: torch.Tensor,
    temperature: Setting = 0.0,
    top_k: Optional[int] = None,
    top_p: Setting = 1.0,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` (..., vocab) -> (...) int64, entirely on the logits' device.

    temperature 0 is greedy. Otherwise the filters run in Hugging Face's order (temperature, top-k, top-p) and the
    draw is an exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i, like
    `torch.multinomial` but without its host synchronisation.

    Per-row settings: `temperature` and `top_p` as (rows,) tensors (a row with temperature 0 is greedy), and the
    race's Exp(1) draws given as `noise` (rows, vocab), drawn by the caller from each row's own generator, so that a
    seeded request samples the same tokens whatever else shares its batch."""
    per_row = isinstance(temperature, torch.Tensor)
    if not per_row and temperature == 0.0:
        return torch.argmax(logits, dim=-1)
    if per_row:
        t = temperature.to(logits.device, torch.float32).unsqueeze(-1)
        logits = logits.float() / torch.where(t > 0, t, torch.ones_like(t))
    else:
        logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = top_p.to(logits.device, torch.float32).unsqueeze(-1) if isinstance(top_p, torch.Tensor) else top_p
    if isinstance(p, torch.Tensor) or p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it already does
        # (the most likely token always stays, its preceding mass is 0)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    picked = torch.argmax(probs / noise, dim=-1)
    if per_row:  # greedy rows: the argmax of their (unscaled, unfiltered: the same) logits
        picked = torch.where(t.squeeze(-1) > 0, picked, torch.argmax(logits, dim=-1))
    return picked


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: float) -> None:
    if temperature < 0:
        raise LitError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise LitError(f"top_k must be a positive number of tokens (or unset), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise LitError(f"top_p must be in (0, 1], got {top_p}")
