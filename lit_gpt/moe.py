"""The mixture-of-experts feed-forward of the one model file (Mixtral, Qwen3-MoE, gpt-oss), switched on by
`Config.n_expert` for the layers `Config.is_moe_layer` names.

Routing (`Config.moe_routing`), as transformers computes it:
  "softmax_topk" (Mixtral, Qwen3-MoE): softmax over all experts' router logits in float32, the top k, renormalised
      to sum to 1 when `moe_norm_topk_prob` (Mixtral always; Qwen3-MoE's `norm_topk_prob`).
  "topk_softmax" (gpt-oss): the top k logits (the router has a bias), then a softmax over those k.

Dispatch (`Config.moe_dispatch`). No shape below depends on the routing, and nothing uses `nonzero` or boolean
indexing, so that XLA compiles one graph per bucket; "auto" picks per forward, by the number of tokens N (static):
  "gather" (auto when N*k <= n_expert: decode steps): each of the N*k (token, expert) assignments multiplies with
      its own expert's weights, gathered by index (`ExpertLinear.forward_selected`). Exact; reads only the chosen
      experts: a one-token step of Qwen3-30B-A3B reads 8 of its 128 experts. In eager CPU inference
      (`lit_gpt.cpu_layout`) it multiplies with views of those experts' weights instead of gathered copies.
  "grouped" (auto otherwise, in eager mode on the CPU and CUDA): the assignments sorted by expert, each expert's
      rows multiplied with its weights by `torch._grouped_mm` (one kernel for all experts; the group ends a device
      tensor: no host read, the output shape static), where it runs: CUDA, and the CPU in float32 (its CPU kernel
      refuses bf16 rows of other than 16-byte strides; `grouped_mm_runs`). Elsewhere "loop". Exact, nothing
      dropped, no expert computes for a token it was not given.
  "loop": the reference of "grouped": the same sorted rows, one `mm` per expert with rows (`grouped_mm`: one host
      read of the group sizes per layer).
  "capacity" (auto otherwise where a training step is a traced graph: XLA, torch.compile): GShard/Switch buffers
      of static size (n_expert, C, n_embd). An assignment's row in its expert's buffer is a cumulative count over
      the assignments, first choices of all tokens before second choices (a token keeps its best expert first);
      the experts run as batched matmuls over their buffers. In training C = ceil(moe_capacity_factor * N * k /
      n_expert): an assignment beyond its expert's C is dropped (the token gets that expert's share as zero: its
      other experts and the residual still carry it), and the fraction dropped is logged. Chosen explicitly, in
      evaluation and with moe_capacity_factor=None C = N, which no routing can exceed: nothing is dropped (every
      expert computes every token, E/k x the routed FLOPs: "auto" runs "dropless" there instead).
  "dropless" (auto otherwise in a traced graph in evaluation, generation and with moe_capacity_factor=None): the
      sorted, blocked layout of megablox with static shapes: the N*k assignments sorted by expert, each expert's
      group padded to a multiple of a tile of m rows, at most ceil((N*k + min(E, N*k)*(m-1)) / m) tiles (a bound of
      N only), each tile one expert's matmul (`ExpertLinear.forward_tiles`). m = ceil(N*k / (2E)) keeps the padding
      under half the assignments: the experts compute about 1.5x the routed rows (capacity C = N computes E/k x).
      Exact, nothing dropped, no host read. The tiles' weights are gathered per tile (T <= ~3E matrices per
      projection, held while the layer runs): that is the price of XLA's batched matmul (XLA:CPU, GPUs). On a TPU
      the backend layer installs a grouped-matmul kernel (`MoE.grouped_kernel`: torch_xla's Pallas `gmm`/`tgmm`,
      megablox, lit_gpt.xla.moe_gmm) that multiplies the same sorted, padded rows with each expert's weights read
      in place, one group per expert.
  "dense": every expert on every token, weighted by the routing (zero for experts not chosen): the reference the
      bench compares the dispatch against.

The router's load-balancing loss (Switch Transformer, eqs. 4-6) is `load_balancing_loss`, computed from the routing
the forward returns when asked (`MoE.forward(x, return_routing=True)`, and so `Block` and `GPT.forward`: one
`Routing` per MoE layer), exactly as transformers' `load_balancing_loss_func` with an attention mask does (the
fractions summed over all layers before their product). Returned, not kept on the modules: a scanned body or a
checkpointed function (lit_gpt.xla.scan) must hand it out as an output, and a value set on a module inside a traced
body would be a tracer of that body; `pack_routing` / `unpack_routing` carry it there as one float tensor.
"""

