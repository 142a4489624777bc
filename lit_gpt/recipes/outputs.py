"""Where the recipes that write results (eval/*.py, the bench scripts' --results_file, consolidation, export) put
them: the location checked before any model is loaded, and the results written so that the work is never lost.

    check_output_dir(out_dir, "--out_dir")         # before loading: a file, a folder under a file, not writable
    check_output_file(results_file, "--results_file")
    ...                                            # the work
    write_results(out_dir / "lm_eval.json", text)  # atomically; if that fails, kept in a temporary file (named)

Both checks create nothing: a run refused here leaves no empty folder behind. A URL (gs://, s3://) is left to the
storage layer (its filesystem package and credentials are checked where it is opened).
"""

import os
import tempfile
from pathlib import Path
from typing import Union

from lit_gpt.utils import LitError, write_text_atomic

PathLike = Union[str, Path]


def _is_url(path: PathLike) -> bool:
    return "://" in str(path)


def _writable_folder(folder: Path) -> bool:
    """Whether a file can be created in `folder` (a real probe: os.access says yes to root on a read-only mount of
    some filesystems); the probe file has no name (or is removed at once)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_output_dir(path: PathLike, flag: str, what: str = "the results") -> None:
    """`path` is a folder that `what` can go into, or one that can be created: not a file, not under a file, its
    nearest existing folder writable. One LitError line otherwise; nothing is created."""
    if _is_url(path):
        return
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise LitError(f"{flag} {str(path)!r} is a file, not a folder: pass a folder for {what}")
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise LitError(f"cannot write {flag} {str(path)!r}: {str(existing)!r} is a file, not a folder; pass another"
                       f" folder for {what}")
    if not _writable_folder(existing):
        where = "" if existing == path else f": {str(existing)!r}"
        raise LitError(f"cannot write {flag} {str(path)!r}{where}: permission denied or a read-only filesystem; pass"
                       f" another folder for {what}")


def check_output_file(path: PathLike, flag: str) -> None:
    """`path` is a file the results can be written to: not a folder, and its folder usable (`check_output_dir`)."""
    if _is_url(path):
        return
    path = Path(path)
    if path.is_dir():
        raise LitError(f"{flag} {str(path)!r} is a folder: pass a file name, e.g. {str(path / 'results.json')!r}")
    check_output_dir(path.parent, f"{flag}'s folder", f"{path.name}")


def write_results(path: PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (`write_text_atomic`: complete or absent). When that fails after the work
    (a full disk, the folder removed or made read-only meanwhile), the text is kept in a temporary file and the
    LitError line names it, so that the results are not lost."""
    path = Path(path)
    try:
        write_text_atomic(path, text)
        return path
    except (LitError, OSError) as e:
        failure = str(e) if isinstance(e, LitError) else f"cannot write {str(path)!r}: {e.strerror or e}"
    try:
        fd, kept = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=path.suffix or ".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise LitError(f"{failure}; the results could not be kept elsewhere either ({e.strerror or e})") from None
    raise LitError(f"{failure}; the results are kept in {kept!r}: copy them from there")
