"""FSDP over SPMD (torch_xla's FSDPv2) as a Lightning Fabric strategy, and its precision plugin.

    fabric = make_fabric(precision="bf16-true", activation_checkpointing=True)
    fabric.launch(main, ...)                     # no process spawning: one process per host
    # in main(fabric):
    model = load_staged(config, checkpoint_path, fabric)       # lit_gpt.xla.loader: sharded while it loads
    optimizer = torch.optim.AdamW(trainable_params, lr=...)
    model, optimizer = fabric.setup(model, optimizer)          # wraps every Block with SpmdFullyShardedDataParallel
    input_ids, targets = shard_batch(fabric, (input_ids, targets))   # batch dim split over the devices
    loss = ...; fabric.backward(loss); optimizer.step()        # the step ends with torch_xla.sync()

Design (SPMD, not one process per device):
  * One Python process per host drives all of its devices; XLA's SPMD partitioner splits the single program.
    The device mesh spans every device of every host, with axes ("dcn", "fsdp"): "fsdp" over the chips of one
    slice, "dcn" over slices (`num_slices`, multi-slice TPU). Parameters (and with them gradients and optimizer
    state) are sharded along "fsdp" on their largest dimension and replicated over "dcn"; activations and
    inputs are sharded along the batch over ("dcn", "fsdp").
  * Multi-process collectives on XLA:CPU hang (pytorch/xla #5005, #9089), so this design is also what makes
    8 virtual CPU devices in one process a faithful test of the TPU setup.
  * Fabric's view: `world_size` / `global_rank` count *processes* (hosts), so `DistributedSampler` gives each
    host its share of the data and `fabric.print` prints once per host (stdout is line-buffered so that output
    from `gcloud ... --worker=all` arrives in order).
  * Collectives have SPMD semantics: a tensor on the XLA device is one logical (global) tensor, already the same
    on every host, so `all_reduce`, `all_gather` and `broadcast` return it unchanged. Host values (Python numbers,
    CPU tensors) differ per host and are reduced / gathered / broadcast across processes over a gloo group
    (created only with more than one host). `barrier` waits for all hosts.

Precision (`SPMDPrecision`):
  * "32-true": fp32 parameters.
  * "bf16-true": bf16 parameters: the model is cast (Fabric's own "bf16-true" on XLA sets XLA_USE_BF16, which
    torch_xla deprecated and which leaves torch tensors fp32). `load_staged` casts while loading.
  * "bf16-mixed": fp32 parameters, forward under `torch.autocast("xla", dtype=torch.bfloat16)`.
  Outputs are not upcast (the loss is computed by `chunked_cross_entropy`, which upcasts chunk by chunk).

Multi-host TPU (a v4-32 has 4 hosts x 4 chips): copy the same code and data to every worker and start the same
command on all of them at once:
    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \
        --command "cd repo && PJRT_DEVICE=TPU python xla/finetune/adapter.py ..."
torch_xla's PJRT runtime finds the other hosts itself (TPU metadata), `xr.process_count()` becomes the number of
hosts and the mesh spans hosts x chips; this strategy then opens a gloo process group (`init_method="xla://"`)
for checkpoint coordination and host-value collectives. Save checkpoints to a directory all hosts share.
"""

import functools
import os
import sys
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Set, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import Precision, XLAPrecision
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.strategies import XLAStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import Strategy, TBroadcast
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lit_gpt.utils import LitError
from lit_gpt.xla.accelerator import PJRTAccelerator, configure_pjrt_device, pjrt_device_count

PRECISIONS = ("32-true", "bf16-true", "bf16-mixed")
_PrecisionInput = Literal["32-true", "bf16-true", "bf16-mixed"]


