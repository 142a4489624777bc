"""Where a run writes: a local folder or any fsspec URL (gs://bucket/run, s3://bucket/run, memory://..., file://...).

A preemptible TPU slice loses its VMs' disks with the VMs, and the hosts of a multi-host slice cannot share a
read-write disk; a bucket outlives them and every host sees it. So `--out_dir` takes a URL, and step checkpoints,
`--resume auto`, the final export, consolidation and the logs work through fsspec (via universal_pathlib, whose
`UPath` is a `pathlib`-like path for any fsspec filesystem).

Object stores have no atomic rename, so a checkpoint in a bucket is committed differently from one on a disk:
its files are written in place and the file that marks it complete is written last (`lit_checkpoint.json` for
a sharded XLA checkpoint, the weights file for a Fabric one); readers take a checkpoint only when that file is
there. Before an existing checkpoint is replaced, that file is deleted first. Local folders keep the
rename-based commit.

    out_dir = location("gs://my-bucket/run")   # UPath (gcsfs must be installed), or a pathlib.Path for a folder
    is_url(out_dir)                            # True: commit with a marker written last, never rename

Every path a user types goes through `check_path_flags` (called by `lit_gpt.utils.run_cli` for every entry point,
before it runs): a URL is accepted only by the flags its entry point declares URL-capable (`Flag(..., url="output")`
in a `lit_gpt.cli.command`, or `@takes_paths(url_outputs=...)`), and resolved here (a missing gcsfs / s3fs / adlfs
is named); anywhere else it is refused in one line, never written as a local folder named after its scheme.
"""

import dataclasses
import re
import shutil
import sys
import tempfile
import typing
import weakref
from pathlib import Path, PurePath
from typing import Any, Callable, Dict, FrozenSet, Iterable, Mapping, Optional, Sequence, Tuple, Union

from lit_gpt.errors import LitError

PathLike = Union[str, Path]

# the package that provides each common protocol (fsspec's own message names it too, less plainly)
BACKENDS = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "adl": "adlfs"}
# the first part of a local path that reads as a URL's scheme with its "//" lost ("gs:" of "gs:/bucket"; two
# letters at least: not a drive letter)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")


def is_url(path: Any) -> bool:
    """Whether `path` names a location through an fsspec URL ("proto://..."), including file:// (which then
    behaves like a bucket: no renames), rather than a plain local path."""
    return "://" in str(path)


def location(path: PathLike) -> Path:
    """A `pathlib.Path` for a local path; for a URL a `UPath` (a `pathlib.Path`-like object on its fsspec
    filesystem), with one line naming the package to install when its filesystem is missing."""
    if not is_url(path):
        first = str(path).split("/", 1)[0]
        if _SCHEME.fullmatch(first):  # never a local folder named after a scheme ("gs:/bucket" lost a "/")
            raise LitError(f"{str(path)!r} reads as a {first[:-1]}:// URL with a '/' missing: write"
                           f" {first[:-1]}://BUCKET/PATH, or give the absolute path of a local folder so named")
        return Path(path)
    from upath import UPath

    protocol = str(path).split("://", 1)[0]
    try:
        p = path if isinstance(path, UPath) else UPath(str(path))
        p.fs  # instantiates the filesystem: imports its package
    except ImportError as e:
        package = BACKENDS.get(protocol)
        what = f"the {package} package: pip install {package}" if package else f"its fsspec filesystem ({e})"
        raise LitError(f"{str(path)!r} needs {what}") from None
    except ValueError as e:  # fsspec: "Protocol not known" / "Unsupported filesystem"
        raise LitError(f"{str(path)!r}: {e}; use a local folder or a URL such as gs://bucket/run") from None
    except OSError as e:  # a filesystem that connects when made (ftp://, sftp://): host unknown or unreachable
        raise LitError(f"{str(path)!r}: cannot reach its host ({e.strerror or e}): check the host name and the"
                       " network, or use a local folder") from None
    return p


