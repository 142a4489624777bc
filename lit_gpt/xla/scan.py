"""The transformer blocks as one scanned layer on XLA (torch_xla's `scan`): the compiler sees one block body inside
an XLA `While` loop instead of `n_layer` unrolled copies, so compiling the train step costs about the same at 64
layers as at 16.

    strategy = SPMDFSDPStrategy(scan_layers="auto")    # or make_fabric(..., scan_layers=True); the recipes'
    model, optimizer = fabric.setup(model, optimizer)  # --scan_layers. setup_module installs the runner:
    model.block_runner = ScannedBlocks(mesh, ...)      # GPT.forward hands it the blocks when there is no KV cache

How (lit_gpt.model.GPT.forward calls `block_runner(blocks, x, cos, sin)` instead of its loop):
  * Consecutive blocks with the same structure (module types, parameter names, shapes, dtypes, which train, and
    the layer kind: attention window and RoPE table) form a group; each group is one `scan` (LLaMA-Adapter's first
    `adapter_start_layer` blocks have no adapter: two groups; Gemma 3's five sliding layers and one global one: a
    group per run, two traced bodies in all). The parameters of a group are stacked along a new leading dimension
    at every forward (gradients flow back to the blocks' own parameters, so parameter names, checkpoints and
    exports are unchanged).
  * The block runs through `torch.func.functional_call` on the group's first block with each layer's slice of
    the stacked parameters; the RoPE tables ride along as scanned inputs (a broadcast, no copy): torch_xla traces
    the block with AOTAutograd, where a closed-over device tensor is refused.
  * Under SPMD (FSDPv2) the stacked parameters keep FSDP's sharding (a block's largest dimension over "fsdp", the
    layer dimension whole), so each loop iteration gathers one layer's weights; the carry is split along the
    batch like FSDPv2's per-block `shard_output`. torch_xla's `scan` needs jax (and flax) under SPMD (its
    backward pass constrains gradient shardings with jax's `shard_alike`): see `scan_unavailable()`.
  * Activation checkpointing is the partition of the traced block into forward and backward graphs:
    `min_cut_rematerialization_partition` (AOTAutograd's min-cut recomputation) instead of `checkpoint_module`.

Dropout (LoRA's `lora_dropout`): torch_xla 2.9's scan gives every layer the same dropout mask (measured: two
scanned dropout layers at p=0.5 keep 1/2 of the entries, not 1/4), so a model with dropout in its blocks keeps the
loop ("auto") or is refused (True). Without dropout a scanned run equals the loop's (the tests hold losses and
weights to 1e-6). Masks that are saved for the backward pass (bool) travel as uint8: see
`_bool_activations_as_uint8`.

Mixture-of-experts models (lit_gpt.moe): each MoE layer's routing (the router's probabilities, the chosen experts,
what capacity dropped), which the load-balancing loss and the load report read from the forward's return
(`GPT.forward(..., return_routing=True)`), leaves the scan as a per-layer output (`ys`, stacked over the layers,
differentiable; `lit_gpt.moe.pack_routing`), so that the loss sees what the unscanned loop returns. Per-block
activation checkpointing (`checkpoint_block`, the strategy's wrapper) likewise returns the routing through the
checkpointed function: a value that left torch_xla's reentrant checkpoint other than as one of its output tensors
would come from its first forward, which runs under no_grad, and carry no gradient.

Generation (a KV cache, `input_pos` given) keeps the loop: each layer's cache would have to become stacked,
carried state of the scan, and decode graphs are small (one token) and compile once.
"""

import functools
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from lit_gpt.moe import moe_layers, pack_routing, unpack_routing
from lit_gpt.utils import LitError

# bench/xla_scan.py (bench/results/xla_scan_cpu1.json): at 16 layers the loop compiled faster, at 32 the scan
AUTO_MIN_LAYERS = 32

ScanSetting = Union[bool, str]


def scan_unavailable() -> Optional[str]:
    """Why torch_xla's `scan` cannot train under SPMD in this environment (None: it can)."""
    import importlib.util

    # torch_xla 2.9 calls jax through the torchax copy it ships, which imports flax
    missing = [name for name in ("jax", "flax") if importlib.util.find_spec(name) is None]
    if missing:
        return (
            f"torch_xla's scan needs {' and '.join(missing)} under SPMD (its backward pass shards gradients with jax):"
            " pip install jax==0.7.1 jaxlib==0.7.1 flax==0.11.2"
        )
    return None


