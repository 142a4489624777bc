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
    Slice(...)                                             one slice's create / delete / ssh commands; .status()
                                                           -> Status(READY, PENDING, LOST or MISSING, detail)
The detached job on the workers (nohup + setsid; ~/.lit-gpt-babysit/NAME/{pid,log,exit,heartbeat.json})
    launch_script / status_script / stop_script / collect_script(job, ...)   bash for `ssh --worker=all --command`,
                                                           one `LITBS WORKER ...` line per worker
    launched(out), parse_workers(out) -> {worker: Worker}  what those lines say
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

import base64
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
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

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


# What `describe` reports, reduced to what the babysitter does about it.
READY = "ready"  # usable: run on it
PENDING = "pending"  # on its way to READY (queued, provisioning, creating): wait
LOST = "lost"  # preempted, terminated, unhealthy, failed, being deleted: delete and create again
MISSING = "missing"  # does not exist: create it


class Status(NamedTuple):
    kind: str  # READY, PENDING, LOST or MISSING
    detail: str  # what gcloud said, for the log ("PREEMPTED", "queued WAITING_FOR_RESOURCES", ...)


class Slice:
    """One TPU slice and the gcloud commands that manage it: a TPU VM node, or a queued resource owning one."""

    def __init__(self, gcloud: Gcloud, name: str, zone: str, accelerator_type: str, version: str, spot: bool,
                 preemptible: bool, queued: bool, best_effort: bool, queued_resource: Optional[str],
                 project: Optional[str], create_flags: List[str]) -> None:
        self.gcloud, self.name, self.zone = gcloud, name, zone
        self.accelerator_type, self.version = accelerator_type, version
        self.spot, self.preemptible, self.queued, self.best_effort = spot, preemptible, queued, best_effort
        self.queued_resource = queued_resource or name
        self.project, self.create_flags = project, create_flags

    # -- commands --------------------------------------------------------------------------------------------
    def _cmd(self, *args: str) -> List[str]:
        return [self.gcloud.path, *args, *(["--project", self.project] if self.project else [])]

    def create_cmd(self) -> List[str]:
        if self.queued:
            # --best-effort exists only in the alpha track of queued-resources create
            track = ["alpha"] if self.best_effort else []
            tier = ["--spot"] if self.spot else ["--best-effort"] if self.best_effort else []
            return self._cmd(*track, "compute", "tpus", "queued-resources", "create", self.queued_resource,
                             "--node-id", self.name, "--zone", self.zone, "--accelerator-type", self.accelerator_type,
                             "--runtime-version", self.version, *tier, *self.create_flags)
        tier = ["--spot"] if self.spot else ["--preemptible"] if self.preemptible else []
        return self._cmd("compute", "tpus", "tpu-vm", "create", self.name, "--zone", self.zone,
                         "--accelerator-type", self.accelerator_type, "--version", self.version, *tier,
                         *self.create_flags)

    def delete_cmd(self) -> List[str]:
        if self.queued:
            # --force deletes the queued resource's node first; --quiet: no confirmation prompt
            return self._cmd("compute", "tpus", "queued-resources", "delete", self.queued_resource, "--zone",
                             self.zone, "--force", "--quiet")
        return self._cmd("compute", "tpus", "tpu-vm", "delete", self.name, "--zone", self.zone, "--quiet")

    def ssh_cmd(self, command: str) -> List[str]:
        return self._cmd("compute", "tpus", "tpu-vm", "ssh", self.name, "--zone", self.zone, "--worker=all",
                         "--command", command)

    # -- state -----------------------------------------------------------------------------------------------
    def _describe(self, kind: str, name: str, retries: Optional[int]) -> Optional[Tuple[str, str]]:
        return self.gcloud.query(self._cmd("compute", "tpus", kind, "describe", name, "--zone", self.zone, "--format",
                                           "json"), lambda out: parse_state(out, kind == "queued-resources"), retries)

    def status(self, retries: Optional[int] = None) -> Status:
        if self.queued:
            qr = self._describe("queued-resources", self.queued_resource, retries)
            if qr is None:
                return Status(MISSING, "no queued resource")
            if qr[0] in QUEUED_PENDING:
                return Status(PENDING, f"queued resource {qr[0]}")
            if qr[0] != "ACTIVE":
                return Status(LOST, f"queued resource {qr[0]}")
        node = self._describe("tpu-vm", self.name, retries)
        if node is None:
            # an ACTIVE queued resource whose node is gone lost its slice
            return Status(LOST if self.queued else MISSING, "no TPU VM")
        state, health = node
        if state == "READY" and health not in NODE_UNHEALTHY:
            return Status(READY, "READY" + (f" {health}" if health else ""))
        if state in NODE_PENDING:
            return Status(PENDING, state)
        return Status(LOST, f"{state} {health}".strip())


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