# ---------------------------------------------------------------------------------------------------------------
# precision
# ---------------------------------------------------------------------------------------------------------------
class SPMDPrecision(XLAPrecision):
    """fp32, bf16 parameters ("bf16-true", by casting) or bf16 autocast ("bf16-mixed") on XLA.

    A subclass of Lightning's `XLAPrecision` so that Lightning's XLA strategies accept it too, but it never sets
    the deprecated `XLA_USE_BF16`."""

    def __init__(self, precision: _PrecisionInput = "32-true") -> None:
        # XLAPrecision.__init__ is skipped on purpose: it sets XLA_USE_BF16 / XLA_USE_F16
        precision = _normalize_precision(precision)
        self.precision = precision  # type: ignore[assignment]
        self._desired_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the parameters (what `load_staged` casts floating tensors to)."""
        return self._desired_dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(dtype=torch.bfloat16)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(torch.bfloat16) if self.precision == "bf16-true" else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast("xla", dtype=torch.bfloat16)
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.bfloat16)
        return data

    def convert_output(self, data: Any) -> Any:
        return data

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        import torch_xla

        # under SPMD the partitioner already inserted the gradient reductions: no xm.reduce_gradients here.
        # sync() ends the training step's graph, as XLAPrecision's barrier=True does
        out = optimizer.step(**kwargs)
        torch_xla.sync()
        return out

    def teardown(self) -> None:
        pass


def _normalize_precision(precision: Any) -> str:
    aliases = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}
    precision = aliases.get(precision, precision)
    if precision not in PRECISIONS:
        raise LitError(f"precision={precision!r} is not supported on XLA: choose one of {', '.join(PRECISIONS)}")
    return precision


# ---------------------------------------------------------------------------------------------------------------
# cluster environment: processes = hosts
# ---------------------------------------------------------------------------------------------------------------
class SPMDEnvironment(ClusterEnvironment):
    """One process per host, ranked by the PJRT runtime (`process_index` / `process_count`)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the same command is started on every host (gcloud ... --worker=all); nothing is spawned

    @property
    def main_address(self) -> str:
        import torch_xla.runtime as xr

        return xr.get_master_ip() if xr.process_count() > 1 else "localhost"

    @property
    def main_port(self) -> int:
        return 12355

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        import torch_xla.runtime as xr

        return xr.process_count()

    def set_world_size(self, size: int) -> None:
        pass  # decided by the runtime

    def global_rank(self) -> int:
        import torch_xla.runtime as xr

        return xr.process_index()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()


# ---------------------------------------------------------------------------------------------------------------
# strategy
# ---------------------------------------------------------------------------------------------------------------
def _default_layer_cls() -> Set[Type[nn.Module]]:
    from lit_gpt.model import Block

    return {Block}


