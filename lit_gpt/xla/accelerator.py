"""Choosing the PJRT device and counting its devices, for Lightning Fabric.

Lightning's `XLAAccelerator` counts TPU chips by asking the GCE metadata server, so it fails anywhere but a
Google Cloud TPU VM. `PJRTAccelerator` counts the devices the PJRT runtime really exposes, so one recipe runs on

  * TPU:  `PJRT_DEVICE=TPU` (all chips of the host; all hosts of a pod slice when launched on every worker)
  * CPU:  `PJRT_DEVICE=CPU CPU_NUM_DEVICES=8` (8 virtual XLA devices in one process: how the tests run)
  * CUDA: `PJRT_DEVICE=CUDA` (needs a CUDA build of torch_xla)

`configure_pjrt_device()` must run before torch_xla initialises its runtime (the first device query or tensor):
with `PJRT_DEVICE` unset it picks TPU when a TPU chip and libtpu are present, else CPU, and says which.
"""

import functools
import os
import sys
from typing import List, Optional, Sequence, Union

import torch
from lightning.fabric.accelerators.xla import XLAAccelerator
from lightning_utilities.core.imports import RequirementCache

from lit_gpt.utils import LitError

_KNOWN_DEVICES = ("TPU", "CPU", "CUDA")


def _tpu_chips_present() -> int:
    """TPU chips on this host's PCI bus (sysfs), without touching the runtime or the network."""
    from torch_xla._internal import tpu

    return tpu.num_available_chips()


def select_pjrt_device(accelerator: str) -> None:
    """`--accelerator` of the XLA recipes: "auto" (TPU when present, else CPU) or the PJRT device (tpu, cpu, cuda).
    Sets PJRT_DEVICE, which the XLA runtime reads once when it starts."""
    choice = str(accelerator).lower()
    if choice not in ("auto", "tpu", "cpu", "cuda", "gpu"):
        raise LitError(f"--accelerator must be auto, tpu, cpu or cuda (got {accelerator!r})")
    if choice == "auto":
        return
    device = "CUDA" if choice in ("cuda", "gpu") else choice.upper()
    current = os.environ.get("PJRT_DEVICE", "").upper()
    if "torch_xla" in sys.modules and current and current != device:
        raise LitError(f"the XLA runtime already runs on PJRT_DEVICE={current}: --accelerator {accelerator} comes too late")
    os.environ["PJRT_DEVICE"] = device


def configure_pjrt_device(verbose: bool = True) -> str:
    """Make sure `PJRT_DEVICE` is set before the XLA runtime starts, and check that the device exists.

    Returns the device type ("TPU", "CPU", "CUDA", ...). Raises `LitError` with what to do when the requested
    device is not there (e.g. `PJRT_DEVICE=TPU` on a machine without TPU chips)."""
    if not RequirementCache("torch_xla"):
        raise LitError("torch_xla is not installed: pip install torch==2.9.0 torch_xla==2.9.0 (versions must match)")
    requested = os.environ.get("PJRT_DEVICE", "").strip().upper()
    if not requested and "torch_xla" not in sys.modules:
        # importing torch_xla picks a default device itself (with only a logging warning): decide here instead
        previous = os.environ.get("PJRT_SELECT_DEFAULT_DEVICE")
        os.environ["PJRT_SELECT_DEFAULT_DEVICE"] = "0"
        try:
            import torch_xla  # noqa: F401
        finally:
            if previous is None:
                os.environ.pop("PJRT_SELECT_DEFAULT_DEVICE", None)
            else:
                os.environ["PJRT_SELECT_DEFAULT_DEVICE"] = previous
    import torch_xla

    if not requested:
        # torch_xla would pick a default itself, but only with a logging warning; decide here and say so on stdout
        if torch_xla._found_libtpu and _tpu_chips_present() > 0:
            requested = "TPU"
        else:
            requested = "CPU"
        os.environ["PJRT_DEVICE"] = requested
        if verbose:
            extra = f" with CPU_NUM_DEVICES={os.environ['CPU_NUM_DEVICES']}" if "CPU_NUM_DEVICES" in os.environ else ""
            reason = "TPU chips and libtpu found" if requested == "TPU" else "no TPU found"
            message = f"PJRT_DEVICE is not set: using PJRT_DEVICE={requested}{extra} ({reason})"
            print(message, file=sys.stderr, flush=True)
    else:
        os.environ["PJRT_DEVICE"] = requested

    base = requested.split("_")[0]
    if base == "TPU":
        if not torch_xla._found_libtpu and not os.environ.get("TPU_LIBRARY_PATH"):
            raise LitError(
                "PJRT_DEVICE=TPU but libtpu is not installed (pip install 'torch_xla[tpu]'), or this is not a TPU VM."
                " To run on the CPU instead, set PJRT_DEVICE=CPU (and CPU_NUM_DEVICES=N for N virtual devices)"
            )
        # the PCI scan can miss chips inside some containers: LIT_XLA_SKIP_TPU_CHECK=1 trusts PJRT_DEVICE instead
        if _tpu_chips_present() == 0 and os.environ.get("LIT_XLA_SKIP_TPU_CHECK") != "1":
            raise LitError(
                "PJRT_DEVICE=TPU but no TPU chip is attached to this machine. Run on a TPU VM, or set PJRT_DEVICE=CPU"
                " (and CPU_NUM_DEVICES=N for N virtual devices)"
            )
    elif base == "CUDA" and not torch.cuda.is_available():
        raise LitError("PJRT_DEVICE=CUDA but no CUDA GPU is visible. Set PJRT_DEVICE=CPU or TPU instead")
    return requested