# ---------------------------------------------------------------------------------------------------------------
# the detached job on the workers: nohup + setsid, a pid file, an exit-code file and a log per worker, all in
# ~/.lit-gpt-babysit/JOB on each worker. The ssh session that starts it returns at once; later sessions read its
# state (and the heartbeat the training loop writes there, lit_gpt/heartbeat.py), and stop it. Closing the
# babysitter's terminal or losing its connection leaves the job running; a new babysitter re-attaches (--attach).
# Every script prints one `LITBS` line per worker, so gcloud's interleaving of the workers' output is harmless.
# ---------------------------------------------------------------------------------------------------------------
JOB_ROOT = ".lit-gpt-babysit"
# the worker's number: TPU_WORKER_ID where set, else the TPU VM's metadata (what torch_xla reads), else the host name
_PRELUDE = """d="$HOME/{root}/{job}"
w="$(cat "$d/worker" 2>/dev/null || true)"
[ -n "$w" ] || w="${{TPU_WORKER_ID:-$(curl -sf -m 2 -H 'Metadata-Flavor: Google' \\
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number 2>/dev/null \\
  || hostname)}}"
# a process (or, with -g, a process group) that runs: `kill -0` would also count a zombie not reaped yet
alive() {{ ps -o stat= "$@" 2>/dev/null | grep -qv '^Z'; }}
"""
# the job itself, started by `nohup setsid`: its pid is its process group's (the stop script kills the group)
_WRAPPER = """d="$1"; cd "$2" || exit 1
echo $$ > "$d/pid.tmp" && mv "$d/pid.tmp" "$d/pid"
export LIT_GPT_HEARTBEAT="$d/heartbeat.json"
echo "==== $(date -u '+%Y-%m-%d %H:%M:%S') UTC: started by xla/scripts/babysit.py ====" >> "$d/log"
dest="${3:+$3/logs/babysit/worker-$(cat "$d/worker").log}"
upload() { [ -z "$dest" ] || gcloud storage cp -q "$d/log" "$dest" > /dev/null 2>&1 || true; }
if [ -n "$dest" ]; then (while sleep 60; do upload; done) & up=$!; fi
bash "$d/command.sh" >> "$d/log" 2>&1 < /dev/null
code=$?
# the copying loop and its `sleep` (which would otherwise outlive the job by up to a minute), then the last copy
if [ -n "$dest" ]; then kill "$up" $(pgrep -P "$up") 2>/dev/null; upload; fi
echo "$code" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
"""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def launch_script(job: str, command: str, log_url: str = "") -> str:
    """Start `command` detached on a worker unless its job runs already; prints `LITBS W launched PID LOGSIZE` (the
    log's size before this run) or `LITBS W already-running PID`. `log_url`: a bucket folder that gets a copy of
    each worker's log (every minute and at the end)."""
    return _PRELUDE.format(root=JOB_ROOT, job=job) + f"""mkdir -p "$d"; echo "$w" > "$d/worker"
if [ -f "$d/pid" ] && [ ! -f "$d/exit" ] && [ ! -f "$d/stopped" ] && alive -p "$(cat "$d/pid")"; then
  echo "LITBS $w already-running $(cat "$d/pid")"; exit 0
fi
rm -f "$d/pid" "$d/exit" "$d/stopped" "$d/heartbeat.json"
echo {_b64(command)} | base64 -d > "$d/command.sh"
echo {_b64(_WRAPPER)} | base64 -d > "$d/job.sh"
size=$(stat -c %s "$d/log" 2>/dev/null || echo 0)
nohup setsid bash "$d/job.sh" "$d" "$PWD" {shlex.quote(log_url)} < /dev/null > /dev/null 2>&1 &
for i in $(seq 100); do [ -s "$d/pid" ] && break; sleep 0.1; done
echo "LITBS $w launched $(cat "$d/pid" 2>/dev/null || echo -) $size"
"""