import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTINGS = ("softmax_topk", "topk_softmax")
MOE_ACTIVATIONS = ("silu", "clamped_swiglu")
DISPATCHES = ("auto", "grouped", "loop", "capacity", "dropless", "gather", "dense")


Bounds = List[Tuple[int, int, int]]  # (expert, first row, end row) of each non-empty group of expert-sorted rows


class _GroupedMM(torch.autograd.Function):
    """Rows sorted by expert, each group times its expert's (out, in) matrix: x[s:t] @ weight[e].T. The loops run
    over the non-empty groups only, with views of the weight (no copy); the backward writes each expert's gradient
    into its slice of one (E, out, in) tensor (autograd through `weight[e]` would build a whole zero tensor per
    expert). transformers' CPU fallback for `grouped_mm` does the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bounds: Bounds) -> torch.Tensor:
        out = x.new_empty(x.size(0), weight.size(1))
        for e, s, t in bounds:
            torch.mm(x[s:t], weight[e].t(), out=out[s:t])
        ctx.save_for_backward(x, weight)
        ctx.bounds = bounds
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        grad = grad.contiguous()
        if ctx.needs_input_grad[0]:
            grad_x = torch.zeros_like(x)
            for e, s, t in ctx.bounds:
                torch.mm(grad[s:t], weight[e], out=grad_x[s:t])
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(weight)
            for e, s, t in ctx.bounds:
                torch.mm(grad[s:t].t(), x[s:t], out=grad_w[e])
        return grad_x, grad_w, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `torch._grouped_mm`'s CPU backward refuses the
    expanded (stride 0) gradient a `sum()` gives ("Invalid strides/sizes")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_runs(x: torch.Tensor, widths: Sequence[int]) -> bool:
    """Whether `torch._grouped_mm` takes rows x (S, in) and experts' matrices whose widths (in, out, LoRA's r) are
    `widths` here: CUDA (bf16 on sm90+, rows of 16-byte multiples), or the CPU in float32. Never in a traced graph
    (XLA has no lowering; torch.compile keeps the static paths)."""
    if not hasattr(torch, "_grouped_mm") or torch.compiler.is_compiling():
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0) and \
            all(d * x.element_size() % 16 == 0 for d in widths)
    return x.device.type == "cpu" and x.dtype == torch.float32


def grouped_mm_offsets(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x: (S, in) rows sorted by expert, weight: (E, out, in), ends: (E,) int32 end row of each expert's group (a
    device tensor) -> (S, out), one `torch._grouped_mm`."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(1, 2), offs=ends))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """x: (S, in) rows sorted by expert, weight: (E, out, in), `bounds` from `group_bounds` -> (S, out)."""
    return _GroupedMM.apply(x.contiguous(), weight, bounds)


def group_bounds(sorted_experts: torch.Tensor, n_expert: int) -> Bounds:
    """The (expert, start, end) row ranges of expert-sorted assignments: the one host read of the grouped dispatch."""
    counts = torch.zeros(n_expert, dtype=torch.long, device=sorted_experts.device)
    ends = counts.scatter_add_(0, sorted_experts, torch.ones_like(sorted_experts)).cumsum(0).tolist()
    starts = [0] + ends[:-1]
    return [(e, s, t) for e, (s, t) in enumerate(zip(starts, ends)) if t > s]


class ExpertLinear(nn.Module):
    """`n_expert` linear layers of one shape as one (n_expert, out, in) weight (and (n_expert, out) bias), run as
    batched matmuls: state-dict names `<name>.weight` / `<name>.bias`, like an `nn.Linear`'s."""

    def __init__(self, n_expert: int, in_features: int, out_features: int, bias: bool = False,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.n_expert, self.in_features, self.out_features = n_expert, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_expert, out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n_expert, out_features, device=device, dtype=dtype)) if bias else None
        # eager CPU inference only (`lit_gpt.cpu_layout.use_cpu_inference_layout` sets it): `forward_selected` reads
        # the chosen experts on the host and multiplies with views of their weights, copying none (a decode step's
        # cost is streaming the weights; the gather below copies them first). Never on a tracing backend or in training
        self.by_views = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default init for each expert, through `nn.init` so that Lightning's empty init skips it (as it
        # skips nn.Linear's): a tensor's own `uniform_` would draw from the RNG while the CPU recipes build the model,
        # but not on the meta device where the XLA loader builds it, and the LoRA / adapter weights initialised
        # after it would differ between the two (tests/xla/test_xla_moe.py)
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (n_expert, C, in), row block e for expert e -> (n_expert, C, out)."""
        y = torch.bmm(x, self.weight.transpose(1, 2))
        return y if self.bias is None else y + self.bias.unsqueeze(1)

    def forward_selected(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: (M, in), experts: (M,) expert indices -> (M, out): row m through expert `experts[m]`'s weights."""
        if self.by_views:
            rows = [F.linear(x[m], self.weight[e], None if self.bias is None else self.bias[e])
                    for m, e in enumerate(experts.tolist())]
            return torch.stack(rows)
        # the gather as an embedding lookup of flattened expert matrices, the product as (M, 1, in) @ (M, in, out):
        # on the CPU 12x faster than index_select + a batched matrix-vector product (bench/moe_dispatch.py)
        w = F.embedding(experts, self.weight.view(self.n_expert, -1)).view(-1, self.out_features, self.in_features)
        y = torch.bmm(x.unsqueeze(1), w.transpose(1, 2)).squeeze(1)
        return y if self.bias is None else y + F.embedding(experts, self.bias)

    def forward_tiles(self, x: torch.Tensor, tile_experts: torch.Tensor) -> torch.Tensor:
        """x: (T, m, in) tiles of rows, tile_experts: (T,) the expert of each tile -> (T, m, out). The tiles' weights
        are gathered by index (one (out, in) matrix per tile), so a tile costs one expert's matmul on m rows."""
        w = F.embedding(tile_experts, self.weight.view(self.n_expert, -1)).view(-1, self.out_features, self.in_features)
        y = torch.bmm(x, w.transpose(1, 2))
        return y if self.bias is None else y + F.embedding(tile_experts, self.bias).unsqueeze(1)

    def forward_kernel(self, x: torch.Tensor, sizes: torch.Tensor, experts: torch.Tensor, kernel: Any) -> torch.Tensor:
        """x: (S, in) rows sorted by expert in groups of `sizes` (E,) int32, experts: (S,) -> (S, out), by a
        backend's grouped matmul `kernel` (`MoE.grouped_kernel`)."""
        y = kernel(x, self.weight, sizes)
        return y if self.bias is None else y + F.embedding(experts, self.bias)

    def forward_offsets(self, x: torch.Tensor, experts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x: (S, in) rows sorted by expert, experts: (S,), ends: (E,) int32 end row of each expert's group (a
        device tensor) -> (S, out), by `torch._grouped_mm` (see `grouped_mm_runs`)."""
        y = grouped_mm_offsets(x, self.weight, ends)
        return y if self.bias is None else y + F.embedding(experts, self.bias)

    def widths(self) -> Tuple[int, ...]:
        """The matrices' row widths (`grouped_mm_runs`)."""
        return self.in_features, self.out_features

    def forward_grouped(self, x: torch.Tensor, experts: torch.Tensor, bounds: Bounds) -> torch.Tensor:
        """x: (S, in) rows sorted by expert, experts: (S,) their experts, `bounds` of `group_bounds` -> (S, out)."""
        y = grouped_mm(x, self.weight, bounds)
        return y if self.bias is None else y + F.embedding(experts, self.bias)

    def extra_repr(self) -> str:
        return (f"n_expert={self.n_expert}, in_features={self.in_features}, out_features={self.out_features},"
                f" bias={self.bias is not None}")


