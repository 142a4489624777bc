"""Small shared helpers: user-facing errors, checkpoint I/O, parameter counts, losses."""

import functools
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch
import torch.nn as nn

DEFAULT_CHECKPOINT_DIR = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")


class LitError(Exception):
    """An error caused by the user's input or environment. CLIs print its message on one line and exit 1."""


def cli(fn: Callable) -> Callable:
    """Wrap a recipe's entry point: a `LitError` becomes one `error: ...` line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LitError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapper


def run_cli(fn: Callable, **kwargs: Any) -> Any:
    """`jsonargparse.CLI(fn)` with `LitError`s reported as one line (exit 1)."""
    from jsonargparse import CLI

    return cli(CLI)(fn, **kwargs)


def download_command(checkpoint_dir: Path) -> str:
    parts = Path(checkpoint_dir).parts
    repo_id = "/".join(parts[-2:]) if len(parts) >= 2 else "ORG/NAME"
    return f"python scripts/download.py --repo_id {repo_id}"


def check_checkpoint_dir(checkpoint_dir: Path, filename: str = "lit_model.pth") -> Path:
    """Return `checkpoint_dir/filename`, or raise a LitError that says how to get it."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / filename
    if path.is_file():
        return path
    if not checkpoint_dir.is_dir():
        raise LitError(
            f"checkpoint directory {str(checkpoint_dir)!r} does not exist. Download and convert it with:"
            f" {download_command(checkpoint_dir)} (offline: python scripts/convert_gguf_checkpoint.py)"
        )
    hf_files = list(checkpoint_dir.glob("*.safetensors")) + list(checkpoint_dir.glob("pytorch_model*.bin"))
    if hf_files:
        raise LitError(
            f"{str(path)!r} is missing but {str(checkpoint_dir)!r} holds HF weights. Convert them with:"
            f" python scripts/convert_hf_checkpoint.py --checkpoint_dir {checkpoint_dir}"
        )
    raise LitError(
        f"{str(path)!r} not found. Download and convert the model with: {download_command(checkpoint_dir)}"
    )


def load_state_dict(path: Union[str, Path], mmap: bool = True) -> Dict[str, torch.Tensor]:
    """`torch.load` (memory-mapped, weights only) with a clear error for a missing, corrupt or truncated file."""
    path = Path(path)
    if not path.is_file():
        raise LitError(f"checkpoint file {str(path)!r} not found")
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except (RuntimeError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LitError(
            f"cannot read checkpoint {str(path)!r} (corrupt or truncated: {first}). Re-create it, e.g. by converting"
            " the model again"
        ) from e


def load_checkpoint(model: nn.Module, path: Union[str, Path], strict: bool = True, assign: bool = False) -> Any:
    state_dict = load_state_dict(path)
    state_dict = state_dict.get("model", state_dict)
    try:
        return model.load_state_dict(state_dict, strict=strict, assign=assign)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise LitError(f"checkpoint {str(path)!r} does not match the model config ({first})") from e


def save_atomic(obj: Any, path: Union[str, Path]) -> None:
    """torch.save to a temporary file, then rename: a kill mid-save never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def num_parameters(module: nn.Module, requires_grad: Optional[bool] = None) -> int:
    seen = set()
    total = 0
    for p in module.parameters():
        if id(p) in seen or (requires_grad is not None and p.requires_grad != requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def chunked_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, chunk_size: int = 128, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over non-ignored targets, computed in sequence chunks of upcast logits so the
    float32 copy of (B, T, vocab) never exists at once."""
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    if chunk_size <= 0 or logits.size(0) <= chunk_size:
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
    losses = [
        torch.nn.functional.cross_entropy(lc.float(), tc, ignore_index=ignore_index, reduction="sum")
        for lc, tc in zip(logits.split(chunk_size), targets.split(chunk_size))
    ]
    n = (targets != ignore_index).sum().clamp(min=1)
    return torch.stack(losses).sum() / n


def state_dict_without_prefix(state_dict: Mapping[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state_dict.items()}