def remove(path: Path, first: Iterable[str] = ()) -> None:
    """Delete a folder (local or in a bucket) if it exists; the names in `first` (the files that mark it
    complete) go before everything else, so an interrupted delete never leaves something that looks complete."""
    if not is_url(path):
        for name in first:
            (path / name).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        return
    fs = path.fs
    for name in first:
        if fs.exists((path / name).path):
            fs.rm((path / name).path)
    if fs.exists(path.path):
        fs.rm(path.path, recursive=True)


def upload(local: Path, remote: Path, last: Iterable[str] = ()) -> None:
    """Copy every file under the local folder `local` into `remote` (a URL), keeping relative names; the files
    named in `last` (relative names) are copied after all others."""
    last = list(last)
    files = sorted(f for f in local.rglob("*") if f.is_file())
    files.sort(key=lambda f: str(f.relative_to(local)) in last)
    for f in files:
        target = remote / str(f.relative_to(local))
        remote.fs.makedirs(target.parent.path, exist_ok=True)
        remote.fs.put_file(str(f), target.path)


def write_into(remote: Path, write_files: Callable[[Path], None]) -> None:
    """`write_files(folder)` (a writer of local files, such as a run's config and tokenizer files) into the bucket
    folder `remote`: written to a local staging folder, uploaded, and the staging folder removed."""
    stage = staging_dir()
    try:
        write_files(stage)
        upload(stage, remote)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def download(remote: Path, local: Path) -> None:
    """Copy every file under `remote` (a URL) into the local folder `local`, keeping relative names."""
    fs = remote.fs
    if not fs.exists(remote.path):
        return
    base = remote.path.rstrip("/")
    for name in fs.find(base):
        rel = name[len(base):].lstrip("/")
        target = local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(name, str(target))


def staging_dir(prefix: str = "lit-gpt-") -> Path:
    """A fresh local temporary folder for files on their way to a bucket."""
    return Path(tempfile.mkdtemp(prefix=prefix))


class LogMirror:
    """Loggers write to local files (CSV appends, TensorBoard event files, W&B's offline folder), which object
    stores cannot take directly. For a URL `--out_dir` they write to a local folder that mirrors `out_dir/logs`:
    filled from the bucket when the run starts (so a resumed run on a fresh VM continues the version numbering)
    and pushed to it after every checkpoint and at the end. A mirror it made itself in the system's temporary folder
    is removed when the run ends (the mirror is dropped, or the process exits): the bucket holds the logs."""

    def __init__(self, remote: Path, local: Optional[Path] = None) -> None:
        self.remote = remote
        self.local = local or staging_dir("lit-gpt-logs-")
        if local is None:  # at garbage collection or at exit, whichever comes first (weakref.finalize runs once)
            weakref.finalize(self, shutil.rmtree, str(self.local), ignore_errors=True)
        download(remote, self.local)
        self._pushed: Dict[str, Tuple[int, int]] = self._state()  # what the bucket already holds

    def _state(self) -> Dict[str, Tuple[int, int]]:
        return {str(f.relative_to(self.local)): (f.stat().st_size, f.stat().st_mtime_ns)
                for f in self.local.rglob("*") if f.is_file()}

    def push(self) -> None:
        """Upload the files that changed since the last push (a checkpoint every few steps must not re-send
        every event file and W&B record of the run)."""
        state = self._state()
        changed = [name for name, stamp in state.items() if self._pushed.get(name) != stamp]
        for name in changed:
            target = self.remote / name
            self.remote.fs.makedirs(target.parent.path, exist_ok=True)
            self.remote.fs.put_file(str(self.local / name), target.path)
        self._pushed = state


def log_folder(out_dir: PathLike) -> "tuple[Path, Optional[LogMirror]]":
    """Where the loggers write: out_dir/logs for a local out_dir; for a URL, a local mirror of it."""
    out = location(out_dir)
    if not is_url(out):
        return out / "logs", None
    mirror = LogMirror(out / "logs")
    return mirror.local, mirror


