"""`XLARuntime`: the XLA answers to `lit_gpt.runtime.Runtime`'s questions, for the one training loop
(`lit_gpt.training.fit`) and the one generation loop (`lit_gpt.generate.generate_stream`).

Why each answer (a tracing backend compiles every distinct graph once, and a graph is distinct as soon as a shape,
an input's sharding or a Python number baked into it changes):
* placement: batches are split along their rows over the SPMD mesh (`shard_batch`); long-lived tensors (loss
  accumulator, RoPE tables, KV cache, positions, the stop flag) are built on the host and transferred with an
  explicit replicated sharding, so the first graph that uses them does not choose one that the next graph then
  sees as new. Built on the device they would be computations folded into the next graph.
* the loss runs over every (padded) position: no data-dependent shapes (`targets_only = False`).
* graph cuts: `torch_xla.sync()` after every micro-batch but the last (the optimizer step ends the last one,
  in the strategy) and after every generation step: a few graphs per padded length instead of one per
  combination of a step's lengths, and one decode graph for every token.
* gradients: one SPMD program computes the gradient of the global batch; there is nothing to average.
* prompts are padded on the host to power-of-two buckets; the KV cache is a power of two >= bucket +
  max_new_tokens, so the prefill compiles once per bucket and the decode step once per cache size.
* host reads are transfers of already computed values (`.cpu()` of each step's token), never new graphs.
* checkpoints are directories of per-host DCP shards (`lit_gpt.xla.checkpoint`), consolidated at the end.
"""

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from lit_gpt.config import next_power_of_two
from lit_gpt.runtime import Runtime, bucket_length
from lit_gpt.storage import is_url, location
from lit_gpt.utils import LitError