def status_script(job: str, offset: int, limit: int = 1 << 20) -> str:
    """One line per worker: `LITBS W STATE DETAIL LOGSIZE HEARTBEAT LOG`: STATE none (no job), running (DETAIL: the
    pid), exited (DETAIL: the exit code), stopped (by the stop script) or vanished (gone without an exit code:
    killed, or the VM restarted); HEARTBEAT the heartbeat file, LOG worker 0's log from byte `offset` (at most
    `limit` bytes), both base64 ("-": none)."""
    return _PRELUDE.format(root=JOB_ROOT, job=job) + f"""if [ ! -f "$d/pid" ]; then st=none; x=-
elif [ -f "$d/stopped" ]; then st=stopped; x=-
elif [ -f "$d/exit" ]; then st=exited; x=$(cat "$d/exit")
elif alive -p "$(cat "$d/pid")"; then st=running; x=$(cat "$d/pid")
elif [ -f "$d/exit" ]; then st=exited; x=$(cat "$d/exit")  # it ended between the two checks above
else st=vanished; x=-; fi
size=$(stat -c %s "$d/log" 2>/dev/null || echo 0)
hb=$(base64 -w0 2>/dev/null < "$d/heartbeat.json"); hb=${{hb:--}}
log=-
if [ "$w" = 0 ] && [ "$size" -gt {int(offset)} ]; then
  log=$(tail -c +{int(offset) + 1} "$d/log" | head -c {limit} | base64 -w0)
fi
echo "LITBS $w $st $x $size $hb ${{log:--}}"
"""


def stop_script(job: str) -> str:
    """Stop the job's whole process group on every worker (SIGTERM, up to 10 s, then SIGKILL); `LITBS W stopped`."""
    return _PRELUDE.format(root=JOB_ROOT, job=job) + """if [ -f "$d/pid" ] && [ ! -f "$d/exit" ]; then
  p=$(cat "$d/pid"); touch "$d/stopped"
  kill -TERM -- "-$p" 2>/dev/null
  for i in $(seq 50); do alive -g "$p" || break; sleep 0.2; done
  kill -KILL -- "-$p" 2>/dev/null
fi
echo "LITBS $w stopped"
"""


def collect_script(job: str, lines: int = 20) -> str:
    """Each worker's last log lines and, where py-spy is installed, the Python stacks of its job's Python processes
    (`[worker W stack]`), prefixed with `[worker W]`: what the babysitter shows before it stops a stalled or failed
    job. Without py-spy the log lines are all there is, and one line says so and how to get stacks next time."""
    return _PRELUDE.format(root=JOB_ROOT, job=job) + f"""echo "LITBS $w collected"
tail -n {int(lines)} "$d/log" 2>/dev/null | sed "s/^/[worker $w] /"
if ! command -v py-spy > /dev/null; then
  echo "[worker $w] no Python stacks: py-spy is not installed on this worker" \
    "(add pip install py-spy to the setup script)"
elif [ -f "$d/pid" ]; then
  for p in $(pgrep -g "$(cat "$d/pid")" python); do
    (py-spy dump --pid "$p" 2>&1 || sudo -n py-spy dump --pid "$p" 2>&1) | sed "s/^/[worker $w stack] /"
  done
fi
"""


@dataclass
class Worker:
    """One worker's line of `status_script`."""

    state: str
    detail: str
    log_size: int
    heartbeat: str  # the heartbeat file's text ("" when none)
    log: bytes  # worker 0's new log bytes


def parse_workers(out: str) -> Dict[str, Worker]:
    """The workers' `LITBS` lines of `status_script`; anything without one raises ValueError."""
    found: Dict[str, Worker] = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) != 7 or words[0] != "LITBS":
            continue
        w, state, detail, size, hb, log = words[1:]
        found[w] = Worker(state, detail, int(size),
                          "" if hb == "-" else base64.b64decode(hb).decode("utf-8", "replace").strip(),
                          b"" if log == "-" else base64.b64decode(log))
    if not found:
        raise ValueError(out)
    return found


def launched(out: str) -> Dict[str, Tuple[str, int]]:
    """{worker: ("launched" or "already-running", log size before the run)} from `launch_script`'s lines."""
    found = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 4 and words[0] == "LITBS" and words[2] in ("launched", "already-running"):
            found[words[1]] = (words[2], int(words[4]) if len(words) > 4 and words[4].isdigit() else 0)
    if not found:
        raise ValueError(out)
    return found


def out_dir_of(command: str) -> Optional[str]:
    """The command's --out_dir (the last one given), or None."""
    words = shlex.split(command)
    found = None
    for i, word in enumerate(words):
        if word == "--out_dir" and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith("--out_dir="):
            found = word.split("=", 1)[1]
    return found
