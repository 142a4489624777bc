"""The backend policy: what the one training loop (`lit_gpt.training.fit`) and the one generation loop
(`lit_gpt.generate`) need from a backend beyond its Fabric strategy, and its CPU / CUDA implementation.
`lit_gpt.xla.runtime.XLARuntime` is the XLA one. A recipe builds the policy and passes it in explicitly (there is
no factory that picks one from a device); collectives, barriers and saving/loading files go through Fabric, whose
strategy is the other half of the backend layer.

The loops are written once; a `Runtime` answers the questions on which backends differ:

* placement: how a host batch reaches the devices (`place`: Fabric's `to_device`, which the XLA strategy splits
  over the SPMD mesh), how a
  long-lived tensor is created (`to_device`, `zeros`), and whether the loss head may take data-dependent shapes
  (`targets_only`: eager backends skip unlabelled positions, tracing backends keep every shape static);
* graph cuts: `end_micro_batch` and `end_step` (XLA ends its lazy graph there; eager backends do nothing);
* data parallelism: how many devices split the global batch (`data_parallel_size`), how many of them one
  process feeds (`local_devices`), and how gradients are combined (`grad_scale`: DDP/FSDP average over
  processes, an SPMD program computes the global gradient at once);
* RNG states (`rng_state` / `set_rng_state`: every generator in play on this backend);
* checkpoints: a step checkpoint is one file written by Fabric (CPU/CUDA) or a directory of per-host shards
  written by the XLA strategy; both under a temporary name with the run's files inside, renamed when complete;
  the final export is the project's weights format (`lit_gpt.weights`, `lit_gpt.export`);
* generation: KV-cache allocation, prompt buckets, how often the host looks at the stop flag;
* diagnostics: compilations so far, the device's peak FLOP/s for MFU.
"""

import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from lit_gpt.config import next_power_of_two
from lit_gpt.kv_cache import allocate_paged_kv_cache
from lit_gpt.manifest import MANIFEST, StepProblem, newest_intact, step_problem, write_manifest
from lit_gpt.state import commit_folder, rng_state, set_rng_state
from lit_gpt.storage import is_url, location, remove, staging_dir, upload
from lit_gpt.utils import Interrupted, LitError, load_error_detail

STEP_DIR = re.compile(r"^step-(\d+)$")
STEP_FILE = "checkpoint.pth"  # Fabric's checkpoint of a step: model, optimizer, train state
FINAL_DIR = "final"


