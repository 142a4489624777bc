"""Small shared helpers: user-facing errors, checkpoint I/O, parameter counts, losses."""

import functools
import inspect
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from lit_gpt.errors import LitError  # noqa: F401  (defined there so that every layer can raise it)

DEFAULT_CHECKPOINT_DIR = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")


class Interrupted(LitError):
    """The run was stopped by a signal (SIGINT: exit code 130, SIGTERM: 143). Its message is the whole line the CLI
    prints (no `error:` before it; "interrupted" when empty): it names the signal and what is safe (the last complete
    step, the command that resumes it). The CLI exits with `exit_code`."""

    prefix = ""

    def __init__(self, message: str = "", exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def cli(fn: Callable) -> Callable:
    """Wrap a recipe's entry point: a `LitError` becomes one `error: ...` line on stderr and exit code 1 (or the
    error's `exit_code` and `prefix`: `Interrupted`); a bare Ctrl-C (KeyboardInterrupt) becomes `interrupted` and
    exit code 130, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LitError as e:
            prefix, text = getattr(e, "prefix", "error"), str(e)
            print(f"{prefix}: {text}" if prefix and text else (text or prefix or "interrupted"), file=sys.stderr,
                  flush=True)
            sys.exit(getattr(e, "exit_code", 1))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            sys.exit(130)

    return wrapper


def run_cli(fn: Callable, **kwargs: Any) -> Any:
    """`jsonargparse.CLI(fn)` with `LitError`s reported as one line (exit 1). The argument groups' dataclass fields
    (`--train.*`, `--data.*`, `--eval.*`) show their docstrings in `--help`. Before `fn` runs, every path-like
    argument goes through the storage layer (`lit_gpt.storage.check_path_flags`): a URL given to a flag that does
    not take one, or one whose filesystem package is missing, is refused in one line."""
    from jsonargparse import CLI

    try:
        from jsonargparse import set_parsing_settings

        set_parsing_settings(docstring_parse_attribute_docstrings=True)
    except ImportError:  # jsonargparse < 4.35
        from jsonargparse import set_docstring_parse_options

        set_docstring_parse_options(attribute_docstrings=True)
    return cli(CLI)(checked_paths(fn, kwargs.get("args")), **kwargs)


def checked_paths(fn: Callable, args: Optional[Sequence[str]] = None) -> Callable:
    """`fn` with its path-like arguments checked by the storage layer before it runs (`args`: the command line,
    default sys.argv[1:], where a URL is read back as typed: a `Path` flag turns "gs://b" into "gs:/b")."""
    if not inspect.isfunction(fn):
        return fn  # a class or several functions: jsonargparse's own dispatch
    from lit_gpt.storage import check_path_flags

    raw = [str(a) for a in (sys.argv[1:] if args is None else args)]
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*a: Any, **kw: Any) -> Any:
        bound = signature.bind(*a, **kw)
        bound.arguments.update(check_path_flags(fn, dict(bound.arguments), raw))
        return fn(*bound.args, **bound.kwargs)

    return checked


def error_reason(e: BaseException) -> str:
    """What went wrong, without the file name: an OSError's own text repeats the path that the caller's message
    already names ("[Errno 21] Is a directory: 'x'"), so only its reason is kept; other errors: the first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def download_command(checkpoint_dir: Path) -> str:
    parts = Path(checkpoint_dir).parts
    repo_id = "/".join(parts[-2:]) if len(parts) >= 2 else "ORG/NAME"
    return f"python scripts/download.py --repo_id {repo_id}"



_SIZE_MISMATCH = re.compile(
    r"size mismatch for (\S+): copying a param with shape (?:torch\.Size\()?(\[[^\]]*\])\)? from checkpoint,"
    r" the shape in current model is (?:torch\.Size\()?(\[[^\]]*\])\)?"
)


def load_error_detail(error: BaseException) -> str:
    """The useful part of a `load_state_dict` RuntimeError, on one line: the first mismatching tensor with both
    shapes (and how many more mismatch), or the first missing / unexpected key; not the bare
    "Error(s) in loading state_dict for GPT:" header."""
    message = str(error)
    mismatches = _SIZE_MISMATCH.findall(message)
    if mismatches:
        name, ckpt, model = mismatches[0]
        more = f" (and {len(mismatches) - 1} more tensors)" if len(mismatches) > 1 else ""
        ckpt, model = ckpt.replace(" ", ""), model.replace(" ", "")
        return f"tensor {name} has shape {ckpt} in the checkpoint but {model} in the model{more}"
    for label in ("Missing key(s) in state_dict", "Unexpected key(s) in state_dict"):
        line = next((x for x in message.splitlines() if label in x), None)
        if line is not None:
            keys = re.findall(r'"([^"]+)"', line.split(label, 1)[1])
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            return f"{label.split(' ')[0].lower()} tensors: {shown}"
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    detail = [line for line in lines if not line.startswith("Error(s) in loading state_dict")]
    return (detail or lines or [type(error).__name__])[0]


def stale_temp_files(path: Union[str, Path]) -> list:
    """Temporary files `.NAME.tmpPID` of `path` (see `save_atomic`) left by writers that no longer run (killed
    mid-write): never complete, safe to delete. A temp file of a live process is left alone."""
    path = Path(path)
    stale = []
    if not path.parent.is_dir():
        return stale
    for tmp in path.parent.glob(f".{glob_escape(path.name)}.tmp*"):
        m = re.fullmatch(re.escape(f".{path.name}.tmp") + r"(\d+)", tmp.name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or not _process_alive(pid):
            stale.append(tmp)
    return stale


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temp_files(path: Union[str, Path]) -> None:
    for tmp in stale_temp_files(path):
        try:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink()
        except FileNotFoundError:
            pass


def save_atomic(obj: Any, path: Union[str, Path]) -> None:
    """torch.save through a temporary file and a rename: a kill mid-save never leaves a half-written file under
    the final name. On Linux the temporary file has no name at all until it is complete (O_TMPFILE), so a kill
    leaves nothing behind; elsewhere it is `.NAME.tmpPID`, and the one of a killed earlier run is removed by the
    next save of the same file."""
    write_atomic(path, lambda f: torch.save(obj, f))


def write_atomic(path: Union[str, Path], write: Callable[[Any], None]) -> None:
    """Call `write(binary_file)` on a temporary file in `path`'s folder, fsync it, then rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(path)
        fd = _open_unnamed(path.parent)
        linked = False
        if fd is not None:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                # give the complete file a (temporary) name, then move it over `path` in one step
                try:
                    _link_fd(f.fileno(), tmp)
                    linked = True
                except OSError:
                    pass  # a filesystem that makes unnamed files but cannot link them: write a named one below
        if not linked:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk, a read-only or vanished folder: one line, no partial file
        reason = write_failure(e)
        if reason is None:
            raise
        raise LitError(f"cannot write {str(path)!r}: {reason}") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def write_failure(error: BaseException) -> Optional[str]:
    """Why a write failed, if `error` is a failed write: an OSError (maybe wrapped by torch.save's writer, which
    raises RuntimeError), or torch's own "file write failed" when its C++ writer hit the error. None otherwise."""
    seen = set()
    e: Optional[BaseException] = error
    torch_writer_failed = False
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return error_reason(e)
        if isinstance(e, RuntimeError) and re.search(r"PytorchStreamWriter failed|file write failed", str(e)):
            torch_writer_failed = True
        e = e.__cause__ or e.__context__
    if torch_writer_failed:
        return "the write failed (is the disk full, or a file size limit reached?)"
    return None


def cannot_write(error: OSError, directory: Union[str, Path], name: str) -> "LitError":
    """The one line for weights that could not be written into `directory` (a full disk, a read-only folder): the
    weights file the error names (a shard, written in a staging folder first) as it would have been named there,
    else `name`."""
    named = Path(error.filename).name if isinstance(error.filename, str) else ""
    failed = named if named.endswith((".safetensors", ".json")) else name
    return LitError(f"cannot write {str(Path(directory) / failed)!r}: {error_reason(error)}")


def _link_fd(fd: int, target: Path) -> None:
    """Give the unnamed file `fd` the name `target`: linkat(2) following /proc/self/fd/FD (os.link does not
    follow that link on Linux)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, at_symlink_follow = -100, 0x400
    if libc.linkat(at_fdcwd, f"/proc/self/fd/{fd}".encode(), at_fdcwd, os.fsencode(target), at_symlink_follow) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))


def _open_unnamed(directory: Path) -> Optional[int]:
    """A file descriptor of a new file in `directory` that has no name (Linux O_TMPFILE), or None where the OS or
    filesystem does not offer that."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not Path("/proc/self/fd").is_dir():
        return None
    try:
        return os.open(directory, flag | os.O_WRONLY, 0o666)  # less the umask, as open() creates a file
    except OSError:
        return None


def write_text_atomic(path: Union[str, Path], text: str) -> None:
    """Write a text file through a temporary file and a rename (never half-written under its name)."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def copy_file_atomic(src: Union[str, Path], dst: Union[str, Path]) -> None:
    """Copy a file through a temporary file and a rename."""
    with open(src, "rb") as source:

        def copy(f: Any) -> None:
            source.seek(0)  # from the start each time (write_atomic may write a second temporary file)
            shutil.copyfileobj(source, f, 1 << 20)

        write_atomic(dst, copy)


def refuse_overwrite(directory: Union[str, Path], names: Any, overwrite: bool, fix: str) -> None:
    """Raise a LitError when `directory` already holds any of the files `names` and `overwrite` is off: a
    converter never replaces an existing checkpoint without being asked to. `fix` is the sentence that says what
    to do instead (e.g. "Pass --output_dir NEW_FOLDER, or --overwrite true to replace them")."""
    if overwrite:
        return
    directory = Path(directory)
    present = [n for n in dict.fromkeys(names) if (directory / n).exists()]
    if present:
        shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise LitError(f"{str(directory)!r} already holds {shown}: refusing to overwrite. {fix}")


def meminfo_bytes(field: str) -> Optional[int]:
    """A field of /proc/meminfo in bytes ("MemTotal", "MemAvailable": what can still be allocated without
    swapping), or None where that is unknown (not Linux)."""
    return _proc_kib_field("/proc/meminfo", field)


def process_status_bytes(field: str) -> Optional[int]:
    """A memory field of this process's /proc/self/status in bytes ("VmRSS", "RssAnon", "RssFile", "VmHWM": the
    resident high-water mark), or None where that is unknown (not Linux)."""
    return _proc_kib_field("/proc/self/status", field)


def _proc_kib_field(path: str, field: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter and buffer in `dtype`, whatever the checkpoint stored (the Hub serves bf16, the GGUF
    converter writes fp32, some files are fp16): the precision decides the dtype, not the file. Tensors already
    in `dtype` are kept as they are (memory-mapped from the file on the CPU); tied parameters stay tied."""
    converted: Dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in converted:
                converted[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = converted[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != dtype and name not in ("cos", "sin"):
                module._buffers[name] = b.to(dtype)  # the RoPE tables stay float32 (they are cast where used)


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
