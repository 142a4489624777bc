"""PyTorch/XLA runtime layer: the one place for XLA specifics (TPU first, XLA:CPU for tests, CUDA via PJRT).

Recipes use this API (torch_xla is imported only when a name below is first used, so the consolidation
path works on machines without torch_xla):

Devices and Fabric (lit_gpt.xla.accelerator, lit_gpt.xla.strategy)
    configure_pjrt_device(verbose=True) -> str           PJRT_DEVICE: set it (TPU if present, else CPU) or check it
    default_precision(precision, allowed, purpose) -> str  bf16-true on TPUs, else 32-true, unless given (checked)
    make_fabric(devices="auto", precision="32-true", activation_checkpointing=False, num_slices=1,
                layer_cls=None, compile_cache_dir=None, loggers=None) -> Fabric   then fabric.launch(fn, ...)
    PJRTAccelerator(), SPMDFSDPStrategy(precision=..., activation_checkpointing=..., num_slices=...),
    SPMDPrecision("32-true" | "bf16-true" | "bf16-mixed")           usable with plain L.Fabric(...) too
    shard_batch(fabric, batch) -> batch                 CPU tensors -> devices, split along the batch dim
    get_strategy(fabric) -> SPMDFSDPStrategy            .mesh, .num_devices, .precision.param_dtype

The loops' XLA answers (lit_gpt.xla.runtime; the loops are lit_gpt.training.fit and lit_gpt.generate.generate_stream)
    XLARuntime(fabric)                                   batches over the mesh, graph cuts, sharded checkpoints, RNG

Loading (lit_gpt.xla.loader)
    load_staged(config_or_model_fn, checkpoint_path_or_paths, fabric, strict=True, progress=True,
                allow_missing=None) -> nn.Module

Sharded checkpoints (lit_gpt.xla.checkpoint; fabric.save(dir, state) / fabric.load(dir, state) call these)
    save_sharded(dir, state, filter=None) -> Path      atomic; every host writes its own shards
    load_sharded(dir, state, strict=True) -> dict      in place; returns saved values not asked for
    latest_checkpoint(out_dir) -> Optional[Path]        newest complete checkpoint on this host
    agreed_latest_checkpoint(out_dir) -> Optional[Path] the newest every host holds (what --resume auto takes)
    verify_files(dir)                                   sizes and CRC32s recorded at save time
    consolidate(dir, output_dir=None, key="model", max_shard_size="5GB") -> Path
                                                         lit_model.safetensors (+ index), streamed shard by shard
                                                         (CLI: xla/scripts/consolidate_checkpoint.py)

Hosts (lit_gpt.xla.hosts)
    check_hosts_agree(run, data)                         every host: the same arguments, data, base weights and
                                                         resume point, or the same one error line on each

Diagnostics (lit_gpt.xla.diagnostics; per-step compile counts and host-memory sampling for benchmarks and tests
are in bench/instruments.py)
    sync()                                               torch_xla.sync(): end the lazy graph here
    compile_count() -> int                               graphs compiled so far in this process
    metrics_report() -> str                              torch_xla's report, for --xla_metrics
    init_compile_cache(path)                             persistent compilation cache
"""

import importlib
from typing import Any

_EXPORTS = {
    "configure_pjrt_device": "accelerator",
    "pjrt_device_count": "accelerator",
    "default_precision": "accelerator",
    "PJRTAccelerator": "accelerator",
    "SPMDFSDPStrategy": "strategy",
    "SPMDPrecision": "strategy",
    "make_fabric": "strategy",
    "shard_batch": "strategy",
    "get_strategy": "strategy",
    "XLARuntime": "runtime",
    "load_staged": "loader",
    "save_sharded": "checkpoint",
    "load_sharded": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "agreed_latest_checkpoint": "checkpoint",
    "verify_files": "checkpoint",
    "consolidate": "consolidation",
    "is_complete": "checkpoint",
    "check_hosts_agree": "hosts",
    "sync": "diagnostics",
    "compile_count": "diagnostics",
    "metrics_report": "diagnostics",
    "init_compile_cache": "diagnostics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lit_gpt.xla' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lit_gpt.xla.{module}"), name)
