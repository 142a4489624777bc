"""What every checkpoint writer shares, once: the random-generator states it records and the folder commit that
makes a checkpoint appear complete or not at all.

    state = rng_state(device)        # Python, NumPy, torch CPU, and the device's generator (CUDA or XLA)
    set_rng_state(state, device)
    commit_folder(tmp, directory)    # rename a complete temporary folder into place
    os.chmod(path, file_mode())      # the umask's permissions, for a file a library created owner-only
"""

import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch


def rng_state(device: Optional[torch.device] = None) -> Dict[str, Any]:
    """The generators in play: Python's, NumPy's (when installed), torch's CPU generator, and the device's
    (`"cuda"` for a CUDA device, `"xla"` for an XLA one)."""
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        # as a tensor and plain numbers: checkpoints are read with weights_only=True, which refuses numpy arrays
        state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    except ImportError:  # numpy is optional for this project
        pass
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif kind == "xla":
        import torch_xla.core.xla_model as xm

        state["xla"] = int(xm.get_rng_state(device))
    return state


def set_rng_state(state: Mapping[str, Any], device: Optional[torch.device] = None) -> None:
    """Restore what `rng_state` captured; a generator the state lacks (an older checkpoint) is left as it is."""
    if "python" in state:
        random.setstate(as_tuple(state["python"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cuda" and "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], device)
    elif kind == "xla" and "xla" in state:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla"]), device)


def as_tuple(x: Any) -> Any:
    # random.setstate wants tuples all the way down; a round trip through some formats gives lists back
    return tuple(as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def file_mode() -> int:
    """The permissions a new file gets under this process's umask (0o666 & ~umask, e.g. 0o644): what `open()`
    gives the files a recipe writes. Writers that create their file owner-only (safetensors' `save_file`,
    `tempfile.mkstemp`) get these before the file is moved into place, so every file of a folder has the same."""
    try:  # Linux says it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)  # elsewhere the only way to read it is to set it (and put it back at once)
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a crash after it keeps the new name); a no-op where the OS cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_folder(tmp: Path, directory: Path, token: str = "") -> None:
    """Rename the complete folder `tmp` to `directory`; an existing `directory` is moved aside first and deleted
    after, so at every moment one complete version exists under a name that `--resume` and the loaders accept.
    `token` makes the moved-aside name unique when several hosts commit into one shared folder."""
    from lit_gpt.interrupts import deferred

    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old{'-' + token if token else ''}")
        shutil.rmtree(old, ignore_errors=True)
    with deferred():  # an interrupt between the two renames would leave neither version under the name
        if old is not None:
            os.replace(directory, old)
        os.replace(tmp, directory)
    fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
