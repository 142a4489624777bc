"""What a serving step's tokens carry to the HTTP layer besides their ids (lit_gpt.recipes.serving): their scores
(`logprobs`), the text held back while it may start a stop string, and each request's own random generator."""

import os
from typing import Any, List, Optional, Sequence, Tuple

import torch

MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (vLLM's default bound; OpenAI's is 5)

Score = Tuple[float, List[Tuple[int, float]]]
"""One token's score: its log-probability and the most likely tokens at its position with theirs (best first)."""


def score_tokens(logits: torch.Tensor, chosen: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities (float32) of the `chosen` tokens under `logits` (..., vocab), and the MAX_LOGPROBS most
    likely tokens' (values, ids), best first; on the device, no host read."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(MAX_LOGPROBS, logp.size(-1)), dim=-1)
    return logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1), top.values, top.indices


def read_scores(scores: Tuple[torch.Tensor, ...]) -> List[Any]:
    """`score_tokens`'s tensors on the host as Scores, one per row (a list of Scores per row for (rows, T) inputs)."""
    chosen, values, ids = (t.cpu().tolist() for t in scores)

    def rows(c: Any, v: Any, i: Any) -> Any:
        if isinstance(c, list):
            return [rows(*x) for x in zip(c, v, i)]
        return (c, list(zip(i, v)))

    return rows(chosen, values, ids)


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could begin a stop string (held back until the next token says)."""
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), keep, -1):
            if text.endswith(stop[:k]):
                keep = k
                break
    return keep


def new_generator(seed: Optional[int], device: torch.device, on_host: bool) -> torch.Generator:
    """A request's own generator: seeded by the request's `seed`, else from the OS. On the device where draws are
    cheap (CPU, CUDA); on the host where the device has none of its own (XLA: the draws are transferred)."""
    where = torch.device("cpu") if on_host else device
    seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=where).manual_seed(seed)