class Experts(nn.Module):
    """The experts' gated MLPs: fc_1 (gate), fc_2 (up), proj (down), as in `LLaMAMLP`, one `ExpertLinear` each."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        E, H, inter = config.n_expert, config.n_embd, config.moe_intermediate_size
        self.fc_1 = ExpertLinear(E, H, inter, bias=config.moe_bias)
        self.fc_2 = ExpertLinear(E, H, inter, bias=config.moe_bias)
        self.proj = ExpertLinear(E, inter, H, bias=config.moe_bias)
        self.activation = config.moe_activation
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "clamped_swiglu":  # gpt-oss: clamped, a sigmoid with slope alpha, and (up + 1)
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (n_expert, C, n_embd) -> (n_expert, C, n_embd)."""
        return self.proj(self.act(self.fc_1(x), self.fc_2(x)))

    def forward_selected(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: (M, n_embd), experts: (M,) -> (M, n_embd)."""
        h = self.act(self.fc_1.forward_selected(x, experts), self.fc_2.forward_selected(x, experts))
        return self.proj.forward_selected(h, experts)

    def forward_tiles(self, x: torch.Tensor, tile_experts: torch.Tensor) -> torch.Tensor:
        """x: (T, m, n_embd) tiles, tile_experts: (T,) -> (T, m, n_embd)."""
        h = self.act(self.fc_1.forward_tiles(x, tile_experts), self.fc_2.forward_tiles(x, tile_experts))
        return self.proj.forward_tiles(h, tile_experts)

    def takes_kernel(self) -> bool:
        """Whether the projections multiply through a grouped-matmul kernel as they are: plain experts (and MXFP4
        ones, whose `weight` decodes); a LoRA projection adds its update in `forward_tiles` and keeps that path."""
        return all(type(lin).forward_tiles is ExpertLinear.forward_tiles for lin in (self.fc_1, self.fc_2, self.proj))

    def forward_kernel(self, x: torch.Tensor, sizes: torch.Tensor, experts: torch.Tensor, kernel: Any) -> torch.Tensor:
        """x: (S, n_embd) rows sorted by expert in groups of `sizes` -> (S, n_embd), by `kernel`."""
        h = self.act(self.fc_1.forward_kernel(x, sizes, experts, kernel),
                     self.fc_2.forward_kernel(x, sizes, experts, kernel))
        return self.proj.forward_kernel(h, sizes, experts, kernel)

    def forward_offsets(self, x: torch.Tensor, experts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x: (S, n_embd) rows sorted by expert, ends: (E,) int32 group ends -> (S, n_embd)."""
        h = self.act(self.fc_1.forward_offsets(x, experts, ends), self.fc_2.forward_offsets(x, experts, ends))
        return self.proj.forward_offsets(h, experts, ends)

    def forward_grouped(self, x: torch.Tensor, experts: torch.Tensor, bounds: Bounds) -> torch.Tensor:
        """x: (S, n_embd) rows sorted by expert -> (S, n_embd)."""
        h = self.act(self.fc_1.forward_grouped(x, experts, bounds), self.fc_2.forward_grouped(x, experts, bounds))
        return self.proj.forward_grouped(h, experts, bounds)


class Routing(NamedTuple):
    """One MoE layer's routing of a forward (`return_routing=True`): what the load-balancing loss and the load
    report use."""

    probs: torch.Tensor  # (N, n_expert) float32 softmax over all router logits (differentiable)
    experts: torch.Tensor  # (N, k) chosen experts
    kept: Optional[torch.Tensor]  # (N, k) bool, False where capacity dropped the assignment (None: none can be)


def route(logits: torch.Tensor, routing: str, k: int, norm_topk_prob: bool):
    """Router logits (N, E) -> (softmax over all experts in float32 (N, E), the k weights (N, k) float32, their
    experts (N, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    if routing == "softmax_topk":
        weights, experts = torch.topk(probs, k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif routing == "topk_softmax":
        top, experts = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
    else:  # Config refuses it; a hand-made module must not route some other way silently
        raise ValueError(f"moe_routing {routing!r} is not implemented; implemented: {', '.join(ROUTINGS)}")
    return probs, weights, experts


def capacity(n_tokens: int, k: int, n_expert: int, factor: Optional[float]) -> int:
    """Rows of each expert's buffer: ceil(factor * N * k / E), at most N (no expert can get more) and at least 1;
    N (nothing dropped) when factor is None."""
    if factor is None:
        return n_tokens
    return max(1, min(n_tokens, math.ceil(factor * n_tokens * k / n_expert)))


def dropless_tiling(n_assignments: int, n_expert: int) -> Tuple[int, int]:
    """(tile rows m, tiles T) of the dropless layout for A = N*k assignments: m = ceil(A / (2E)), so that padding
    each expert's group to a multiple of m adds fewer than A/2 rows; T = ceil((A + min(E, A)*(m-1)) / m) bounds the
    tiles of any routing (at most min(E, A) experts have a group, each padded by at most m-1 rows)."""
    m = max(1, math.ceil(n_assignments / (2 * n_expert)))
    return m, math.ceil((n_assignments + min(n_expert, n_assignments) * (m - 1)) / m)


class MoE(nn.Module):
    """router -> top-k experts -> their outputs weighted by the routing, summed (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=config.moe_bias)
        self.experts = Experts(config)
        self.n_expert, self.k = config.n_expert, config.n_expert_per_token
        self.routing_kind, self.norm_topk_prob = config.moe_routing, config.moe_norm_topk_prob
        self.capacity_factor = config.moe_capacity_factor
        self.dispatch = config.moe_dispatch
        # `kernel(x (S, in) sorted by expert, weight (E, out, in), group_sizes (E,) int32) -> (S, out)`: a backend's
        # grouped matmul for the dropless layout (the TPU's Pallas gmm, lit_gpt.xla.moe_gmm); None: batched matmuls
        self.grouped_kernel: Optional[Any] = None

    def forward(self, x: torch.Tensor, return_routing: bool = False):
        """x: (..., n_embd) -> the same shape; with `return_routing` (y, its `Routing`) for the router's loss."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        probs, weights, experts = route(self.router(xf), self.routing_kind, self.k, self.norm_topk_prob)
        n = xf.size(0)
        dispatch = self.dispatch
        if dispatch == "auto":
            if n * self.k <= self.n_expert:
                dispatch = "gather"
            elif x.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling():
                dispatch = "grouped"  # eager: exact, nothing dropped
            elif self.training and self.capacity_factor is not None:
                dispatch = "capacity"  # training in a traced graph (XLA, torch.compile): static buffers, drops
            else:
                dispatch = "dropless"  # a traced graph that must not drop: sorted tiles of static shapes
        kept = None
        if dispatch == "gather":
            y = self._gather(xf, weights, experts)
        elif dispatch == "grouped" and grouped_mm_runs(xf, [w for lin in (self.experts.fc_1, self.experts.proj)
                                                             for w in lin.widths()]):
            y = self._grouped(xf, weights, experts)
        elif dispatch in ("grouped", "loop"):
            y = self._loop(xf, weights, experts)
        elif dispatch == "dropless":
            y = self._dropless(xf, weights, experts)
        elif dispatch == "dense":
            y = self._dense(xf, weights, experts)
        else:
            factor = self.capacity_factor if self.training else None
            y, kept = self._capacity(xf, weights, experts, capacity(n, self.k, self.n_expert, factor))
        if return_routing:
            return y.reshape(shape), Routing(probs, experts, kept)
        return y.reshape(shape)

    def _gather(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        rows = x.unsqueeze(1).expand(n, self.k, h).reshape(n * self.k, h)
        out = self.experts.forward_selected(rows, experts.reshape(-1)).view(n, self.k, h)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        flat = experts.reshape(-1)  # (N * k,) token-major
        sorted_experts, order = torch.sort(flat, stable=True)
        counts = torch.zeros(self.n_expert, dtype=torch.long, device=x.device).scatter_add(0, flat,
                                                                                          torch.ones_like(flat))
        ends = counts.cumsum(0).to(torch.int32)  # stays on the device: no host read
        out = self.experts.forward_offsets(x.index_select(0, order // self.k), sorted_experts, ends)
        out = torch.zeros_like(out).index_copy(0, order, out).view(n, self.k, h)  # back to token-major
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        flat = experts.reshape(-1)  # (N * k,) token-major
        sorted_experts, order = torch.sort(flat, stable=True)
        out = self.experts.forward_grouped(x.index_select(0, order // self.k), sorted_experts,
                                           group_bounds(sorted_experts, self.n_expert))
        out = torch.zeros_like(out).index_copy(0, order, out).view(n, self.k, h)  # back to token-major
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def _dropless(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        E, k = self.n_expert, self.k
        m, n_tiles = dropless_tiling(n * k, E)
        flat = experts.reshape(-1)  # (A,) token-major
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
        padded = (counts + (m - 1)) // m * m  # each expert's group rounded up to whole tiles
        padded_ends = padded.cumsum(0)
        # indices derived from a sort go through `gather`, not `index_select`: torch_xla 2.9 aborts lowering an
        # index_select by sort indices ("Check failed: buffer != nullptr")
        order = torch.argsort(flat, stable=True)
        sorted_experts = torch.gather(flat, 0, order)
        # sorted assignment j of expert e is row j - start(e) of e's group, which starts at row padded_start(e)
        shift = padded_ends - padded - (counts.cumsum(0) - counts)
        sorted_rows = torch.arange(flat.numel(), device=x.device) + torch.gather(shift, 0, sorted_experts)
        rows = torch.empty_like(sorted_rows).scatter(0, order, sorted_rows)  # (A,) token-major: each one's row
        tokens = x.unsqueeze(1).expand(n, k, h).reshape(n * k, h)
        buffer = x.new_zeros(n_tiles * m, h).index_copy(0, rows, tokens)
        # tile t holds rows [t*m, (t+1)*m): the expert whose padded group contains them (the tiles past the last
        # group hold zero rows; they take the last expert, and nothing reads them back)
        tile_starts = torch.arange(n_tiles, device=x.device) * m
        tile_experts = (padded_ends.unsqueeze(0) <= tile_starts.unsqueeze(1)).sum(dim=1).clamp(max=E - 1)
        if self.grouped_kernel is not None and self.experts.takes_kernel():
            # the same rows as groups of the kernel: each expert's padded group, the tiles past the last group
            # (zero rows) counted in the last expert's, as the batched path gives them the last expert
            sizes = padded + F.one_hot(torch.tensor(E - 1, device=x.device), E) * (n_tiles * m - padded.sum())
            out = self.experts.forward_kernel(buffer, sizes.to(torch.int32), tile_experts.repeat_interleave(m),
                                              self.grouped_kernel)
        else:
            out = self.experts.forward_tiles(buffer.view(n_tiles, m, h), tile_experts).view(n_tiles * m, h)
        picked = out.index_select(0, rows).view(n, k, h)
        return (picked * weights.unsqueeze(-1).to(picked.dtype)).sum(dim=1)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        dense_w = torch.zeros(x.size(0), self.n_expert, dtype=weights.dtype, device=x.device)
        dense_w = dense_w.scatter(1, experts, weights)  # (N, E): zero for the experts not chosen
        out = self.experts(x.unsqueeze(0).expand(self.n_expert, *x.shape))  # (E, N, H)
        return torch.einsum("enh,ne->nh", out, dense_w.to(out.dtype))

    def _capacity(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, cap: int):
        n, h = x.shape
        E, k = self.n_expert, self.k
        # assignments choice-major: all tokens' first choices, then all second choices (priority to the best)
        flat_experts = experts.t().reshape(-1)  # (k * N,)
        one_hot = F.one_hot(flat_experts, E)  # (k * N, E)
        position = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=1)  # the assignment's row in its expert's buffer
        kept = position < cap
        # a dropped assignment is written to a spare row past the buffers, which is never read back with a weight
        slot = torch.where(kept, flat_experts * cap + position, torch.full_like(position, E * cap))
        rows = x.repeat(k, 1)  # (k * N, H), choice-major like `slot`
        buffer = torch.zeros(E * cap + 1, h, dtype=x.dtype, device=x.device).index_copy(0, slot, rows)
        out = self.experts(buffer[: E * cap].view(E, cap, h)).reshape(E * cap, h)
        out = torch.cat((out, out.new_zeros(1, h)))  # the spare row reads back as zero
        picked = out.index_select(0, slot).view(k, n, h)
        w = (weights.t() * kept.view(k, n)).unsqueeze(-1).to(picked.dtype)
        return (picked * w).sum(dim=0), kept.view(k, n).t()


def moe_layers(model: nn.Module) -> List[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def load_balancing_loss(routings: Sequence[Routing], token_mask: Optional[torch.Tensor] = None
                        ) -> Optional[torch.Tensor]:
    """transformers' `load_balancing_loss_func` over the MoE layers' routing of one forward (what
    `GPT.forward(..., return_routing=True)` returns): with f_e the fraction of the (token, choice) assignments that
    went to expert e and P_e the mean router probability of e, both over all MoE layers and the tokens of
    `token_mask` (B, T) (None: all), the loss is n_expert * sum_e f_e * P_e (k at perfect balance, since the f_e
    sum to k). None without routing (a dense model)."""
    if not routings:
        return None
    n_expert = routings[0].probs.size(-1)
    counts = routings[0].probs.new_zeros(n_expert)
    prob_sum = routings[0].probs.new_zeros(n_expert)
    rows = routings[0].probs.new_zeros(())
    mask = None if token_mask is None else token_mask.reshape(-1).to(counts.dtype)
    for r in routings:
        one_hot = F.one_hot(r.experts, n_expert).to(counts.dtype).sum(dim=1)  # (N, E): k ones per token
        if mask is None:
            counts = counts + one_hot.sum(dim=0)
            prob_sum = prob_sum + r.probs.sum(dim=0)
            rows = rows + r.probs.size(0)
        else:
            counts = counts + (one_hot * mask.unsqueeze(-1)).sum(dim=0)
            prob_sum = prob_sum + (r.probs * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    rows = rows.clamp(min=1)  # a micro-batch without real tokens: 0, not 0 / 0
    return n_expert * torch.sum((counts / rows) * (prob_sum / rows))


def expert_load(routings: Sequence[Routing], token_mask: Optional[torch.Tensor] = None
                ) -> Optional[Dict[str, torch.Tensor]]:
    """Per MoE layer and expert, the assignments of one forward's routing (the tokens of `token_mask` only):
    {"assigned": (layers, E) counts, "dropped": (layers, E) of those dropped by capacity}; device tensors, read
    them at log steps only. None without routing."""
    if not routings:
        return None
    n_expert = routings[0].probs.size(-1)
    assigned, dropped = [], []
    for r in routings:
        one_hot = F.one_hot(r.experts, n_expert).float()  # (N, k, E)
        if token_mask is not None:
            one_hot = one_hot * token_mask.reshape(-1, 1, 1).float()
        assigned.append(one_hot.sum(dim=(0, 1)))
        if r.kept is None:
            dropped.append(torch.zeros_like(assigned[-1]))
        else:
            dropped.append((one_hot * (~r.kept).unsqueeze(-1).float()).sum(dim=(0, 1)))
    return {"assigned": torch.stack(assigned), "dropped": torch.stack(dropped)}


def pack_routing(r: Routing) -> torch.Tensor:
    """One layer's routing as one float32 tensor (N, E + 2k) = [probs | experts | kept], the router's probabilities
    (differentiable) beside the chosen experts and the capacity's kept flags as exact small floats: what a scanned
    body or a checkpointed function can return (torch_xla's scan differentiates every output of its body, which an
    integer or bool output cannot take)."""
    kept = torch.ones_like(r.experts, dtype=torch.bool) if r.kept is None else r.kept
    return torch.cat([r.probs, r.experts.to(r.probs.dtype), kept.to(r.probs.dtype)], dim=-1)


def unpack_routing(t: torch.Tensor, n_expert: int, k: int) -> Routing:
    """The inverse of `pack_routing`."""
    return Routing(t[:, :n_expert], t[:, n_expert: n_expert + k].long(), t[:, n_expert + k:] > 0.5)
