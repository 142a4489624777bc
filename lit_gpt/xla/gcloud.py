"""The babysitter's gcloud layer (xla/scripts/babysit.py; xla/README.md, "Preemptible slices: the babysitter"):
running the Google Cloud CLI without ever hanging on it, reading what it reports, and the checks of everything that
reaches it, made before the first call. It imports neither torch_xla nor torch itself: the babysitter runs on a
machine that only drives gcloud.

    runner = Gcloud(find_gcloud(None), timeout=300, long_timeout=1800, retries=4, backoff=5)
    state, health = runner.query([runner.path, "compute", "tpus", "tpu-vm", "describe", "my-tpu", "--zone",
                                  "us-central2-b", "--format", "json"], lambda out: parse_state(out, queued=False))

Calls
    Gcloud(path, timeout, long_timeout, retries, backoff)   .once(cmd, timeout): one call, its process group killed
                                                           past `timeout`; .query(cmd, parse): retried with backoff,
                                                           then one LitError line; .shown(cmd): as a user types it
    kill_group(proc)                                       SIGKILL a call's process group and reap it
    parse_state(out, queued) -> (state, health)            from `describe --format json`; anything else raises
Checks (one LitError line each)
    find_gcloud(path_or_none) -> str                       --gcloud, or `gcloud` on PATH: an executable file
    check_names(args)                                      --name, --zone, ... against Google Cloud's naming rules
    split_create_flags(text) -> list                       --create_flags, without the flags the babysitter sets
    check_bash(text, what)                                 `bash -n` here, before a slice is paid for
    read_setup(path) -> str                                the setup script: readable UTF-8 text, valid bash
Messages
    log(message)                                           one timestamped `[babysit ...]` line on stderr
    short(text), last_line(text), not_found(stderr)        what of gcloud's output goes into a message
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from lit_gpt.utils import LitError, error_reason

# TPU node states (tpu.googleapis.com v2 Node.State) before READY; any other that is not READY (PREEMPTED,
# TERMINATED, REPAIRING, STOPPED, DELETING, UNKNOWN, ...) means the workers are gone or unusable.
NODE_PENDING = {"CREATING", "STARTING", "RESTARTING"}
# Node.Health values of an unreachable or maintained worker (HEALTH_UNSPECIFIED / empty: not reported yet)
NODE_UNHEALTHY = {"TIMEOUT", "UNHEALTHY_TENSORFLOW", "UNHEALTHY_MAINTENANCE", "DEPRECATED_UNHEALTHY"}
# QueuedResourceState values before ACTIVE; FAILED / SUSPENDING / SUSPENDED (preempted spot) / DELETING are LOST
QUEUED_PENDING = {"CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING"}
# gcloud errors that another attempt cannot fix (a typo in a flag, no permission): creation stops at once
FATAL_CREATE_ERRORS = ("INVALID_ARGUMENT", "PERMISSION_DENIED", "UNAUTHENTICATED", "unrecognized arguments")
# what the names must look like (Google Cloud's naming rules), with an example
NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
PATTERNS = {"name": (NAME, "my-tpu"), "zone": (re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]"), "us-central2-b"),
            "accelerator_type": (re.compile(r"[a-z][a-z0-9]*-[0-9]+"), "v4-32, v5litepod-16 or v6e-8"),
            "version": (re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*"), "tpu-ubuntu2204-base"),
            "queued_resource": (NAME, "my-request"),
            "project": (re.compile(r"([a-z][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]"), "my-project")}
# create flags the babysitter sets itself from its own arguments
OWN_CREATE_FLAGS = {"--zone", "--accelerator-type", "--version", "--runtime-version", "--spot", "--preemptible",
                    "--best-effort", "--node-id", "--project", "--format", "--async"}


def log(message: str) -> None:
    """One timestamped line on stderr (the workers' output goes to stdout)."""
    print(f"[babysit {datetime.now():%Y-%m-%d %H:%M:%S}] {message}", file=sys.stderr, flush=True)


def short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def not_found(stderr: str) -> bool:
    return "NOT_FOUND" in stderr or "was not found" in stderr


def check_bash(text: str, what: str) -> None:
    """Refuse what bash cannot parse (`bash -n`) here, before a slice is paid for to find out there."""
    bash = shutil.which("bash")
    try:
        proc = bash and subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, errors="replace",
                                       timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return
    if proc and proc.returncode != 0:
        raise LitError(f"{what} is not valid bash: {short(last_line(proc.stderr))}")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child's whole process group (gcloud runs helpers of its own) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError):  # a process outside the group holds its pipes: stop reading
        pass


@dataclass
class Gcloud:
    """How gcloud is run: the program, how long one call may take and how often a failed query is tried again."""

    path: str
    timeout: float  # one state query (--gcloud_timeout)
    long_timeout: float  # one create or delete, which waits for the operation (--create_timeout)
    retries: int
    backoff: float

    def once(self, cmd: List[str], timeout: float) -> Tuple[Optional[int], str, str]:
        """One call in a process group of its own: (exit code, stdout, stderr); the exit code is None when it ran
        past `timeout` seconds: then the whole group is killed, so a hung call never stalls the babysitter."""
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    encoding="utf-8", errors="replace", start_new_session=True)
        except OSError as e:
            raise LitError(f"cannot run {cmd[0]}: {error_reason(e)}; pass --gcloud with the Google Cloud CLI's"
                           " path (https://cloud.google.com/sdk/docs/install)") from None
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as e:  # past its time, or Ctrl-C while waiting: take the call down too
            kill_group(proc)
            if isinstance(e, subprocess.TimeoutExpired):
                return None, "", ""
            raise
        return proc.returncode, out, err

    def shown(self, cmd: List[str]) -> str:
        """A call as a user would type it (`gcloud ...`), for the messages."""
        return shlex.join(["gcloud", *cmd[1:]])

    def query(self, cmd: List[str], parse: Callable[[str], Any], retries: Optional[int] = None) -> Any:
        """A read-only call's parsed output, or None when gcloud says the resource does not exist. A call that times
        out, fails or prints what `parse` cannot read is tried again with exponential backoff, then reported in
        one line: without knowing the state nothing may be created or deleted."""
        retries, delay = self.retries if retries is None else retries, self.backoff
        for attempt in range(retries + 1):
            code, out, err = self.once(cmd, self.timeout)
            if code == 0:
                try:
                    return parse(out)
                except (ValueError, TypeError, KeyError, AttributeError):
                    shown = repr(short(out, 120)) if out.strip() else "nothing"
                    problem, hint = f"printed {shown}, not the JSON it should", f"is {self.path} the Google Cloud CLI?"
            elif code is None:
                problem, hint = f"timed out after {self.timeout:g} s", "raise --gcloud_timeout if gcloud is this slow"
            elif not_found(err):
                return None
            else:
                problem, hint = f"failed with exit code {code}: {short(last_line(err))}", "run it by hand to see why"
            if attempt < retries:
                log(f"`{self.shown(cmd)}` {problem}; trying again in {delay:g} s ({attempt + 1}/{retries})")
                time.sleep(delay)
                delay *= 2
        raise LitError(f"`{self.shown(cmd)}` {problem} ({retries + 1} tries): {hint}")


