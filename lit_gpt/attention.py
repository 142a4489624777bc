"""The attention computations SDPA cannot do, in the reference's eager form: soft-capped scores (Gemma 2) and
attention sinks (gpt-oss). `lit_gpt.model.CausalSelfAttention.scaled_dot_product_attention` picks them by config.

And packed rows' attention through FlexAttention (`torch.nn.attention.flex_attention`), the CUDA path (`packed_path`):
a block mask built from the rows' document ids (causal within each document, and the layer's sliding window) as a
`mask_mod`, Gemma 2's soft-capping as a `score_mod`, gpt-oss's sinks from the log-sum-exp FlexAttention returns; no
(T, T) tensor, and the blocks no document reaches are skipped. Compiled (Inductor's Triton kernels on CUDA) once per
shape: `torch.compile` with static shapes keys its graphs by (B, T) and the layer's kind, and a new batch's mask
function is a new closure of the same code, which its guards accept (tests/test_flex_attention.py counts the graphs).
On the CPU torch 2.9 compiles FlexAttention's forward (Inductor's C++ template, 45-100 s for one shape here) but not
its backward (Inductor lowers it for Triton only: `InductorError: IndexError`), so the CPU trains packed rows one
document at a time (`lit_gpt.packing.document_attention`) and runs this path only in the tests, compiled with the
"eager" backend (the unfused reference, O(T^2): the same mask and score functions)."""

import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

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


# ---------------------------------------------------------------------------------------------------------------
# FlexAttention: packed rows on CUDA
# ---------------------------------------------------------------------------------------------------------------
def flex_available() -> bool:
    """Whether this torch has FlexAttention (2.5 and later)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def packed_path(requested: str, device_type: str) -> str:
    """The attention of packed rows, from `GPT.packed_attention`: "auto" is FlexAttention ("flex") on CUDA where torch
    has it, one document at a time ("documents") elsewhere (XLA installs its own kernel: `GPT.segment_attention`).
    "flex", "documents" or "mask" (the dense (T, T) document mask, the old path) are taken as they are: setting
    `model.packed_attention = "documents"` (or "mask") turns FlexAttention off on CUDA."""
    if requested != "auto":
        return requested
    return "flex" if device_type == "cuda" and flex_available() else "documents"


@functools.lru_cache(maxsize=None)
def flex_functions(backend: str) -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """(create_block_mask, flex_attention), each `torch.compile`d once per process with `backend` ("inductor": the
    fused kernels; "eager": dynamo's capture run by the unfused reference, what the CPU tests run) and static shapes:
    one graph per (B, T) and layer kind. (Uncompiled, flex_attention wraps itself in a compile of its own whose shapes
    turn dynamic after the first change, which fails on the mask function's indexing.)"""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # the kinds add up (lengths x train/eval x window x soft-cap x sinks): past dynamo's default limit of 8 graphs
    # per function it would fall back to the unfused reference without a word (as `Runtime.compile_blocks` raises it)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compile = functools.partial(torch.compile, backend=backend, dynamic=False)
    # compiled, the block mask is built block by block; uncompiled it evaluates the mask function on all (T, T)
    # pairs at once (fine for the tests' rows, and no compile of its own)
    make_mask = create_block_mask if backend == "eager" else compile(create_block_mask)
    return make_mask, compile(flex_attention, fullgraph=True)


class FlexMask(NamedTuple):
    """Packed rows' block mask for one attention window, handed to the layers instead of a dense mask, with the
    flex_attention function to call (`flex_functions`)."""

    block_mask: Any  # torch.nn.attention.flex_attention.BlockMask
    attend: Callable[..., Any]
    window: Optional[int] = None


def document_mask_mod(segments: torch.Tensor, window: Optional[int] = None) -> Callable[..., torch.Tensor]:
    """FlexAttention's mask_mod of packed rows (`segments` (B, T) document ids): a query sees the keys of its own
    document at or before it (fewer than `window` positions back for a sliding layer); padding (id 0) sees padding,
    as `lit_gpt.packing.document_mask`."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = (segments[b, q_idx] == segments[b, kv_idx]) & (q_idx >= kv_idx)
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    return mask_mod


def flex_mask(segments: torch.Tensor, window: Optional[int], backend: str) -> FlexMask:
    """The block mask of packed rows for the layers of one attention window (None: global layers), built once per
    forward (the documents change every batch) and shared by those layers; `backend` as `flex_functions`."""
    create_block_mask, flex_attention = flex_functions(backend)
    B, T = segments.shape
    block_mask = create_block_mask(document_mask_mod(segments, window), B, None, T, T, device=segments.device)
    return FlexMask(block_mask, flex_attention, window)


@functools.lru_cache(maxsize=None)
def softcap_score_mod(cap: float) -> Callable[..., torch.Tensor]:
    """FlexAttention's score_mod of Gemma 2's soft-capping (one function per cap: the same object every call, so
    a compiled flex_attention keeps its graph)."""

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                  kv_idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return score_mod


def flex_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
                          softcapping: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed rows' attention through FlexAttention: q (B, n_head, T, hs), k/v (B, n_query_groups, T, hs) -> (B,
    n_head, T, hs), equal to SDPA (or `softcapped_attention`, `sink_attention`) with the dense document mask.
    Sinks: a softmax over the scores and one more logit s per head is FlexAttention's output times Z / (Z + e^s),
    Z = e^lse its own normaliser, i.e. times sigmoid(lse - s) (differentiable in lse, q, k and the sinks)."""
    from torch.nn.attention.flex_attention import AuxRequest

    score_mod = softcap_score_mod(float(softcapping)) if softcapping is not None else None
    gqa = k.size(1) != q.size(1)
    if sinks is None:
        return mask.attend(q, k, v, score_mod=score_mod, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
    out, aux = mask.attend(q, k, v, score_mod=score_mod, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa,
                           return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))  # (B, n_head, T)
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)