class SPMDFSDPStrategy(XLAStrategy):
    """FSDPv2 (`SpmdFullyShardedDataParallel`) over a device mesh of all devices, one process per host.

    Args:
        accelerator: defaults to `PJRTAccelerator()` (set by Fabric when passed there).
        precision: "32-true", "bf16-true" or "bf16-mixed" (or an `SPMDPrecision`).
        layer_cls: module classes wrapped (and checkpointed) one by one; default `{lit_gpt.model.Block}`.
        activation_checkpointing: recompute each wrapped layer's activations in the backward pass.
        scan_layers: run a GPT's blocks as one scanned layer (lit_gpt.xla.scan): True, False, or "auto" (from
            `lit_gpt.xla.scan.AUTO_MIN_LAYERS` blocks on). Then only the root is wrapped (its parameters sharded
            the same way) and the scan does per layer what the per-block wrappers do.
        num_slices: TPU slices connected over DCN (multi-slice); the "dcn" mesh axis. 1 on a single slice.

    Subclasses Lightning's `XLAStrategy` only so that Fabric treats it as XLA (the accelerator check, optimizer
    parameter remapping, no device move in dataloaders); every behaviour that matters is overridden here."""

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        precision: Optional[Union[str, SPMDPrecision]] = None,
        layer_cls: Optional[Iterable[Type[nn.Module]]] = None,
        activation_checkpointing: bool = False,
        num_slices: int = 1,
        parallel_devices: Optional[List[torch.device]] = None,
        scan_layers: Union[bool, str] = False,
    ) -> None:
        if isinstance(precision, str):
            precision = SPMDPrecision(precision)  # type: ignore[arg-type]
        # XLAStrategy.__init__ is skipped: it installs XLAEnvironment, whose ranks are devices, not processes
        ParallelStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=SPMDEnvironment(),
            checkpoint_io=None,
            precision=precision,
        )
        self._backward_sync_control = None  # gradients are reduced inside the compiled step
        self._launched = False
        self._sync_module_states = False
        self.layer_cls = set(layer_cls) if layer_cls is not None else None
        self.activation_checkpointing = activation_checkpointing
        self.scan_layers = scan_layers
        self.scanning: Optional[bool] = None  # decided in setup_module (for "auto": by the model's depth)
        if num_slices < 1:
            raise LitError(f"num_slices must be >= 1, got {num_slices}")
        self.num_slices = num_slices
        self._mesh = None

    # -------------------------------------------------------------- plugins
    @property
    def precision(self) -> SPMDPrecision:
        plugin = self._precision
        return plugin if plugin is not None else SPMDPrecision("32-true")  # type: ignore[return-value]

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is None:
            self._precision = None
            return
        if not isinstance(precision, SPMDPrecision):
            if isinstance(precision, XLAPrecision):
                # Fabric(precision=...) builds XLAPrecision, which set the deprecated XLA_USE_BF16: undo and convert
                os.environ.pop("XLA_USE_BF16", None)
                os.environ.pop("XLA_USE_F16", None)
                precision = SPMDPrecision(precision.precision)  # type: ignore[arg-type]
            else:
                raise TypeError(f"{type(self).__name__} needs an SPMDPrecision plugin, got {type(precision).__name__}")
        self._precision = precision

    # -------------------------------------------------------------- topology
    @property
    def root_device(self) -> torch.device:
        import torch_xla

        return torch_xla.device()

    @property
    def num_processes(self) -> int:
        return self.world_size

    @property
    def mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("the device mesh exists once the strategy is set up: call fabric.launch() first")
        return self._mesh

    @property
    def num_devices(self) -> int:
        return int(self.mesh.size())

    @property
    def batch_axes(self) -> Tuple[str, str]:
        """Mesh axes the batch dimension is split over."""
        return ("dcn", "fsdp")

    def _configure_launcher(self) -> None:
        self._launcher = None  # nothing to spawn: SPMD drives all local devices from this process

    def setup_environment(self) -> None:
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        configure_pjrt_device(verbose=False)
        if not xr.is_spmd():
            xr.use_spmd()  # before any tensor lives on the device, so nothing needs replicating later
        n = pjrt_device_count()
        if self.parallel_devices is not None and len(self.parallel_devices) not in (n,):
            raise LitError(
                f"devices={len(self.parallel_devices)} but the XLA runtime has {n} devices: the SPMD mesh spans all"
                " of them (use devices='auto')"
            )
        if n % self.num_slices:
            raise LitError(f"num_slices={self.num_slices} does not divide the {n} devices")
        if xr.process_count() > 1 and not dist.is_initialized():
            # host-level coordination (checkpoint writes, host-value collectives); the `xla` backend is refused
            # under SPMD, gloo over the runtime's own rendezvous is what torch.distributed.checkpoint needs
            dist.init_process_group("gloo", init_method="xla://")
        per_slice = n // self.num_slices
        if self.num_slices > 1 and xr.device_type() == "TPU":
            mesh = xs.HybridMesh(
                ici_mesh_shape=(1, per_slice), dcn_mesh_shape=(self.num_slices, 1), axis_names=("dcn", "fsdp")
            )
        else:
            # off TPU there is no slice topology to consult: devices are taken in order, slice after slice
            mesh = xs.Mesh(np.arange(n), (self.num_slices, per_slice), ("dcn", "fsdp"))
        xs.set_global_mesh(mesh)
        self._mesh = mesh
        self._launched = True
        rank_zero_only.rank = self.global_rank
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                # remote launches (gcloud ... --worker=all) pipe stdout: without this, output arrives in blocks
                stream.reconfigure(line_buffering=True)
        Strategy.setup_environment(self)

    # -------------------------------------------------------------- model
    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

        if isinstance(module, FSDPv2):
            return module
        # FSDPv2's optimization-barrier hooks are full backward hooks; torch warns on every backward through the
        # first block, whose input (the embedding of int ids) needs no gradient. Expected here, so not shown.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        from lit_gpt.xla.flash import tpu_segment_attention
        from lit_gpt.xla.moe_gmm import use_pallas_gmm
        from lit_gpt.xla.scan import ScannedBlocks, checkpoint_block, resolve_scan_layers
        if hasattr(module, "segment_attention"):  # packed rows: the TPU's flash kernel with segment ids
            module.segment_attention = tpu_segment_attention(self.mesh, self.batch_axes)
        use_pallas_gmm(module)  # MoE on a TPU: the dropless dispatch through the Pallas grouped matmul (megablox)
        if getattr(module, "serve_placement", None) is not None:  # placed for serving (xla/serve_placement.py): FSDP
            return module  # would shard the weights again and all-gather every one of them in every decode step

        self.scanning = resolve_scan_layers(self.scan_layers, module)
        if self.scanning:
            # one wrapper at the root shards every parameter as the per-block wrappers would (the names inside
            # checkpoints are the same: lit_gpt.xla.checkpoint strips the wrappers' prefixes); the scan gathers a
            # layer's weights per iteration, splits the activations along the batch and does the checkpointing
            module.block_runner = ScannedBlocks(self.mesh, self.batch_axes, self.activation_checkpointing)
            if self.global_rank == 0:
                n = len(module.transformer.h)
                print(f"The {n} blocks run as one scanned layer (scan_layers={self.scan_layers})")
            return FSDPv2(module, mesh=self.mesh, shard_output=self._shard_output)
        layer_cls = self.layer_cls if self.layer_cls is not None else _default_layer_cls()
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
        def checkpointed(m: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            # checkpoint_module, with MoE layers' routing returned through the checkpoint (lit_gpt.xla.scan)
            return FSDPv2(checkpoint_block(m), *args, **kwargs)

        wrapper = checkpointed if self.activation_checkpointing else None

        return FSDPv2(module, mesh=self.mesh, shard_output=self._shard_output, auto_wrap_policy=policy,
                      auto_wrapper_callable=wrapper)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: List[Optimizer], scheduler: Optional[Any] = None
    ) -> Tuple[nn.Module, List[Optimizer], Optional[Any]]:
        # FSDPv2 shards the parameters in place: the optimizers keep referencing the same Parameter objects
        return self.setup_module(module), optimizers, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def _shard_output(self, output: Any, mesh: Any) -> None:
        """Annotate a layer's output as split along the batch (this is what makes the compiler do FSDP).

        A batch that does not split evenly (generation with batch 1) is left to the compiler."""
        import torch_xla.distributed.spmd as xs

        out = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(out, Tensor) or out.dim() == 0:
            return
        if out.shape[0] % self._data_parallel_size(mesh) == 0:
            xs.mark_sharding(out, mesh, (self.batch_axes,) + (None,) * (out.dim() - 1))

    @staticmethod
    def _data_parallel_size(mesh: Any) -> int:
        shape = mesh.shape()
        return int(shape["dcn"] * shape["fsdp"])

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        # error_if_nonfinite would read the norm on the host every step (a device->host sync): not on XLA
        parameters = self.precision.main_params(optimizer)
        return torch.nn.utils.clip_grad_norm_(
            parameters, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=False
        )

    # -------------------------------------------------------------- data
    def shard_batch(self, batch: Any) -> Any:
        """Move CPU tensors to the devices split along dim 0 over the data axes (each device gets its rows).

        On several hosts each host passes its own part of the global batch (what DistributedSampler gives it)."""
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        mesh = self.mesh
        n_data = self._data_parallel_size(mesh)
        multi_host = xr.process_count() > 1
        local = n_data // xr.process_count() if multi_host else n_data
        device = self.root_device

        def move(t: Tensor) -> Tensor:
            if t.dim() == 0:
                return t.to(device)
            if t.shape[0] % local:
                raise LitError(
                    f"batch size {t.shape[0]} is not divisible by the {local} devices the batch is split over:"
                    f" use a (micro-)batch size that is a multiple of {local}"
                )
            spec = (self.batch_axes,) + (None,) * (t.dim() - 1)
            if t.device.type == "xla":
                xs.mark_sharding(t, mesh, spec)
                return t
            sharding = xs.ShardingSpec(mesh, spec, minibatch=multi_host)
            return xm.send_cpu_data_to_device([t], device, sharding)[0]

        return apply_to_collection(batch, Tensor, move)

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None) -> Any:
        return self.shard_batch(batch)

    def process_dataloader(self, dataloader: DataLoader) -> Any:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        if isinstance(dataloader, MpDeviceLoader):
            return dataloader
        multi_host = xr.process_count() > 1
        local = self._data_parallel_size(self.mesh) // (xr.process_count() if multi_host else 1)
        batch_size = getattr(dataloader, "batch_size", None)
        if batch_size is not None and batch_size % local:
            raise LitError(
                f"batch size {batch_size} is not divisible by the {local} devices the batch is split over: use a"
                f" multiple of {local}"
            )
        # one spec for the 2-D (batch, time) tensors of a language-model batch; others stay replicated
        sharding = xs.ShardingSpec(self.mesh, (self.batch_axes, None), minibatch=multi_host)
        loader = MpDeviceLoader(dataloader, self.root_device, input_sharding=sharding)
        loader.dataset = dataloader.dataset
        loader.batch_sampler = getattr(dataloader, "batch_sampler", None)
        return loader

    # -------------------------------------------------------------- collectives (SPMD semantics)
    def _multi_host(self) -> bool:
        return self._launched and self.world_size > 1

    def all_reduce(
        self,
        output: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Tensor:
        if not isinstance(output, Tensor):
            output = torch.tensor(output)
        if output.device.type == "xla" or not self._multi_host():
            return output  # one logical tensor: every host already holds the global value
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"reduce_op {reduce_op!r} is not supported: use sum, mean, max or min")
        t = output.detach().clone()
        dist.all_reduce(t, op=ops[op])
        return t / self.world_size if op in ("mean", "avg") else t

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        total = self.all_reduce(torch.tensor(int(decision)), reduce_op="sum")
        return bool(total == self.world_size) if all else bool(total > 0)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if tensor.device.type == "xla" or not self._multi_host():
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    def barrier(self, name: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        if self._multi_host():
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not self._multi_host() or (isinstance(obj, Tensor) and obj.device.type == "xla"):
            return obj
        box = [apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        path: _PATH,
        state: Dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """`fabric.save(dir, state)`: a sharded checkpoint directory (see lit_gpt.xla.checkpoint). The one path of
        every XLA step checkpoint. `storage_options` may be `{"write_files": fn}`: `fn(folder)` writes more files
        (the run's config and tokenizer) into the checkpoint before it is committed."""
        from lit_gpt.xla.checkpoint import save_sharded

        options = dict(storage_options or {})
        write_files = options.pop("write_files", None)
        if options:
            raise TypeError(f"{type(self).__name__} takes only storage_options={{'write_files': fn}}, got {sorted(options)}")
        save_sharded(path, state, filter=filter, write_files=write_files)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[nn.Module, Optimizer, Dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """`fabric.load(dir, state)`: restores modules/optimizers in place, returns the other saved values."""
        from lit_gpt.xla.checkpoint import load_sharded

        if isinstance(state, (nn.Module, Optimizer)):
            raise LitError(
                "a sharded checkpoint is loaded into a dict of objects: fabric.load(dir, {'model': model, ...});"
                " for a plain lit_model.pth use lit_gpt.xla.load_staged"
            )
        if not state:
            return load_sharded(path, {}, strict=False, restore_rng=False)
        return load_sharded(path, state, strict=strict)

    def teardown(self) -> None:
        Strategy.teardown(self)


# ---------------------------------------------------------------------------------------------------------------
# entry points for recipes
# ---------------------------------------------------------------------------------------------------------------
def make_fabric(
    devices: Union[int, str] = "auto",
    precision: str = "32-true",
    activation_checkpointing: bool = False,
    num_slices: int = 1,
    layer_cls: Optional[Iterable[Type[nn.Module]]] = None,
    compile_cache_dir: Optional[str] = None,
    loggers: Optional[Any] = None,
    scan_layers: Union[bool, str] = False,
) -> Fabric:
    """A Fabric running `SPMDFSDPStrategy` on every PJRT device. Call `fabric.launch(...)` next.

    `devices` must be "auto" or the runtime's device count (an SPMD mesh spans all devices; on the CPU choose
    the count with CPU_NUM_DEVICES). `compile_cache_dir` turns on the persistent compilation cache. `scan_layers`:
    see `SPMDFSDPStrategy`."""
    configure_pjrt_device()
    if compile_cache_dir:
        from lit_gpt.xla.diagnostics import init_compile_cache

        init_compile_cache(compile_cache_dir)
    accelerator = PJRTAccelerator()
    accelerator.parse_devices(devices)  # clear error for a device count the mesh cannot use
    if devices not in ("auto", -1, "-1") and int(devices) != pjrt_device_count():
        raise LitError(
            f"devices={devices} but the XLA runtime has {pjrt_device_count()} devices: the SPMD mesh spans all of"
            " them. Use devices='auto', or change the device count (CPU_NUM_DEVICES on the CPU, TPU_VISIBLE_CHIPS"
            " with TPU_PROCESS_BOUNDS / TPU_CHIPS_PER_PROCESS_BOUNDS on a TPU)"
        )
    strategy = SPMDFSDPStrategy(
        precision=SPMDPrecision(precision),  # type: ignore[arg-type]
        layer_cls=layer_cls,
        activation_checkpointing=activation_checkpointing,
        num_slices=num_slices,
        scan_layers=scan_layers,
    )
    return Fabric(accelerator=accelerator, strategy=strategy, devices="auto", loggers=loggers)


def get_strategy(fabric: Union[Fabric, SPMDFSDPStrategy]) -> SPMDFSDPStrategy:
    strategy = fabric.strategy if isinstance(fabric, Fabric) else fabric
    if not isinstance(strategy, SPMDFSDPStrategy):
        raise TypeError(
            f"expected a Fabric with SPMDFSDPStrategy (lit_gpt.xla.make_fabric), got {type(strategy).__name__}"
        )
    return strategy


def shard_batch(fabric: Union[Fabric, SPMDFSDPStrategy], batch: Any) -> Any:
    """Put a batch (tensor or collection of tensors) on the devices, split along its first dimension."""
    return get_strategy(fabric).shard_batch(batch)