def parse_state(out: str, queued: bool) -> Tuple[str, str]:
    """(state, health) from `describe --format json` (a queued resource's state is `{"state": "ACTIVE"}`, and it
    has no health); anything else raises."""
    found = json.loads(out)
    state, health = found["state"], found.get("health") or ""
    state = state["state"] if queued and isinstance(state, dict) else state
    if not (isinstance(state, str) and state and isinstance(health, str)):
        raise ValueError(out)
    return state, health


def find_gcloud(gcloud: Optional[str]) -> str:
    """The gcloud program: --gcloud, or the first `gcloud` on PATH; it must be an executable file."""
    if gcloud is None:
        found = shutil.which("gcloud")
        if found is not None:
            return found
        dirs = [Path(d, "gcloud") for d in os.environ.get("PATH", "").split(os.pathsep) if d]
        gcloud = next((str(p) for p in dirs if p.is_file()), None)
        if gcloud is None:
            raise LitError("gcloud is not on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/"
                           "install) or pass its path with --gcloud")
    path = Path(gcloud if os.sep in gcloud else shutil.which(gcloud) or gcloud).expanduser()  # a path, or a name
    if not path.is_file():
        raise LitError(f"--gcloud {gcloud!r} is not a file: give the path of the Google Cloud CLI's gcloud")
    if not os.access(path, os.X_OK):
        raise LitError(f"{gcloud} is not executable: chmod +x it, or pass another gcloud with --gcloud")
    return str(path.resolve())


def check_names(args: Dict[str, Any]) -> None:
    """Refuse a name, zone, type, version or project (babysit()'s `args`) that breaks Google Cloud's naming rules."""
    for flag, (pattern, example) in PATTERNS.items():
        if args[flag] is not None and not pattern.fullmatch(args[flag]):
            rule = " (lowercase letters, digits and hyphens, from a letter, at most 63)" if pattern is NAME else ""
            raise LitError(f"--{flag} {args[flag]!r} is not a valid value{rule}: give one like {example}")


def split_create_flags(create_flags: str) -> List[str]:
    """--create_flags split like a shell would, refusing the flags the babysitter sets itself."""
    try:
        flags = shlex.split(create_flags)
    except ValueError as e:
        raise LitError(f"--create_flags is not a valid shell line ({e}): {create_flags!r}") from None
    own = sorted({f.split("=", 1)[0] for f in flags} & OWN_CREATE_FLAGS)
    if own:
        raise LitError(f"--create_flags sets {', '.join(own)}, which the babysitter sets itself from its own"
                       " arguments: use those (--zone, --accelerator_type, --version, --spot, ...) instead")
    return flags


def read_setup(setup_script: Path) -> str:
    """The setup script's text: a readable bash script, or one line that says why not."""
    try:
        text = Path(setup_script).read_bytes().decode("utf-8")
    except OSError as e:
        raise LitError(f"cannot read the setup script {str(setup_script)!r}: {error_reason(e)}") from None
    except UnicodeDecodeError:
        raise LitError(f"the setup script {str(setup_script)!r} is not a text file: give a bash script") from None
    check_bash(text, f"the setup script {str(setup_script)!r}")
    return text

