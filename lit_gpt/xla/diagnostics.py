"""Is XLA compiling once? Counting compilations and host<->device transfers, and the persistent compile cache.

    counter = CompileCounter(warmup_steps=2)
    for step in range(max_steps):
        ...train step...
        counter.step()            # warns (RecompilationWarning) if a step after warm-up compiled again
    fabric.print(counter.report())
    if xla_metrics:               # the recipes' --xla_metrics flag
        fabric.print(metrics_report())

Counts come from torch_xla's debug metrics (`CompileTime` samples = compilations, `TransferToDeviceTime` /
`TransferFromDeviceTime` samples = transfers). A recompilation after warm-up means a shape or a Python value that
is baked into the graph changes between steps; run with `PT_XLA_DEBUG_LEVEL=2` to see the Python line that
caused each compilation.

`init_compile_cache(path)` turns on torch_xla's persistent compilation cache (the same as setting
`XLA_PERSISTENT_CACHE_PATH`); it must run before the first XLA computation. On TPU/GPU a second run then skips
compilation; on XLA:CPU torch_xla 2.9 writes the cache but cannot read it back (counted as
`PersistentCacheDeserializeFailure`) and recompiles, which is harmless.
"""

import contextlib
import os
import warnings
from typing import Callable, Dict, Iterator, List, Optional

from lit_gpt.utils import LitError, process_status_bytes


class RecompilationWarning(UserWarning):
    """XLA compiled a new graph after warm-up: something in the step changes shape (or a baked-in value)."""


def sync(wait: bool = False) -> None:
    """Cut the lazy graph here and run it (`torch_xla.sync`, the successor of `xm.mark_step`)."""
    import torch_xla

    torch_xla.sync(wait=wait)


def _metric_count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return int(data[0]) if data else 0


def _counter(name: str) -> int:
    import torch_xla.debug.metrics as met

    value = met.counter_value(name)
    return int(value) if value else 0


def compile_count() -> int:
    """Graphs compiled so far in this process."""
    return _metric_count("CompileTime")


def transfer_counts() -> Dict[str, int]:
    """Host->device and device->host transfers so far (each `.item()`, `.cpu()`, print of a device tensor...)."""
    return {"to_device": _metric_count("TransferToDeviceTime"), "from_device": _metric_count("TransferFromDeviceTime")}


def metrics_report() -> str:
    """torch_xla's full metrics report (what `--xla_metrics` prints)."""
    import torch_xla.debug.metrics as met

    return met.metrics_report()


