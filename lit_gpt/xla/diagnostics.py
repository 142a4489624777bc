"""Is XLA compiling once? The compilation count, torch_xla's metrics report, and the persistent compile cache.

`compile_count()` is what the loops report (lit_gpt.xla.runtime.XLARuntime.compile_count); `metrics_report()` is
what the recipes' `--xla_metrics` flag prints. Counts come from torch_xla's debug metrics (`CompileTime` samples =
compilations, `TransferToDeviceTime` / `TransferFromDeviceTime` samples = transfers). A compilation count that keeps
growing means a shape or a Python value that is baked into the graph changes between steps; run with
`PT_XLA_DEBUG_LEVEL=2` to see the Python line that caused each compilation. (bench/instruments.py counts per step,
for the benchmarks and the tests.)

`init_compile_cache(path)` turns on torch_xla's persistent compilation cache (the same as setting
`XLA_PERSISTENT_CACHE_PATH`); it must run before the first XLA computation. On TPU/GPU a second run then skips
compilation; on XLA:CPU torch_xla 2.9 writes the cache but cannot read it back (counted as
`PersistentCacheDeserializeFailure`) and recompiles, which is harmless.
"""

import os
from typing import Optional

from lit_gpt.utils import LitError


def sync(wait: bool = False) -> None:
    """Cut the lazy graph here and run it (`torch_xla.sync`, the successor of `xm.mark_step`)."""
    import torch_xla

    torch_xla.sync(wait=wait)


def metric_count(name: str) -> int:
    """How many samples torch_xla's debug metric `name` holds so far in this process (0 before the first)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return int(data[0]) if data else 0


def compile_count() -> int:
    """Graphs compiled so far in this process."""
    return metric_count("CompileTime")


def metrics_report() -> str:
    """torch_xla's full metrics report (what `--xla_metrics` prints)."""
    import torch_xla.debug.metrics as met

    return met.metrics_report()


def init_compile_cache(path: Optional[str] = None, readonly: bool = False) -> Optional[str]:
    """Turn on the persistent compilation cache at `path` (or `$XLA_PERSISTENT_CACHE_PATH`). Returns the path.

    Must be called before the first XLA computation (make_fabric does it when given `compile_cache_dir`).
    `readonly=True` for all but one process when several share a cache directory."""
    path = path or os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if not path:
        return None
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if os.environ.get("XLA_PERSISTENT_CACHE_PATH") == str(path):
            return str(path)  # already configured to this directory before the runtime started
        raise LitError(
            "the XLA compilation cache must be configured before the first XLA computation: pass"
            " compile_cache_dir to make_fabric, or set XLA_PERSISTENT_CACHE_PATH before starting"
        )
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(str(path), readonly=readonly)
    return str(path)