def default_precision(
    precision: Optional[str], allowed: Sequence[str] = ("32-true", "bf16-true", "bf16-mixed"), purpose: str = "on XLA"
) -> str:
    """`precision` if it is one of `allowed`; by default bf16 weights on TPUs (their matrix units run bf16) and fp32
    elsewhere (XLA:CPU checks correctness, and fp32 makes runs comparable with the CPU recipes)."""
    if precision is None:
        return "bf16-true" if configure_pjrt_device().startswith("TPU") else "32-true"
    if precision not in allowed:
        choices = f"{', '.join(allowed[:-1])} or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise LitError(f"--precision must be {choices} {purpose} (got {precision!r})")
    return precision


@functools.lru_cache(maxsize=1)
def pjrt_device_count() -> int:
    """All devices of the PJRT runtime: every host's chips on a pod, CPU_NUM_DEVICES on the CPU."""
    configure_pjrt_device(verbose=False)
    import torch_xla.runtime as xr

    try:
        return xr.global_runtime_device_count()
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LitError(
            f"the XLA runtime could not start on PJRT_DEVICE={os.environ.get('PJRT_DEVICE')} ({first}). Check the"
            " device, or set PJRT_DEVICE=CPU"
        ) from e


def device_count_hint(n: int) -> str:
    """How to start the XLA runtime with `n` devices instead (it has to happen before the runtime starts)."""
    device = os.environ.get("PJRT_DEVICE", "").upper()
    if device.startswith("TPU"):
        if n == 1:
            return (
                "For one chip of this host, set TPU_VISIBLE_CHIPS=0 TPU_PROCESS_BOUNDS=1,1,1"
                " TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 before starting the recipe"
            )
        return f"For {n} chips, create a slice with {n} chips (or leave out --devices to use all of these)"
    if device.startswith("CUDA"):
        return f"For {n} GPUs, set CUDA_VISIBLE_DEVICES to {n} GPU indices before starting the recipe"
    return f"For {n} device(s) on the CPU, set CPU_NUM_DEVICES={n} before starting the recipe"


class PJRTAccelerator(XLAAccelerator):
    """An `XLAAccelerator` whose device count comes from the PJRT runtime, not from the GCE metadata server.

    Pass an instance: `L.Fabric(accelerator=PJRTAccelerator(), strategy=SPMDFSDPStrategy())`. Lightning's strategy
    checks (`isinstance(accelerator, XLAAccelerator)`) keep working because this is a subclass."""

    def __init__(self) -> None:
        configure_pjrt_device()
        super().__init__()

    @staticmethod
    def auto_device_count() -> int:
        return pjrt_device_count()

    @staticmethod
    def is_available() -> bool:
        try:
            return pjrt_device_count() > 0
        except LitError:
            return False

    @staticmethod
    def parse_devices(devices: Union[int, str, List[int]]) -> int:
        """`"auto"`/`-1`, or the runtime's device count: an SPMD mesh spans every device the runtime has, so no other
        number works (to use fewer, start the runtime with fewer devices; see `device_count_hint`)."""
        count = pjrt_device_count()
        if devices in ("auto", -1, "-1"):
            return count
        if isinstance(devices, (list, tuple)):
            raise LitError(f"devices={list(devices)!r}: give 'auto' or the number of devices ({count}), not a list")
        try:
            n = int(devices)
        except (TypeError, ValueError):
            raise LitError(f"devices={devices!r} is not a number of devices: use 'auto' (= {count})") from None
        if n < 1:
            raise LitError(f"devices={n}: give 'auto' or the number of devices of the XLA runtime ({count})")
        if n != count:
            raise LitError(
                f"devices={n} but the XLA runtime has {count} device(s), and an SPMD mesh spans all of them: use"
                f" --devices auto (= {count}). {device_count_hint(n)}"
            )
        return n

    @staticmethod
    def get_parallel_devices(devices: Union[int, List[int]]) -> List[torch.device]:
        n = devices if isinstance(devices, int) else len(devices)
        return [torch.device("xla", i) for i in range(n)]

    @staticmethod
    def name() -> str:
        return "pjrt"