def param_dtype(precision: str) -> torch.dtype:
    """dtype of the parameters under a Fabric precision setting: "-true" casts them, "-mixed" keeps fp32."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}.get(
        str(precision), torch.float32
    )


def write_error(directory: Path, partials: Sequence[Path], e: OSError) -> LitError:
    """A checkpoint that could not be written (full disk, quota, permissions): its partial folders are removed,
    the complete checkpoints before it stay, and the user gets one line."""
    for partial in partials:
        shutil.rmtree(partial, ignore_errors=True)
    return LitError(
        f"cannot write the checkpoint {str(directory)!r} ({e.strerror or e}): free space there or choose another"
        " --out_dir, then continue with --resume auto (the earlier checkpoints are intact)"
    )


def _call_block(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[torch.Tensor] = None, return_routing: bool = False) -> Any:
    # MoE training: (x, the block's routing), returned from the compiled graph for the router's loss
    return block(x, cos, sin, None, mask, return_routing=True) if return_routing else block(x, cos, sin, None, mask)


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of a (possibly Fabric- or FSDP-wrapped) model on the CPU, with plain names. Every
    rank must call it (FSDP all-gathers through torch's public `get_model_state_dict`); rank 0's copy is the one
    to write. Tensors that share storage (a tied head) still share it on the CPU, so they are written once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel

    forward = getattr(model, "_forward_module", model)  # inside Fabric's wrapper: FSDP, DDP or the model
    if any(isinstance(m, FullyShardedDataParallel) for m in forward.modules()):
        return get_model_state_dict(forward, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    inner = model.module if hasattr(model, "_forward_module") else model  # Fabric's `.module`: the model, not DDP
    on_cpu: Dict[Any, torch.Tensor] = {}
    out: Dict[str, torch.Tensor] = {}
    for k, v in inner.state_dict().items():
        key = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in on_cpu:
            on_cpu[key] = v.detach().cpu()
        out[k] = on_cpu[key]
    return out


def bucket_length(length: int, limit: int, minimum: int = 16) -> int:
    """A padded prompt length (the next power of two, at least `minimum`, at most `limit`): with prompts padded to
    a few bucket lengths, a tracing backend compiles the prefill once per bucket instead of once per length."""
    return min(max(next_power_of_two(length), minimum), limit)


def resolve_accelerator(accelerator: str) -> str:
    """`--accelerator auto|cpu|cuda` -> "cpu" or "cuda", with one line when the choice cannot work here."""
    if accelerator not in ("auto", "cpu", "cuda", "gpu"):
        raise LitError(f"--accelerator must be auto, cpu or cuda (got {accelerator!r}); for TPUs use the xla/ recipes")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise LitError("--accelerator cuda but no GPU is visible to torch: use --accelerator cpu (or auto)")
        return "cuda"
    return "cpu"


class Runtime:
    """CPU and CUDA through Lightning Fabric (one device, DDP, FSDP, several nodes)."""

    name = "cpu/cuda"
    compiles_graphs = False
    """Whether the backend compiles graphs (then the loops count and report compilations)."""
    targets_only = True
    """The training loss may run the vocabulary head on the labelled positions only (a data-dependent shape)."""

    def __init__(self, fabric: Any = None, device: Optional[torch.device] = None) -> None:
        self.fabric = fabric
        self._device = torch.device(device) if device is not None else None

    # ----------------------------------------------------------------- devices
    @property
    def device(self) -> torch.device:
        return self.fabric.device if self.fabric is not None else self._device

    @property
    def data_parallel_size(self) -> int:
        """Devices the global batch is split over."""
        return self.fabric.world_size if self.fabric is not None else 1

    @property
    def local_devices(self) -> int:
        """Devices one process feeds: its batches have micro_batch_size x local_devices rows."""
        return 1

    @property
    def grad_scale(self) -> float:
        """Factor on each process's loss so that the combined gradient is the gradient of the global loss: DDP and
        FSDP average the processes' gradients."""
        return float(self.data_parallel_size)

    def place(self, tensors: Any) -> Any:
        """Host batch tensors onto this process's device(s)."""
        return self.fabric.to_device(tensors)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A long-lived host tensor (cache, position, flag) onto the device."""
        return t.to(self.device)

    def scalar(self, value: float) -> Any:
        """A number that changes every step, in the form the backend takes without recompiling."""
        return value

    def zeros(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.to_device(torch.zeros(shape, dtype=dtype))

    def backward_sync(self, model: nn.Module, last: bool) -> ContextManager:
        """Only the last micro-batch of a step synchronises gradients across processes."""
        return self.fabric.no_backward_sync(model, enabled=not last)

    def end_micro_batch(self, last: bool) -> None:
        """Called after each micro-batch's backward (XLA cuts its graph here)."""

    def end_step(self) -> None:
        """Called after each generation step (XLA ends the step's graph here)."""

    # ----------------------------------------------------------------- RNG
    def rng_state(self) -> Dict[str, Any]:
        """This process's generators: Python, NumPy, torch CPU and the device's (CUDA, XLA: dropout draws from it)."""
        return rng_state(self.device)

    def set_rng_state(self, state: Dict[str, Any]) -> None:
        kind = self.device.type
        if kind in ("cuda", "xla") and kind not in state:
            raise LitError(f"the checkpoint holds no {kind.upper()} generator state (it was written on another backend)")
        set_rng_state(state, self.device)

    def seed(self, seed: int) -> None:
        """Seed every generator of this process."""
        random.seed(seed)
        torch.manual_seed(seed)  # also every CUDA device's
        try:
            import numpy as np

            np.random.seed(seed % 2**32)
        except ImportError:
            pass

    # ----------------------------------------------------------------- checkpoints
    def step_file(self, directory: Path) -> Path:
        """What a step checkpoint directory must hold to count as complete: Fabric's checkpoint file (model,
        optimizer, values); a step folder of an earlier version holds `lit_model.pth[.METHOD]` instead."""
        directory = location(directory)
        path = directory / STEP_FILE
        if not is_url(directory) and not path.is_file():
            legacy = sorted(directory.glob("lit_model.pth*")) if directory.is_dir() else []
            if legacy:
                return legacy[0]
        return path

    def save_step(
        self,
        directory: Path,
        state: Dict[str, Any],
        filter: Optional[Dict[str, Callable[[str, Any], bool]]],
        write_files: Callable[[Path], None],
    ) -> Path:
        """`state` (modules, optimizer, plain values) into `directory/checkpoint.pth` through Fabric (its strategy
        writes it: one file, FSDP gathering the full state), with `write_files(dir)`'s files beside it, atomically:
        everything goes into `.{name}.partial` first, renamed when every process is done, so a killed run never
        leaves a half checkpoint that `--resume auto` would pick. In a bucket (no renames) the run's files go first
        and the checkpoint file, which makes the step complete, last."""
        fabric = self.fabric
        directory = location(directory)
        if is_url(directory):
            return self._save_step_in_bucket(directory, state, filter, write_files)
        tmp = directory.with_name(f".{directory.name}.partial")
        if fabric.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        fabric.barrier()
        try:
            fabric.save(tmp / STEP_FILE, state, filter=filter)
        except OSError as e:
            raise write_error(directory, [tmp], e) from e

        def commit() -> None:
            write_files(tmp)
            write_manifest(tmp)  # what the step holds (sizes, CRC32s): verified before it is resumed
            commit_folder(tmp, directory)

        self.on_rank_zero(commit, directory, [tmp])
        return directory

    def on_rank_zero(self, fn: Callable[[], Any], directory: Path, partials: Sequence[Path]) -> Any:
        """`fn()` on rank 0 while the other processes wait for its outcome (not at a bare barrier): when it fails
        to write, every process raises the same one line, instead of the others waiting at the next collective."""
        fabric = self.fabric
        result, failure = None, None
        if fabric.global_rank == 0:
            try:
                result = fn()
            except OSError as e:
                failure = write_error(directory, partials, e)
            except Interrupted:
                raise  # a signal: every process got its own (or stops at the peer timeout)
            except LitError as e:
                failure = e
        if fabric.world_size > 1:
            message = fabric.broadcast(None if failure is None else str(failure), src=0)
            failure = failure if fabric.global_rank == 0 or message is None else LitError(message)
        if failure is not None:
            raise failure
        return result

    def _save_step_in_bucket(
        self,
        directory: Path,
        state: Dict[str, Any],
        filter: Optional[Dict[str, Callable[[str, Any], bool]]],
        write_files: Callable[[Path], None],
    ) -> Path:
        # written to a local folder first (every Fabric strategy saves to a local path; FSDP only to one), then
        # uploaded with the manifest last: in a bucket (or a file:// URL, written in place) it is the commit
        fabric = self.fabric
        stage = fabric.broadcast(str(staging_dir()) if fabric.global_rank == 0 else None)
        try:
            fabric.save(Path(stage) / STEP_FILE, state, filter=filter)
            if fabric.global_rank == 0:
                write_files(Path(stage))
                write_manifest(Path(stage))
                remove(directory, first=[MANIFEST])  # an older version of this step: its commit first
                upload(Path(stage), directory, last=[MANIFEST])
        except OSError as e:
            raise write_error(directory, [], e) from e
        finally:
            if fabric.global_rank == 0:
                shutil.rmtree(stage, ignore_errors=True)
        fabric.barrier()
        return directory

    def load_step(self, directory: Path, state: Dict[str, Any]) -> Dict[str, Any]:
        """Restore the modules/optimizer of `state` in place from a step checkpoint (through Fabric); return the
        other values."""
        fabric = self.fabric
        file = self.step_file(directory)
        try:
            if not is_url(file):
                return fabric.load(file, state, strict=False, weights_only=True)
            from lightning.fabric.strategies import FSDPStrategy

            if not isinstance(fabric.strategy, FSDPStrategy):  # Fabric reads a URL through fsspec itself
                return fabric.load(str(file), state, strict=False, weights_only=True)
            # FSDP loads local paths only: one copy per machine, fetched by its first process
            import hashlib
            import tempfile

            local = Path(tempfile.gettempdir()) / f"lit-gpt-resume-{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
            if fabric.local_rank == 0:
                local.mkdir(parents=True, exist_ok=True)
                file.fs.get_file(file.path, str(local / file.name))
            fabric.barrier()
            try:
                return fabric.load(local / file.name, state, strict=False, weights_only=True)
            finally:
                fabric.barrier()
                if fabric.local_rank == 0:
                    shutil.rmtree(local, ignore_errors=True)
        except (RuntimeError, KeyError, ValueError) as e:
            raise LitError(
                f"cannot resume from {str(file)!r} ({load_error_detail(e)}): pass a step folder that this recipe wrote"
            ) from e

    def saved_method(self, directory: Path) -> str:
        """The method that wrote a step checkpoint ("full" when it records none), read before loading it."""
        from lit_gpt.weights import load_state_dict

        saved = load_state_dict(self.step_file(directory))
        return saved.get("method") or "full"

    def step_problem(self, directory: Path) -> Optional[StepProblem]:
        """Why the step folder cannot be resumed (incomplete or damaged, naming the file), or None when it is
        whole: every file the manifest records is there with its recorded size and CRC32."""
        return step_problem(directory, self.step_file(directory).name)

    def latest_step(self, out_dir: Path) -> Optional[Path]:
        """The newest intact step checkpoint in `out_dir`, verified newest first: a step that is incomplete (its
        save was cut off) or damaged is skipped with one line naming it and the step resumed from instead."""
        out_dir = location(out_dir)
        found: Any = None
        if self.fabric.global_rank == 0:  # every process must resume from the same step: rank 0 decides
            steps = []
            if out_dir.is_dir():
                steps = [(int(m.group(1)), d) for d in out_dir.iterdir() if (m := STEP_DIR.match(d.name))]
            try:
                chosen = newest_intact(steps, self.step_problem, out_dir)
                found = ("ok", None if chosen is None else str(chosen))
            except LitError as e:  # told to every process: none may wait for a step that will not come
                found = ("error", str(e))
        if self.fabric.world_size > 1:
            found = self.fabric.broadcast(found, src=0)
        if found[0] == "error":
            raise LitError(found[1])
        return None if found[1] is None else location(found[1])

    def export_final(
        self,
        step: Path,
        final: Path,
        model: nn.Module,
        method: str,
        save_filter: Optional[Callable[[str, Any], bool]],
        method_config: Dict[str, Any],
        write_files: Callable[[Path], None],
        base: Optional[Dict[str, Any]] = None,
    ) -> Path:
        """`final/`: the trained weights of this run's last step, without optimizer state, in the format the
        generate recipes load (`lit_gpt.weights`: `lit_model.safetensors` for full finetuning, else
        `lit_model.METHOD.safetensors` + its JSON). Here the live model is that step's model: its full state dict
        (gathered from the FSDP shards by torch's public `get_model_state_dict`) is written by rank 0, into a
        temporary folder renamed when complete (in a bucket: uploaded with the weights file last). `base` records
        the base model it was trained from (`lit_gpt.fingerprint`)."""
        from lit_gpt.export import export_weights

        state = full_state_dict(model)
        if save_filter is not None:
            state = {k: v for k, v in state.items() if save_filter(k, v)}
        final = location(final)
        path = self.on_rank_zero(lambda: export_weights(state, final, method, method_config, write_files, base=base),
                                 final, [])
        return path if path is not None else final

    # ----------------------------------------------------------------- model
    def set_rope(self, gpt: nn.Module, length: int) -> None:
        """RoPE tables for `length` positions, built explicitly (never inside `forward`)."""
        gpt.max_seq_length = length
        if gpt.cos.device != self.device:
            gpt.reset_rope_cache(self.device)

    def setup_kv_cache(self, gpt: nn.Module, batch_size: int, length: int, dtype: Optional[torch.dtype] = None,
                       paged: Optional[Tuple[int, int]] = None) -> None:
        """A KV cache of `length` positions (and RoPE tables at least that long), unless one that fits is set.
        `paged` (blocks, block_size): a `lit_gpt.kv_cache.PagedKVCache` of that many blocks in every layer, always
        new (its block table starts empty)."""
        cache = gpt.transformer.h[0].attn.kv_cache
        if paged is None and cache is not None and cache.rows == batch_size and cache.length == length and (
            dtype is None or cache.k.dtype == dtype
        ) and not hasattr(cache, "pages"):
            return
        if gpt.rope_cache_length is None or gpt.rope_cache_length < length or gpt.cos.device != self.device:
            self.set_rope(gpt, max(length, gpt.rope_cache_length or 0))
        if paged is not None:
            allocate_paged_kv_cache(gpt, batch_size, length, *paged, device=self.device,
                                    dtype=dtype or gpt.transformer.wte.weight.dtype)
            return
        gpt.allocate_kv_cache(batch_size, length, device=self.device, dtype=dtype)

    # ----------------------------------------------------------------- generation
    @property
    def stop_check_every(self) -> int:
        """Decode steps between two host reads of the stop flag: every step on the CPU (reading is free there);
        on a GPU each read stalls the queue of kernels."""
        return 1 if self.device.type == "cpu" else 16

    def prompt_bucket(self, length: int, limit: int) -> int:
        """Padded prompt length: eager backends run the exact length."""
        return length

    def cache_length(self, bucket: int, prompt_length: int, max_new_tokens: int, limit: int) -> int:
        """KV-cache positions for a prompt padded to `bucket` positions: exactly what the request needs, so
        memory and the per-step attention stay proportional to it."""
        return max(bucket, prompt_length + max_new_tokens)

    def to_host(self, tokens: List[torch.Tensor]) -> torch.Tensor:
        """A chunk of (B,) step tokens as one (B, n) tensor (on the device here: the caller reads it)."""
        return torch.stack(tokens, dim=1)

    def inference_context(self) -> ContextManager:
        return torch.inference_mode()

    # ----------------------------------------------------------------- torch.compile
    compile_backend = "inductor"
    """The torch.compile backend of `compile_blocks` (the tests use "aot_eager": the same capture, forward and
    backward graphs without Inductor's code generation, which takes tens of seconds per graph on a small CPU)."""

    def compile_blocks(self, model: nn.Module) -> None:
        """Run the transformer blocks of the training and validation forward (`GPT.block_runner`, the forward
        without a KV cache) through one torch.compile'd function: static shapes and one whole graph per block
        (fullgraph: a graph break is an error, not a silent slowdown). Dynamo lifts each block's parameters as
        inputs, so all blocks of one kind share a graph: one compilation per padded length, train/eval mode and
        block kind, not per layer. Kinds: adapter blocks before and after `adapter_start_layer`, and a block whose
        input needs no gradient (block 0 under a frozen embedding) apart from those whose input does.
        Generation (with a KV cache) keeps the eager blocks. Compilations are counted by `compile_count`."""
        import torch._dynamo

        # the variants above add up (6 lengths x 2 modes x 2 kinds): past dynamo's default limit of 8 graphs per
        # function it would fall back to eager for the rest of the run without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        step = torch.compile(_call_block, backend=self.compile_backend, fullgraph=True, dynamic=False)

        def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       masks: Optional[Dict[Optional[int], torch.Tensor]] = None, return_routing: bool = False) -> Any:
            routing: Tuple = ()
            for block in blocks:  # packed rows: each block's document mask (by its attention window)
                x = step(block, x, cos, sin, masks[block.attn.sliding_window] if masks else None, return_routing)
                if return_routing:  # (x, the block's MoE routing), as GPT.forward's loop returns them
                    x, routed = x
                    routing += routed
            return (x, routing) if return_routing else x

        run_blocks.takes_masks = True  # type: ignore[attr-defined]
        model.block_runner = run_blocks
        self.compiles_graphs = True

    # ----------------------------------------------------------------- diagnostics
    def compile_count(self) -> int:
        """Graphs compiled so far: dynamo's count once `compile_blocks` ran; eager runs compile nothing."""
        if not self.compiles_graphs:
            return 0
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def peak_flops(self) -> Optional[float]:
        """Peak FLOP/s of one device for MFU, where Lightning knows it (GPUs; not CPUs)."""
        if self.device.type != "cuda":
            return None
        from lightning.fabric.utilities.throughput import get_available_flops

        dtype = param_dtype(str(self.fabric.strategy.precision.precision))
        try:
            return get_available_flops(self.device, dtype)
        except Exception:  # an unknown GPU model: MFU is optional
            return None

    def memory_report(self) -> Optional[str]:
        if self.device.type == "cuda":
            return f"Memory used: {torch.cuda.max_memory_allocated(self.device) / 1e9:.02f} GB (max allocated)"
        return None