class CompileCounter:
    """Per-step compilation and transfer counts, with a warning when compilations keep happening after warm-up.

    Call `step()` once at the end of every step (after the `sync`); wrap work between steps that may compile
    (saving, validation) in `with counter.pause():`. Steps before `warmup_steps` may compile
    (the first forward/backward, the first optimizer step); any later compilation is reported through `warn`
    (default: `warnings.warn(..., RecompilationWarning)`)."""

    def __init__(self, warmup_steps: int = 2, warn: Optional[Callable[[str], None]] = None) -> None:
        self.warmup_steps = warmup_steps
        self._warn = warn or (lambda msg: warnings.warn(msg, RecompilationWarning, stacklevel=3))
        self._start_compiles = compile_count()
        self._start_transfers = transfer_counts()
        self._last = self._start_compiles
        self.steps = 0
        self.per_step: List[int] = []
        self.recompiled_steps: List[int] = []
        self.paused = 0

    def step(self) -> int:
        """Close a step: returns how many graphs it compiled."""
        now = compile_count()
        new = now - self._last
        self._last = now
        self.per_step.append(new)
        if self.steps >= self.warmup_steps and new > 0:
            self.recompiled_steps.append(self.steps)
            self._warn(
                f"XLA compiled {new} new graph(s) at step {self.steps}, after {self.warmup_steps} warm-up step(s)"
                f" ({len(self.recompiled_steps)} step(s) recompiled so far): a shape or a Python value in the step"
                " changes. Run with PT_XLA_DEBUG_LEVEL=2 to see the line that causes it"
            )
        self.steps += 1
        return new

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Compilations inside this block (a checkpoint save, a validation pass) are not charged to a step."""
        before = compile_count()
        try:
            yield
        finally:
            self._last += compile_count() - before
            self.paused += compile_count() - before

    @property
    def compiles(self) -> int:
        """Compilations in steps since this counter was created (not those inside `pause()`)."""
        return compile_count() - self._start_compiles - self.paused

    @property
    def warmup_compiles(self) -> int:
        return sum(self.per_step[: self.warmup_steps])

    @property
    def recompiles(self) -> int:
        """Compilations in steps after warm-up (0 in a healthy loop)."""
        return sum(self.per_step[self.warmup_steps :])

    @property
    def transfers(self) -> Dict[str, int]:
        now = transfer_counts()
        return {k: now[k] - self._start_transfers[k] for k in now}

    def report(self) -> str:
        t = self.transfers
        line = (
            f"XLA: {self.compiles} compilation(s) in {self.steps} step(s) ({self.warmup_compiles} during"
            f" {min(self.warmup_steps, self.steps)} warm-up step(s), {self.recompiles} after"
            + (f", {self.paused} outside steps" if self.paused else "")
            + ");"
            f" transfers host->device {t['to_device']}, device->host {t['from_device']}"
        )
        names = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")
        cache = {k: _counter(k) for k in names}
        if any(cache.values()):
            line += "; persistent cache " + ", ".join(f"{k[len('PersistentCache'):]} {v}" for k, v in cache.items())
        if self.recompiled_steps:
            shown = ", ".join(map(str, self.recompiled_steps[:10]))
            line += f". Recompiled at step(s) {shown}{' ...' if len(self.recompiled_steps) > 10 else ''}"
        return line


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


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process (`RssAnon` in /proc/self/status), in bytes.

    This is the memory that counts for staging: on XLA:CPU the device buffers are anonymous memory, while pages of
    a memory-mapped checkpoint are file-backed (they show in `ru_maxrss` but the kernel can drop them)."""
    value = process_status_bytes("RssAnon")
    if value is None:
        raise RuntimeError("RssAnon is not in /proc/self/status (Linux only)")
    return value


# the sampler process: polls the parent's RssAnon until its stdin closes, then prints the peak
_SAMPLER = """
import select, sys
pid, interval = sys.argv[1], float(sys.argv[2])
def rss():
    with open("/proc/%s/status" % pid) as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0
peak = 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], interval)[0]:
    peak = max(peak, rss())
print(max(peak, rss()), flush=True)
"""


class AnonMemorySampler:
    """Samples this process's `rss_anon_bytes()` from a helper process and keeps the peak (Linux).

        with AnonMemorySampler() as mem:
            load()
        print(mem.peak - mem.start)

    A sampling thread would need the GIL, and torch_xla's host-to-device transfers hold it while they copy
    (`_global_tensor_from_cpu_shards` makes its own copy of every shard before it returns): a thread sees the
    memory only after those calls return, so it can miss the peak. The helper process reads /proc/PID/status
    every `interval` seconds whatever this process is doing."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.start = self.peak = self.end = 0

    def __enter__(self) -> "AnonMemorySampler":
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _SAMPLER, str(os.getpid()), str(self.interval)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        ready = self._proc.stdout.readline()  # it is running and samples from now on
        if ready.strip() != "ready":
            self._proc.kill()
            raise RuntimeError(f"the memory sampler process did not start (it said {ready!r})")
        self.start = self.peak = rss_anon_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._proc.communicate(input="", timeout=60)  # closing its stdin stops it
        self.end = rss_anon_bytes()  # the resident size at the end of the block: a lower bound of its peak
        self.peak = max(int(out.split()[-1]), self.start, self.end)
