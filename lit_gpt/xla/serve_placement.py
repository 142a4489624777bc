"""Where a served model's weights live on XLA (serve/base.py's `--weights`): replicated on every device when they
fit one, else tensor-parallel (Megatron-style) over the SPMD mesh. Training keeps its FSDP layout
(`lit_gpt.xla.strategy`); a server must not: FSDP all-gathers every weight in every forward, so each decode step
would move the whole model between the chips.

    placement = place_weights(model, "auto", kv_bytes)     # after loading, before Fabric's setup_module
    runtime = serve_runtime(fabric, placement)             # its KV caches split on heads under tensor parallelism

* replicated: every parameter replicated; the decode graph holds no collective of weights (on XLA:CPU's virtual
  devices: none at all). Chosen by "auto" when the weights and the KV cache fit one device's memory (a TPU's
  `bytes_limit`, with `HEADROOM` left for activations and programs); XLA:CPU reports no limit: it always fits.
* tensor_parallel: a mesh ("replica", "model") whose "model" axis is the tensor-parallel degree: the largest
  divisor of the device count that divides the attention heads and the KV heads (a KV head is never split; the
  rest of the devices hold replicas, as vLLM does without KV-head replication). Attention q/k/v (the fused `qkv`)
  and the MLP's input projections are split on their output dimension, the attention and MLP output projections
  on their input dimension; the KV cache is split on its heads; the embedding, the head and the norms are
  replicated. The partitioner then adds an all-reduce of activations after each output projection, never an
  all-gather of a weight. Why the head is replicated: sampling reads whole rows of logits (top-p sorts the
  vocabulary, the scores take the top 20), so a head split on the vocabulary all-gathers the logits and the sort's
  pieces every step (measured on 8 XLA:CPU devices, the tiny test model: 31 collectives per decode step with the
  head split, 12 with it replicated); the embedding is the same tensor in tied models. Both are a small part of a
  model too large for one device (Llama 3 70B: 4 GiB of 140 in bf16). Attention runs per KV head group
  (`grouped_attention`: the batched matmuls keep the (batch, group) dimensions apart, so the split heads stay
  split; SDPA's math path merges batch and heads into one dimension, which a split on heads cannot follow, and the
  partitioner then gathers the cache). The fused qkv weight's rows are q | k | v, so a device's rows are not its
  heads' q, k and v: the partitioner moves those small activations (collective-permutes of one token's q/k/v per
  step).
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn

from lit_gpt.utils import LitError

WEIGHTS = ("auto", "replicated", "tensor_parallel")
HEADROOM = 0.8
"""Share of a device's memory the weights and the KV cache may take for "auto" to replicate them (the rest: the
activations, the compiled programs, the runtime's own buffers)."""

# parameter name endings -> the dimension split over "model" (Megatron: column-parallel, then row-parallel)
_OUTPUT_DIM = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc_1.weight", "mlp.fc_1.bias", "mlp.fc_2.weight",
               "mlp.fc_2.bias", "mlp.fc.weight", "mlp.fc.bias")
_INPUT_DIM = ("attn.proj.weight", "mlp.proj.weight")


@dataclass
class Placement:
    """What `place_weights` chose: "replicated" or "tensor_parallel", the tensor-parallel degree (1 when
    replicated), the mesh the weights are split over (None when replicated) and why (one line for the log)."""

    mode: str
    degree: int = 1
    mesh: Any = None
    reason: str = ""


def check_weights_flag(weights: str, accelerator: str) -> None:
    """--weights: one of WEIGHTS, and only "auto" off XLA (one device holds the model there)."""
    if weights not in WEIGHTS:
        raise LitError(f"--weights must be {', '.join(WEIGHTS[:-1])} or {WEIGHTS[-1]} (got {weights!r})")
    if weights != "auto" and str(accelerator).lower() != "xla":
        raise LitError(f"--weights {weights} places the weights over XLA devices: it needs --accelerator xla (on the"
                       f" CPU and GPUs the model is on one device); leave --weights at auto")


