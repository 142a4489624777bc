"""The attention computations SDPA cannot do, in the reference's eager form: soft-capped scores (Gemma 2) and
attention sinks (gpt-oss). `lit_gpt.model.CausalSelfAttention.scaled_dot_product_attention` picks them by config."""

from typing import Optional

import torch


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's bound on attention scores and logits."""
    return torch.tanh(x / cap) * cap


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float, cap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot do: the eager computation of the reference (scores in
    the input dtype, softmax in float32). mask: (T, S) booleans, True = attend; None = causal."""
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = softcap(q @ k.transpose(-2, -1) * scale, cap)
    if mask is None:
        T, S = q.size(2), k.size(2)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention with a sink logit per head appended to every row of scores before the softmax, its probability
    then dropped (gpt-oss; transformers' eager computation, with the softmax in float32). mask: (T, S) booleans,
    True = attend; None = causal."""
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * scale
    if mask is None:
        T, S = q.size(2), k.size(2)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.size(0), -1, scores.size(2), 1)
    logits = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