# ---------------------------------------------------------------------------------------------------------------
# the paths users type: every entry point's path flags, checked before it runs (lit_gpt.utils.run_cli)
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PathFlags:
    """An entry point's declaration of its path flags: `urls` maps each flag that takes fsspec URLs to "input" (it is
    read) or "output" (it is written); `outputs` names the local-only flags that are written (for the advice). A
    flag of a dataclass group is named with a dot: "data.data_dir". Every other path flag takes local paths only."""

    urls: Mapping[str, str] = dataclasses.field(default_factory=dict)
    outputs: FrozenSet[str] = frozenset()

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.urls.items() if v not in ("input", "output")}
        if bad:
            raise TypeError(f"a URL flag is an 'input' or an 'output', got {bad}")


def takes_paths(url_inputs: Iterable[str] = (), url_outputs: Iterable[str] = (),
                outputs: Iterable[str] = ()) -> Callable[[Callable], Callable]:
    """Declare which flags of an entry point take URLs (read: `url_inputs`, written: `url_outputs`) and which local-only
    flags are written (`outputs`):

        @takes_paths(url_inputs=["checkpoint_dir"], url_outputs=["output_dir"])
        def setup(checkpoint_dir: str, output_dir: Optional[str] = None) -> None: ...
    """
    urls = {**{n: "input" for n in url_inputs}, **{n: "output" for n in url_outputs}}

    def mark(fn: Callable) -> Callable:
        fn.path_flags = PathFlags(urls, frozenset(outputs))  # type: ignore[attr-defined]
        return fn

    return mark


# flags written to when an entry point does not say (for the advice only: local-only either way)
_OUTPUT_NAMES = {"out_dir", "output_dir", "destination_path"}
_PATH_NAMES = {"resume", "out_dir", "output_dir", "destination_path"}
_READ_ONLY = {"http", "https"}
# the command that copies to or from each kind of bucket, and its flag for a whole folder
_COPY = {"gs": ("gcloud storage cp", "-r"), "gcs": ("gcloud storage cp", "-r"), "s3": ("aws s3 cp", "--recursive"),
         "s3a": ("aws s3 cp", "--recursive"), "az": ("azcopy copy", "--recursive"),
         "abfs": ("azcopy copy", "--recursive"), "abfss": ("azcopy copy", "--recursive")}


def check_path_flags(fn: Callable, arguments: Dict[str, Any], raw_args: Sequence[str] = ()) -> Dict[str, Any]:
    """Check every path-like argument of the entry point `fn` (top-level, and the fields of dataclass groups such as
    --data.*) before it runs, and return the arguments to call it with. A URL ("scheme://...") is refused in one
    line where `fn` does not declare the flag URL-capable (`PathFlags`; a file:// URL there becomes its local
    path); where it does, it is resolved through `location` (one line naming gcsfs / s3fs / adlfs when missing) and a
    memory:// output gets a warning (its files vanish with the process). A value such as "gs:/bucket" (a URL with a
    slash lost) or "gs:" is refused everywhere: it would be a local folder named after the scheme. `raw_args` (the
    command line) gives back a URL as typed where a `Path` annotation collapsed its "//"."""
    declared: PathFlags = getattr(fn, "path_flags", None) or PathFlags()
    hints = _type_hints(fn)
    out = dict(arguments)
    for name, value in arguments.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            group_hints = _type_hints(type(value))
            for f in dataclasses.fields(value):
                old = getattr(value, f.name)
                new = _check(f"{name}.{f.name}", group_hints.get(f.name), old, declared, raw_args)
                if new is not old:
                    setattr(value, f.name, new)
        else:
            out[name] = _check(name, hints.get(name), value, declared, raw_args)
    return out