def resolve_scan_layers(setting: ScanSetting, module: nn.Module, spmd: bool = True) -> bool:
    """Whether `module`'s blocks run as a scan: True / False as given, "auto" from `AUTO_MIN_LAYERS` blocks on
    (and only where torch_xla's scan can run). A setting that cannot work is one `LitError` line."""
    if setting not in (True, False, "auto"):
        raise LitError(f"scan_layers must be true, false or 'auto', got {setting!r}")
    if setting is False:
        return False
    if not hasattr(module, "block_runner"):
        if setting == "auto":
            return False
        raise LitError(f"--scan_layers runs lit_gpt's GPT blocks; {type(module).__name__} has none")
    n_layer = len(module.transformer.h)
    if setting == "auto" and n_layer < AUTO_MIN_LAYERS:
        return False
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.transformer.h.modules()):
        # measured here (tests/xla/test_scan.py): torch_xla 2.9's scan draws the same dropout mask in every
        # iteration of the loop, so every layer would drop the same entries: not the loop's training
        if setting == "auto":
            return False
        raise LitError("--scan_layers with dropout in the blocks: torch_xla 2.9's scan repeats one dropout mask in"
                       " every layer. Set the dropout to 0 (e.g. --lora_dropout 0) or --scan_layers false")
    reason = scan_unavailable() if spmd else None
    if reason:
        if setting == "auto":
            return False
        raise LitError(f"--scan_layers: {reason}")
    return True


def _structure(block: nn.Module) -> Tuple:
    """What must be equal for two blocks to share one scanned body: module types, parameters, and the block's
    `layer_kind` (lit_gpt's Block: attention window and RoPE table), which blocks of equal parameters can differ in
    (Gemma 2/3's sliding and global layers) and which the traced body has baked in as Python values."""
    modules = tuple((name, type(m)) for name, m in block.named_modules())
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters())
    return modules, params, getattr(block, "layer_kind", None)


def block_groups(blocks: Sequence[nn.Module]) -> List[List[nn.Module]]:
    """Runs of consecutive blocks with the same structure."""
    groups: List[List[nn.Module]] = []
    last = None
    for block in blocks:
        key = _structure(block)
        if groups and key == last:
            groups[-1].append(block)
        else:
            groups.append([block])
            last = key
    return groups