# bf16 peak of one chip, FLOP/s (Google Cloud TPU documentation, "system architecture" pages)
TPU_PEAK_FLOPS = {"v2": 45e12, "v3": 123e12, "v4": 275e12, "v5litepod": 197e12, "v5e": 197e12, "v5p": 459e12,
                  "v6e": 918e12}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Transfer a host tensor, replicated over all devices under SPMD.

    The explicit sharding matters: a device tensor without one is given one by the first graph that uses it
    (the partitioner's choice), and the next graph, seeing an input with another sharding, compiles again. The KV
    cache keeps its annotation through the in-place writes, so every step sees the same input shardings."""
    import torch_xla.runtime as xr

    x = t.to(device)
    if xr.is_spmd():
        import torch_xla.distributed.spmd as xs

        mesh = xs.get_global_mesh()
        if mesh is not None:
            xs.mark_sharding(x, mesh, (None,) * x.dim())
    return x


def set_rope_length(model: nn.Module, length: int) -> None:
    """RoPE tables for `length` positions, built on the host and transferred (replicated under SPMD)."""
    device = model.transformer.wte.weight.device
    model.max_seq_length = length  # bookkeeping; rebuilds the tables where the weights are: replaced below
    model.reset_rope_cache(device=torch.device("cpu"))
    model.cos, model.sin = to_device(model.cos, device), to_device(model.sin, device)


class XLARuntime(Runtime):
    name = "xla"
    compiles_graphs = True
    targets_only = False

    def _strategy(self) -> Any:
        from lit_gpt.xla.strategy import get_strategy

        return get_strategy(self.fabric)

    # ----------------------------------------------------------------- devices
    @property
    def data_parallel_size(self) -> int:
        return self._strategy().num_devices if self.fabric is not None else 1

    @property
    def local_devices(self) -> int:
        return self.data_parallel_size // max(1, self.fabric.world_size)

    @property
    def grad_scale(self) -> float:
        return 1.0

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)

    def scalar(self, value: float) -> Any:
        # a device tensor: a Python number would be a graph constant when it happens to be 0 or 1
        return to_device(torch.tensor(value, dtype=torch.float32), self.device)

    def backward_sync(self, model: nn.Module, last: bool) -> ContextManager:
        return nullcontext()  # SPMD: the partitioner places the gradient reductions

    def end_micro_batch(self, last: bool) -> None:
        if not last:  # the optimizer step ends the last micro-batch's graph (SPMDPrecision.optimizer_step)
            import torch_xla

            torch_xla.sync()

    def end_step(self) -> None:
        import torch_xla

        torch_xla.sync()

    # ----------------------------------------------------------------- RNG
    def seed(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        super().seed(seed)
        xm.set_rng_state(seed, self.device)

    # ----------------------------------------------------------------- checkpoints
    # One path: the strategy's save_checkpoint / load_checkpoint (`fabric.save` / `fabric.load` of a directory),
    # which write and read per-host DCP shards (`lit_gpt.xla.checkpoint`).
    def step_file(self, directory: Path) -> Path:
        from lit_gpt.xla.checkpoint import MARKER

        return location(directory) / MARKER

    def save_step(
        self,
        directory: Path,
        state: Dict[str, Any],
        filter: Optional[Dict[str, Callable[[str, Any], bool]]],
        write_files: Callable[[Path], None],
    ) -> Path:
        """A sharded checkpoint directory (every host writes its shards; atomic), with the run's files written
        inside before it is committed."""
        from lit_gpt.runtime import write_error

        try:
            self.fabric.strategy.save_checkpoint(directory, state, storage_options={"write_files": write_files},
                                                 filter=filter)
            return location(directory)
        except OSError as e:
            directory = location(directory)
            partials = [] if is_url(directory) else list(directory.parent.glob(f".{directory.name}.tmp-*"))
            raise write_error(directory, partials, e) from e

    def load_step(self, directory: Path, state: Dict[str, Any]) -> Dict[str, Any]:
        from torch.distributed.checkpoint.api import CheckpointException

        try:  # load_sharded checks this host's own shards (a per-host local disk holds only those)
            # strict=False: PEFT checkpoints hold the trained weights only
            return self.fabric.load(directory, state, strict=False)
        except (RuntimeError, KeyError, ValueError, CheckpointException) as e:  # DCP's is a BaseException
            reasons = [str(x) for x in getattr(e, "failures", {}).values()] or [str(e)]
            first = reasons[0].strip().splitlines()[-1] if reasons[0].strip() else type(e).__name__
            raise LitError(
                f"cannot resume from {str(directory)!r} ({first}): pass a step folder that this recipe wrote"
            ) from e

    def saved_method(self, directory: Path) -> str:
        from lit_gpt.xla.checkpoint import read_values

        return read_values(directory).get("method") or "full"

    def step_problem(self, directory: Path) -> Any:
        """Why the sharded step cannot be resumed (incomplete or damaged, naming the file), or None. With several
        hosts each may hold only its own shards (per-host disks): `load_sharded` then verifies what each reads."""
        from lit_gpt.xla.integrity import _rank_world, step_problem

        return step_problem(directory) if _rank_world()[1] == 1 else None

    def latest_step(self, out_dir: Path) -> Optional[Path]:
        # every host lists what it holds (per-host disks may differ); host 0 picks the newest step all hold
        from lit_gpt.xla.checkpoint import agreed_latest_checkpoint

        return agreed_latest_checkpoint(out_dir, pattern="step-*")

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
        """Consolidate the trained weights of `step` (this run's last step checkpoint, which holds exactly what
        the method saves) into `final/` in the format the GPU/CPU recipes write (`lit_gpt.weights`), streamed
        shard by shard. Host 0 does it; the other hosts' shards must be readable from it (shared storage: a bucket
        is one). Committed like every export (`lit_gpt.export`)."""
        from lit_gpt.export import export_final_folder
        from lit_gpt.xla.consolidation import consolidate

        path = self.on_rank_zero(
            lambda: export_final_folder(final, write_files, lambda stage: consolidate(step, stage, key="model",
                                                                                       progress=False, base=base)),
            location(final), [])
        return path if path is not None else location(final)

    # ----------------------------------------------------------------- model
    def set_rope(self, gpt: nn.Module, length: int) -> None:
        set_rope_length(gpt, length)

    def setup_kv_cache(self, gpt: nn.Module, batch_size: int, length: int, dtype: Optional[torch.dtype] = None,
                       paged: Optional[Tuple[int, int]] = None) -> None:
        """A KV cache built on the host and transferred (no device computation, hence no compilation), and RoPE
        tables of at least that length. A cache of that size is kept: positions beyond the current one are
        masked, so a previous prompt's entries are harmless. The RoPE tables only grow, so that a training loop
        that generates samples keeps its own tables (and with them its compiled graphs)."""
        from lit_gpt.kv_cache import KVCache, allocate_paged_kv_cache

        device = gpt.transformer.wte.weight.device
        dtype = dtype or gpt.transformer.wte.weight.dtype
        if gpt.rope_cache_length is None or gpt.rope_cache_length < length or gpt.cos.device != device:
            set_rope_length(gpt, length)
        if paged is not None:  # a paged cache (`paged`: blocks, block_size) is always new: its table starts empty
            allocate_paged_kv_cache(gpt, batch_size, length, *paged, device=torch.device("cpu"), dtype=dtype,
                                    place=lambda t: to_device(t, device))
            return
        cache = gpt.transformer.h[0].attn.kv_cache
        if cache is not None and cache.rows == batch_size and cache.length == length and (
            cache.k.dtype == dtype and cache.k.device == device
        ) and not hasattr(cache, "pages"):
            return
        c = gpt.config
        for block in gpt.transformer.h:
            kv = KVCache(batch_size, c.n_query_groups, length, c.head_size, device=torch.device("cpu"), dtype=dtype,
                         window=block.attn.sliding_window)
            kv.k, kv.v = to_device(kv.k, device), to_device(kv.v, device)
            block.attn.kv_cache = kv

    # ----------------------------------------------------------------- generation
    @property
    def stop_check_every(self) -> int:
        return 8

    def prompt_bucket(self, length: int, limit: int) -> int:
        return bucket_length(length, limit)

    def cache_length(self, bucket: int, prompt_length: int, max_new_tokens: int, limit: int) -> int:
        """A power of two >= bucket + max_new_tokens (at most the context): for a given max_new_tokens the cache,
        and with it the decode graph, depends on the bucket only."""
        return min(next_power_of_two(bucket + max_new_tokens), limit)

    def to_host(self, tokens: List[torch.Tensor]) -> torch.Tensor:
        # one transfer per computed token; stacking on the device would be a graph per chunk length
        return torch.stack([t.cpu() for t in tokens], dim=1)

    def inference_context(self) -> ContextManager:
        return torch.no_grad()

    # ----------------------------------------------------------------- diagnostics
    def compile_count(self) -> int:
        from lit_gpt.xla.diagnostics import compile_count

        return compile_count()

    def peak_flops(self) -> Optional[float]:
        """bf16 FLOP/s of one device when it is a known TPU, else None (then MFU is not reported)."""
        import torch_xla.runtime as xr

        if xr.device_type() != "TPU":
            return None
        try:
            from torch_xla._internal import tpu

            return TPU_PEAK_FLOPS.get(tpu.get_tpu_type().lower())
        except Exception:  # the TPU type comes from env vars or the metadata server; MFU is optional
            return None

    def memory_report(self) -> Optional[str]:
        return None