def _check(flag: str, annotation: Any, value: Any, declared: PathFlags, raw_args: Sequence[str]) -> Any:
    if not isinstance(value, (str, PurePath)) or not _is_path_flag(flag, annotation, declared):
        return value
    text = _as_typed(value, raw_args) if isinstance(value, PurePath) else value
    kind = declared.urls.get(flag)
    if "://" not in text:
        first = text.split("/", 1)[0]
        if _SCHEME.fullmatch(first):  # "gs:/bucket" or "gs:": a URL with a "/" lost, or a folder named like one
            scheme = first[:-1]
            fix = (f"write the URL as {scheme}://BUCKET/PATH" if kind else
                   f"this flag takes a local path (a {scheme}:// URL is not supported here)")
            raise LitError(f"--{flag} {text!r} reads as a {scheme}:// URL with a '/' missing, not a folder: {fix}; for"
                           f" a local folder whose name ends in ':' give its absolute path")
        return value
    scheme = text.split("://", 1)[0].lower()
    output = kind == "output" if kind else (flag.rsplit(".", 1)[-1] in _OUTPUT_NAMES or flag in declared.outputs)
    if kind is None:
        if scheme == "file":
            return _file_url_path(flag, text, value)
        raise LitError(_local_only(flag, text, scheme, output))
    if output and scheme in _READ_ONLY:
        raise LitError(f"--{flag} cannot write to {scheme}:// URLs (read-only): give a folder or a bucket URL"
                       f" (gs://BUCKET/PATH, s3://BUCKET/PATH)")
    try:
        location(text)
    except LitError as e:
        raise LitError(f"--{flag} {e}") from None
    if output and scheme == "memory":
        print(f"warning: --{flag} {text!r} is this process's memory (memory:// is for tests): its files vanish when"
              f" the process exits; give a folder or a bucket URL for files to keep", file=sys.stderr, flush=True)
    return text  # a URL stays a string (a Path would collapse its "//")


def _local_only(flag: str, url: str, scheme: str, output: bool) -> str:
    got = f"--{flag} takes a local path (got {url!r})"
    if scheme == "memory":
        return f"{got}: memory:// exists only inside one process (for tests); give a local path"
    name = flag.rsplit(".", 1)[-1]
    folder = name.endswith("_dir") or name in _PATH_NAMES
    local = "LOCAL_FOLDER" if folder else "LOCAL_FILE"
    copy = _COPY.get(scheme)
    command = f"{copy[0]} {copy[1]}" if copy and folder else (copy[0] if copy else "")
    if output:
        then = f" ({command} {local} {url})" if copy else ""
        return f"{got}: write to a local {'folder' if folder else 'file'}, then copy that to {url}{then}"
    if scheme in _READ_ONLY:
        return f"{got}: download it to a local file first (e.g. curl -L -o LOCAL_FILE {url}), then pass that"
    how = f" ({command} {url} {local})" if copy else ""
    return f"{got}: copy it to this machine first{how}, then pass the local copy"


def _file_url_path(flag: str, url: str, value: Any) -> Any:
    """A file:// URL given to a local-only flag is the local path it names."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise LitError(f"--{flag} {url!r} names no local file (file:///ABSOLUTE/PATH does): give a local path")
    path = unquote(parts.path)
    return Path(path) if isinstance(value, PurePath) else path


def _as_typed(value: PurePath, raw_args: Sequence[str]) -> str:
    """The command-line word that became `value`: `Path("gs://b/x")` is "gs:/b/x", the word is "gs://b/x"."""
    text = str(value)
    if not _SCHEME.match(text.split("/", 1)[0]):
        return text
    for arg in raw_args:
        for word in (arg, arg.split("=", 1)[-1]):
            if "://" in word and PurePath(word) == value:
                return word
    return text


def _is_path_flag(flag: str, annotation: Any, declared: PathFlags) -> bool:
    if flag in declared.urls or flag in declared.outputs or _mentions_path(annotation):
        return True
    name = flag.rsplit(".", 1)[-1]
    return name in _PATH_NAMES or name.endswith(("_dir", "_path", "_file"))


def _mentions_path(annotation: Any) -> bool:
    if isinstance(annotation, type):
        return issubclass(annotation, PurePath)
    return any(_mentions_path(a) for a in typing.get_args(annotation))


def _type_hints(obj: Any) -> Dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # an unresolvable forward reference: the raw annotations
        return dict(getattr(obj, "__annotations__", {}) or {})
