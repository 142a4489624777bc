"""Measuring instruments of the benchmarks and the XLA tests (the library itself uses none of them).

    counter = CompileCounter(warmup_steps=2)     # per-step XLA compilations and transfers
    for step in range(steps):
        ...train step...
        counter.step()                           # warns (RecompilationWarning) if a step after warm-up compiled
    print(counter.report())

    with AnonMemorySampler() as mem:             # peak anonymous host memory (staging measurements, Linux)
        load()
    print(mem.peak - mem.start)

The bench scripts import this module as `instruments` (a script's folder is on its sys.path); the tests, with the
repository root on their path, as `bench.instruments`. The compilation counts come from torch_xla's debug metrics
(lit_gpt.xla.diagnostics): `CompileTime` samples are compilations, `TransferToDeviceTime` /
`TransferFromDeviceTime` samples are transfers.
"""

import contextlib
import os
import warnings
from typing import Callable, Dict, Iterator, List, Optional

from lit_gpt.utils import process_status_bytes
from lit_gpt.xla.diagnostics import compile_count, metric_count


class RecompilationWarning(UserWarning):
    """XLA compiled a new graph after warm-up: something in the step changes shape (or a baked-in value)."""


def transfer_counts() -> Dict[str, int]:
    """Host->device and device->host transfers so far (each `.item()`, `.cpu()`, print of a device tensor...)."""
    return {"to_device": metric_count("TransferToDeviceTime"), "from_device": metric_count("TransferFromDeviceTime")}


def _counter(name: str) -> int:
    import torch_xla.debug.metrics as met

    value = met.counter_value(name)
    return int(value) if value else 0


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