def tensor_parallel_degree(config: Any, devices: int) -> int:
    """The largest divisor of `devices` that divides the attention heads and the KV heads (1: none does)."""
    return max(d for d in range(1, devices + 1)
               if devices % d == 0 and config.n_head % d == 0 and config.n_query_groups % d == 0)


def kv_cache_bytes(config: Any, positions: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of `positions` positions in all (slots x length) in every layer."""
    size = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.n_layer * positions * config.n_query_groups * config.head_size * size


def device_memory() -> Optional[int]:
    """Bytes of one device's memory (a TPU's `bytes_limit`); None where the runtime reports none (XLA:CPU)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if xr.device_type() == "CPU":
        return None
    try:
        return int(xm.get_memory_info(torch_xla.device())["bytes_limit"]) or None
    except (KeyError, RuntimeError, TypeError):
        return None


def place_weights(model: nn.Module, weights: str, kv_bytes: int = 0) -> Placement:
    """Re-place the loaded (FSDP-sharded) parameters of `model` as `weights` asks ("auto": replicated when the
    weights and `kv_bytes` of KV cache fit one device, else tensor-parallel) and mark the model so that the
    strategy's `setup_module` leaves it unwrapped. Returns the `Placement`."""
    import torch_xla.runtime as xr

    devices = xr.global_runtime_device_count()
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    need = weight_bytes + kv_bytes
    memory = device_memory()
    gib = 2**30
    if weights == "auto":
        fits = memory is None or need <= HEADROOM * memory
        mode = "replicated" if fits or devices == 1 else "tensor_parallel"
        reason = (f"{need / gib:.2f} GiB of weights and KV cache"
                  + (f" {'fit' if fits else 'do not fit'} one device's {memory / gib:.1f} GiB" if memory
                     else ", the device reports no memory limit (XLA:CPU)"))
    else:
        mode, reason = weights, f"--weights {weights}"
    if mode == "replicated":
        _reshard(model, None, lambda name, p: (None,) * p.dim())
        placement = Placement("replicated", 1, None, reason)
    else:
        degree = tensor_parallel_degree(config, devices)
        if degree == 1:
            raise LitError(f"tensor parallelism needs a device count that shares a divisor > 1 with the model's"
                           f" {config.n_head} heads and {config.n_query_groups} KV heads ({devices} devices): serve"
                           " on devices whose count divides them, or with --weights replicated")
        import numpy as np
        import torch_xla.distributed.spmd as xs

        mesh = xs.Mesh(np.arange(devices), (devices // degree, degree), ("replica", "model"))
        _reshard(model, mesh, _tensor_parallel_spec)
        for block in model.transformer.h:
            _split_attention(block.attn, mesh)
        placement = Placement("tensor_parallel", degree, mesh, reason)
    model.serve_placement = placement  # SPMDFSDPStrategy.setup_module: no FSDP wrapper for a placed model
    return placement


def describe(placement: Placement) -> str:
    if placement.mode == "replicated":
        return f"Weights replicated on every device ({placement.reason})"
    return (f"Weights tensor-parallel over {placement.degree} devices, {placement.mesh.size() // placement.degree}"
            f" replica(s) ({placement.reason})")


def _tensor_parallel_spec(name: str, p: torch.Tensor) -> Tuple[Optional[str], ...]:
    if name.endswith(_OUTPUT_DIM):
        return ("model",) + (None,) * (p.dim() - 1)
    if name.endswith(_INPUT_DIM):
        return (None, "model")
    return (None,) * p.dim()


def _reshard(model: nn.Module, mesh: Any, spec: Any) -> None:
    """Each parameter (a tied one once) given its new sharding in place: the device data is resharded by the
    runtime, one tensor at a time. The loader's FSDP layout is the start (a model too large for one device loads
    that way); resharding compiles a small program per parameter shape, once, at load."""
    import torch_xla.distributed.spmd as xs

    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        xs.clear_sharding(p)
        partition = spec(name, p)
        if mesh is None or all(s is None for s in partition):
            mesh_ = mesh if mesh is not None else xs.get_global_mesh()
            xs.mark_sharding(p, mesh_, (None,) * p.dim())
        else:
            xs.mark_sharding(p, mesh, partition)


def _split_attention(attn: nn.Module, mesh: Any) -> None:
    """The layer's attention computed per KV head group with q/k/v and the output split on heads
    (`grouped_attention`), where the layer's attention is the plain one (no sinks, no soft-capping, not an adapter
    variant's, which adds its own prefix attention in that method): the others keep theirs, which the
    partitioner still runs correctly, with gathers of activations."""
    from lit_gpt.model import CausalSelfAttention

    c = attn.config
    if (type(attn).scaled_dot_product_attention is not CausalSelfAttention.scaled_dot_product_attention
            or attn.sinks is not None or c.attention_logit_softcapping is not None):
        return
    attn.scaled_dot_product_attention = lambda q, k, v, mask=None: grouped_attention(q, k, v, mask, attn.scale,
                                                                                        mesh)


def _on_heads(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    if mesh is None:  # no mesh (a check of the arithmetic on the CPU): nothing to annotate
        return t
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(t, mesh, (None, "model") + (None,) * (t.dim() - 2))
    return t


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                      mesh: Any) -> torch.Tensor:
    """Attention of q (B, heads, T, hs) over k/v (B, groups, S, hs) with a boolean mask ((T, S) or (B, 1, T, S);
    None: causal), the heads of a group side by side: (B, groups, heads/groups, ...) einsums, whose batch dims
    (B, groups) the partitioner keeps split on groups. Scores and softmax in float32, as SDPA's math path."""
    B, H, T, D = q.shape
    G, S = k.size(1), k.size(2)
    q, k, v = _on_heads(q, mesh), _on_heads(k, mesh), _on_heads(v, mesh)
    scores = torch.einsum("bgrtd,bgsd->bgrts", q.reshape(B, G, H // G, T, D).float(), k.float()) * scale
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    keep = mask if mask.dim() == 2 else mask.unsqueeze(1)  # (B, 1, T, S) -> (B, 1, 1, T, S)
    # the lowest float, not -inf: a row with nothing to attend to (an idle slot) stays finite
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    y = torch.einsum("bgrts,bgsd->bgrtd", probs, v).reshape(B, H, T, D)
    return _on_heads(y, mesh)


def shard_kv_cache(gpt: nn.Module, mesh: Any) -> None:
    """Every layer's KV cache split on its KV heads over "model" (a `KVCache`'s dim 1, a paged one's dim 2)."""
    import torch_xla.distributed.spmd as xs

    for block in gpt.transformer.h:
        cache = block.attn.kv_cache
        if cache is None:
            continue
        dim = 2 if getattr(cache, "pages", None) is not None else 1
        for buf in (cache.k, cache.v):
            spec = [None] * buf.dim()
            spec[dim] = "model"
            xs.clear_sharding(buf)
            xs.mark_sharding(buf, mesh, tuple(spec))


def serve_runtime(fabric: Any, placement: Placement) -> Any:
    """The XLA runtime of a served model: `XLARuntime`, whose KV caches are split on heads when the weights are
    tensor-parallel (replicated otherwise, as `XLARuntime` places them)."""
    from lit_gpt.xla.runtime import XLARuntime

    if placement.mode != "tensor_parallel":
        return XLARuntime(fabric)
    runtime = XLARuntime(fabric)
    allocate = runtime.setup_kv_cache

    def setup_kv_cache(gpt: nn.Module, *args: Any, **kwargs: Any) -> None:
        allocate(gpt, *args, **kwargs)  # built on the host and transferred replicated, then split on heads
        shard_kv_cache(gpt, placement.mesh)

    runtime.setup_kv_cache = setup_kv_cache
    return runtime

