"""What the one training loop (`lit_gpt.training.fit`) and the one generation loop (`lit_gpt.generate`) need from a
backend, and its CPU / CUDA implementation. `lit_gpt.xla.runtime.XLARuntime` is the XLA one.

The loops are written once; a `Runtime` answers the questions on which backends differ:

* placement: how a host batch reaches the devices (`place`: one device, or split over an SPMD mesh), how a
  long-lived tensor is created (`to_device`, `zeros`), and whether the loss head may take data-dependent shapes
  (`targets_only`: eager backends skip unlabelled positions, tracing backends keep every shape static);
* graph cuts: `end_micro_batch` and `end_step` (XLA ends its lazy graph there; eager backends do nothing);
* data parallelism: how many devices split the global batch (`data_parallel_size`), how many of them one
  process feeds (`local_devices`), and how gradients are combined (`grad_scale`: DDP/FSDP average over
  processes, an SPMD program computes the global gradient at once);
* collectives on host numbers (`sum_over_processes`, `gather_objects`, `broadcast_object`);
* RNG states (`rng_state` / `set_rng_state`: every generator in play on this backend);
* checkpoints: a step checkpoint is one file written by Fabric (CPU/CUDA) or a directory of per-host shards
  (XLA); both are written under a temporary name with the run's files inside and renamed when complete;
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

from lit_gpt.state import commit_folder, rng_state, set_rng_state
from lit_gpt.storage import is_url, location, remove, staging_dir, upload
from lit_gpt.utils import LitError, load_error_detail

STEP_DIR = re.compile(r"^step-(\d+)$")
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


def _call_block(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return block(x, cos, sin)


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

    @classmethod
    def on(cls, device: torch.device) -> "Runtime":
        """A one-process runtime on `device` without Fabric (for generation on a plain model)."""
        if torch.device(device).type == "xla":
            from lit_gpt.xla.runtime import XLARuntime  # noqa: the XLA layer is only imported for XLA tensors

            return XLARuntime(None, device)
        return cls(None, device)

    # ----------------------------------------------------------------- devices
    @property
    def device(self) -> torch.device:
        return self.fabric.device if self.fabric is not None else self._device

    @property
    def data_parallel_size(self) -> int:
        """Devices the global batch is split over."""
        return self.num_processes

    @property
    def local_devices(self) -> int:
        """Devices one process feeds: its batches have micro_batch_size x local_devices rows."""
        return 1

    @property
    def grad_scale(self) -> float:
        """Factor on each process's loss so that the combined gradient is the gradient of the global loss: DDP and
        FSDP average the processes' gradients."""
        return float(self.num_processes)

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

    # ----------------------------------------------------------------- collectives on host values
    @property
    def num_processes(self) -> int:
        return self.fabric.world_size if self.fabric is not None else 1

    @property
    def rank(self) -> int:
        return self.fabric.global_rank if self.fabric is not None else 0

    def sum_over_processes(self, values: Sequence[float]) -> List[float]:
        """Sum host numbers over the processes (one small collective; none with one process)."""
        if self.num_processes == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if self.device.type == "cuda":  # NCCL reduces device tensors only
            t = t.to(self.device)
        return [float(v) for v in self.fabric.all_reduce(t, reduce_op="sum").cpu()]

    def gather_objects(self, obj: Any) -> List[Any]:
        """`obj` of every process, in rank order."""
        if self.num_processes == 1:
            return [obj]
        import torch.distributed as dist

        out: List[Any] = [None] * self.num_processes
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        return self.fabric.broadcast(obj, src=0) if self.num_processes > 1 else obj

    def barrier(self) -> None:
        self.fabric.barrier()

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
    def step_file(self, directory: Path, weights_file: str) -> Path:
        """What a step checkpoint directory must hold to count as complete."""
        return location(directory) / weights_file

    def save_step(
        self,
        directory: Path,
        state: Dict[str, Any],
        filter: Optional[Dict[str, Callable[[str, Any], bool]]],
        weights_file: str,
        write_files: Callable[[Path], None],
    ) -> Path:
        """`state` (modules, optimizer, plain values) into `directory/weights_file`, with `write_files(dir)`'s
        files beside it, atomically: everything goes into `.{name}.partial` first, renamed when every process is
        done, so a killed run never leaves a half checkpoint that `--resume auto` would pick. In a bucket (no
        renames) the run's files go first and the weights file, which makes the step complete, last."""
        directory = location(directory)
        if is_url(directory):
            return self._save_step_in_bucket(directory, state, filter, weights_file, write_files)
        tmp = directory.with_name(f".{directory.name}.partial")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        try:
            self.fabric.save(tmp / weights_file, state, filter=filter)
            if self.rank == 0:
                write_files(tmp)
                commit_folder(tmp, directory)
        except OSError as e:
            raise write_error(directory, [tmp], e) from e
        self.barrier()
        return directory

    def _save_step_in_bucket(
        self,
        directory: Path,
        state: Dict[str, Any],
        filter: Optional[Dict[str, Callable[[str, Any], bool]]],
        weights_file: str,
        write_files: Callable[[Path], None],
    ) -> Path:
        # written to a local folder first (every Fabric strategy saves to a local path; FSDP only to one), then
        # uploaded with the weights file last: in a bucket that file is the commit
        stage = self.broadcast_object(str(staging_dir()) if self.rank == 0 else None)
        try:
            self.fabric.save(Path(stage) / weights_file, state, filter=filter)
            if self.rank == 0:
                write_files(Path(stage))
                remove(directory, first=[weights_file])  # an older version of this step: its weights file first
                upload(Path(stage), directory, last=[weights_file])
        except OSError as e:
            raise write_error(directory, [], e) from e
        finally:
            if self.rank == 0:
                shutil.rmtree(stage, ignore_errors=True)
        self.barrier()
        return directory

    def load_step(self, directory: Path, state: Dict[str, Any], weights_file: str) -> Dict[str, Any]:
        """Restore the modules/optimizer of `state` in place from a step checkpoint; return the other values."""
        file = self.step_file(directory, weights_file)
        try:
            if not is_url(file):
                return self.fabric.load(file, state, strict=False, weights_only=True)
            from lightning.fabric.strategies import FSDPStrategy

            if not isinstance(self.fabric.strategy, FSDPStrategy):  # Fabric reads a URL through fsspec itself
                return self.fabric.load(str(file), state, strict=False, weights_only=True)
            # FSDP loads local paths only: one copy per machine, fetched by its first process
            import hashlib
            import tempfile

            local = Path(tempfile.gettempdir()) / f"lit-gpt-resume-{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
            if self.fabric.local_rank == 0:
                local.mkdir(parents=True, exist_ok=True)
                file.fs.get_file(file.path, str(local / weights_file))
            self.barrier()
            try:
                return self.fabric.load(local / weights_file, state, strict=False, weights_only=True)
            finally:
                self.barrier()
                if self.fabric.local_rank == 0:
                    shutil.rmtree(local, ignore_errors=True)
        except (RuntimeError, KeyError, ValueError) as e:
            raise LitError(
                f"cannot resume from {str(file)!r} ({load_error_detail(e)}): pass a step folder that this recipe wrote"
            ) from e

    def saved_method(self, directory: Path, weights_file: str) -> str:
        """The method that wrote a step checkpoint ("full" when it records none), read before loading it."""
        from lit_gpt.utils import load_state_dict

        saved = load_state_dict(self.step_file(directory, weights_file))
        return saved.get("method") or "full"

    def latest_step(self, out_dir: Path, weights_file: str) -> Optional[Path]:
        """The newest complete step checkpoint in `out_dir` (partial ones have another name; in a bucket, a step
        without its weights file is incomplete)."""
        best: Optional[Tuple[int, Path]] = None
        out_dir = location(out_dir)
        if out_dir.is_dir():
            for d in out_dir.iterdir():
                m = STEP_DIR.match(d.name)
                if m and self.step_file(d, weights_file).is_file() and (best is None or int(m.group(1)) > best[0]):
                    best = (int(m.group(1)), d)
        found = None if best is None else str(best[1])
        # every process must resume from the same step: rank 0's view decides (all see one out_dir here)
        found = self.broadcast_object(found)
        return None if found is None else location(found)

    def export_final(
        self,
        step: Path,
        final: Path,
        model: nn.Module,
        state: Dict[str, Any],
        filter: Optional[Dict[str, Callable[[str, Any], bool]]],
        weights_file: str,
        write_files: Callable[[Path], None],
    ) -> Path:
        """`final/weights_file`: the trained weights of this run's last step, without optimizer state, in the
        format the generate recipes load. Here the live model is that step's model: it is written directly."""
        self.save_step(final, state, filter, weights_file, write_files)
        return location(final) / weights_file

    # ----------------------------------------------------------------- model
    def set_rope(self, gpt: nn.Module, length: int) -> None:
        """RoPE tables for `length` positions, built explicitly (never inside `forward`)."""
        gpt.max_seq_length = length
        if gpt.cos.device != self.device:
            gpt.reset_rope_cache(self.device)

    def setup_kv_cache(self, gpt: nn.Module, batch_size: int, length: int, dtype: Optional[torch.dtype] = None) -> None:
        """A KV cache of `length` positions (and RoPE tables at least that long), unless one that fits is set."""
        cache = gpt.transformer.h[0].attn.kv_cache
        if cache is not None and cache.k.size(0) == batch_size and cache.k.size(2) == length and (
            dtype is None or cache.k.dtype == dtype
        ):
            return
        if gpt.rope_cache_length is None or gpt.rope_cache_length < length or gpt.cos.device != self.device:
            self.set_rope(gpt, max(length, gpt.rope_cache_length or 0))
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

        def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            for block in blocks:
                x = step(block, x, cos, sin)
            return x

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