class ScannedBlocks:
    """`GPT.block_runner`: runs the blocks as one `scan` per group of equal blocks.

    Args:
        mesh: the SPMD mesh (None without SPMD): stacked parameters keep FSDP's sharding over its "fsdp" axis and
            the carried activations are split along the batch over `batch_axes`.
        batch_axes: mesh axes the batch is split over.
        activation_checkpointing: recompute each block's activations in the backward pass (min-cut partition).
    """

    def __init__(self, mesh: Any = None, batch_axes: Union[str, Tuple[str, ...]] = "fsdp",
                 activation_checkpointing: bool = False) -> None:
        from functorch.compile import default_partition, min_cut_rematerialization_partition

        self.mesh = mesh
        self.batch_axes = batch_axes
        partition = min_cut_rematerialization_partition if activation_checkpointing else default_partition
        self.partition_fn = functools.partial(_bool_activations_as_uint8, partition)
        self._fns: Dict[Tuple, Callable] = {}

    def __call__(self, blocks: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 return_routing: bool = False) -> Any:
        """The blocks' output; with `return_routing` (output, the MoE layers' routing in layer order), as
        `GPT.forward`'s loop returns them."""
        x = self._shard_batch(x)
        routing: Tuple = ()
        for group in block_groups(list(blocks)):
            x, routed = self._scan(group, x, cos, sin, return_routing)
            routing += routed
        return (x, routing) if return_routing else x

    def _scan(self, group: List[nn.Module], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              return_routing: bool) -> Tuple[torch.Tensor, Tuple]:
        from torch_xla.experimental.scan import scan

        per_block = [dict(block.named_parameters()) for block in group]
        stacked = {name: self._shard_stacked(torch.stack([p[name] for p in per_block])) for name in per_block[0]}
        n = len(group)
        rope = (cos.expand(n, *cos.shape), sin.expand(n, *sin.shape))
        # is_fn_pure: torch_xla keeps the traced forward/backward graphs of `fn` (keyed by the function object and
        # the shapes) instead of tracing the block with AOTAutograd at every step
        x, routed = scan(self._block_fn(group[0], return_routing), x, (stacked, rope), partition_fn=self.partition_fn,
                         is_fn_pure=True)
        if not routed:
            return x, ()
        # each layer's routing (stacked over the group's layers), in layer order as the loop returns it
        return x, tuple(r for i, block in enumerate(group) for r in _unpack_routings(block, [t[i] for t in routed]))

    def _block_fn(self, template: nn.Module, return_routing: bool = False) -> Callable:
        """The scanned function of a group, one object per (structure, mode) so that its traced graphs are reused,
        also by later groups of the same structure (Gemma 3's repeated runs of five sliding layers and one global
        one trace two bodies, not one per run: torch_xla keys its cache by the function and the shapes of one
        layer's slice, not by the group's length). The body calls the first template of that structure with each
        layer's parameters: equal structure (module types, parameters, layer kind) and the model's one `config`
        (the other per-block values come from it) make the blocks interchangeable. The mode (train/eval: dropout
        on or off, grad or not, autocast) is part of what was traced."""
        key = (_structure(template), id(getattr(template, "config", template)), template.training,
               torch.is_grad_enabled(), torch.is_autocast_enabled("xla"), torch.get_autocast_dtype("xla"),
               return_routing and bool(moe_layers(template)))
        fn = self._fns.get(key)
        if fn is None:

            def fn(carry: torch.Tensor, layer: Tuple[Dict[str, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]):
                params, (c, s) = layer
                if not key[-1]:
                    return self._shard_batch(torch.func.functional_call(template, params, (carry, c, s)),
                                             grads_too=True), None
                # the MoE layers' routing of this layer leaves the body as an output
                out, routing = torch.func.functional_call(template, params, (carry, c, s), {"return_routing": True})
                return self._shard_batch(out, grads_too=True), tuple(pack_routing(r) for r in routing)

            self._fns[key] = fn
        return fn

    def _shard_batch(self, t: torch.Tensor, grads_too: bool = False) -> torch.Tensor:
        """Activations split along the batch (what FSDPv2's `shard_output` does after each wrapped block)."""
        if self.mesh is None or t.shape[0] % _data_parallel_size(self.mesh, self.batch_axes):
            return t
        import torch_xla.distributed.spmd as xs

        spec = (self.batch_axes,) + (None,) * (t.dim() - 1)
        if grads_too:  # inside the traced block: the autograd-aware annotation (also constrains the gradient)
            return xs.mark_sharding_with_gradients(t, self.mesh, spec)
        xs.mark_sharding(t, self.mesh, spec)
        return t

    def _shard_stacked(self, t: torch.Tensor) -> torch.Tensor:
        """(layers, *shape): each layer's slice sharded like FSDPv2 shards the parameter (largest dim over fsdp)."""
        if self.mesh is None or t.dim() < 2:
            return t
        import torch_xla.distributed.spmd as xs
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

        spec = _prepare_spmd_partition_spec(torch.empty(t.shape[1:], device="meta"), shard_maximal=True)
        xs.mark_sharding(t, self.mesh, (None,) + tuple(spec))
        return t


def _unpack_routings(block: nn.Module, packed: Sequence[torch.Tensor]) -> Tuple:
    """The `lit_gpt.moe.Routing` of each MoE layer of `block` from its `pack_routing` tensors."""
    return tuple(unpack_routing(t, m.n_expert, m.k) for m, t in zip(moe_layers(block), packed))


def checkpoint_block(block: nn.Module) -> nn.Module:
    """Activation checkpointing of a block (recompute its activations in the backward pass): torch_xla's reentrant
    checkpoint (`torch_xla.utils.checkpoint`, what `checkpoint_module` applies) with two changes.

    * Frozen weights stay out of the step's outputs. torch_xla's checkpoint puts its optimization barrier, in place,
      on the recomputation's inputs, the incoming gradients and all of the block's parameters and buffers; a frozen
      weight then holds the barrier's result instead of its own data, so the step writes every frozen weight of the
      block out again as a new, undonated buffer (+0.05 GiB per chip per block for LoRA on Llama-3.1-8B, v5e-8,
      and on 70B, v5e-32; tutorials/resources.md). Here a frozen parameter or buffer goes through the same barrier as a
      copy that only the recomputation uses (the compiler still cannot merge the recomputation, nor the gathering of
      the weights it reads, into the forward pass), and the weight itself keeps its data. Trainable parameters get
      the barrier in place as before (their gradients and new values are the step's outputs anyway).
    * The routing of the block's MoE layers (`return_routing=True`) is returned through the checkpointed function as
      its output tensors: its first forward runs under no_grad, so a routing handed out any other way would carry
      no gradient to the router's load-balancing loss (the recomputation in the backward pass comes too late).

    Evaluation, generation and a block whose inputs need no gradient (the first block under LoRA) run unchanged,
    as under `checkpoint_module` (the reentrant checkpoint would lose its parameters' gradients)."""
    original = block.forward
    moe = bool(moe_layers(block))

    def run(*args: Any) -> Any:
        if not moe:
            return original(*args)
        out, routing = original(*args, return_routing=True)
        return (out,) + tuple(pack_routing(r) for r in routing)

    def forward(self: nn.Module, *args: Any, return_routing: bool = False, **kwargs: Any) -> Any:
        if kwargs or not (block.training and torch.is_grad_enabled()) or not any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return original(*args, **({"return_routing": True} if return_routing else {}), **kwargs)
        outs = _Checkpoint.apply(block, run, *args)
        if not moe:
            return (outs, ()) if return_routing else outs
        return (outs[0], _unpack_routings(block, outs[1:])) if return_routing else outs[0]

    block.forward = types.MethodType(forward, block)  # a bound method, as FSDPv2 requires of what it wraps
    return block


class _Checkpoint(torch.autograd.Function):
    """torch_xla 2.9's `CheckpointFunction` (torch_xla/utils/checkpoint.py: RNG and autocast state kept for the
    recomputation, one optimization barrier before it), with the block's frozen parameters and buffers put through
    the barrier as copies (`checkpoint_block`)."""

    @staticmethod
    def forward(ctx: Any, block: nn.Module, run: Callable, *args: Any) -> Any:
        import torch_xla.core.xla_model as xm

        ctx.block, ctx.run = block, run
        ctx.autocast = [dict(device_type=d, enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                             cache_enabled=torch.is_autocast_cache_enabled()) for d in ("xla", "cpu")]
        ctx.rng = (xm.get_rng_state(), torch.get_rng_state())  # dropout draws the same masks when recomputed
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        with torch.no_grad():
            return run(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        import torch_xla.core.xla_model as xm
        from torch.nn.utils.stateless import _reparametrize_module
        from torch.utils.checkpoint import detach_variable
        from torch_xla.utils.checkpoint import chkpt_status

        chkpt_status.in_chkpt_bwd = True  # as torch_xla's checkpoint (its FSDP reads it)
        inputs = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            inputs[i] = t
        trainable = [p for p in ctx.block.parameters() if p.requires_grad]
        frozen = {name: t for name, t in [*ctx.block.named_parameters(), *ctx.block.named_buffers()]
                  if not t.requires_grad}
        copies = {name: t.detach().clone() for name, t in frozen.items()}
        tensors = [t for t in [*inputs, *grads, *trainable, *copies.values()] if torch.is_tensor(t)]
        # separates the recomputation from the forward pass (else the compiler merges them and keeps the activations)
        xm.optimization_barrier_(tensors)
        with torch.random.fork_rng(devices=[]), xm.fork_rng():
            xm.set_rng_state(ctx.rng[0])
            torch.set_rng_state(ctx.rng[1])
            detached = detach_variable(tuple(inputs))
            with torch.enable_grad(), torch.autocast(**ctx.autocast[0]), torch.autocast(**ctx.autocast[1]), \
                    _reparametrize_module(ctx.block, copies):
                outputs = ctx.run(*detached)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if not pairs:
            raise RuntimeError("none of the checkpointed block's outputs requires a gradient")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        chkpt_status.in_chkpt_bwd = False
        return (None, None) + tuple(t.grad if torch.is_tensor(t) else None for t in detached)


def _bool_activations_as_uint8(partition: Callable, joint: Any, joint_inputs: Any, **kwargs: Any) -> Tuple[Any, Any]:
    """`partition` (AOTAutograd's split of the traced block into forward and backward graphs), with boolean saved
    activations (dropout masks) passed between the two as uint8.

    torch_xla 2.9's scan stacks every saved activation of every layer in a buffer of the activation's dtype; a
    dropout mask is bool to torch but f32 inside XLA, and the loop's update then fails ("Dynamic update slice update
    element type does not match argument. operand.element_type: PRED vs update.element_type: F32"). A uint8
    copy is uint8 on both sides (and as small as a bool)."""
    fwd, bwd = partition(joint, joint_inputs, **kwargs)
    output = next(n for n in fwd.graph.nodes if n.op == "output")
    saved = {
        n.name for n in output.args[0]
        if isinstance(n, torch.fx.Node) and getattr(n.meta.get("val"), "dtype", None) == torch.bool
    }
    if not saved:
        return fwd, bwd
    with fwd.graph.inserting_before(output):
        converted = {
            name: fwd.graph.call_function(torch.ops.aten._to_copy.default, (n,), {"dtype": torch.uint8})
            for name, n in ((n.name, n) for n in output.args[0] if isinstance(n, torch.fx.Node) and n.name in saved)
        }
    output.args = (tuple(converted.get(n.name, n) if isinstance(n, torch.fx.Node) else n for n in output.args[0]),)
    for placeholder in [n for n in bwd.graph.nodes if n.op == "placeholder" and n.name in saved]:
        with bwd.graph.inserting_after(placeholder):
            back = bwd.graph.call_function(torch.ops.aten._to_copy.default, (placeholder,), {"dtype": torch.bool})
        placeholder.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    fwd.recompile()
    bwd.recompile()
    return fwd, bwd


def _data_parallel_size(mesh: Any, axes: Union[str, Tuple[str, ...]]) -> int:
    shape = mesh.shape()
    size = 1
    for axis in (axes,) if isinstance(axes, str) else axes:
        size *= int(shape[axis])
    return size
