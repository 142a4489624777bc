"""Keep a training run going on a preemptible (spot) TPU slice until it finishes.

    python xla/scripts/babysit.py --name my-tpu --zone us-central2-b --accelerator_type v4-32 \\
        --version tpu-ubuntu2204-base --spot true --setup_script setup.sh -- \\
        "cd lit-gpt-xla && python xla/finetune/lora.py --out_dir /mnt/gcs/out/lora --train.save_interval 100"

It creates the slice with the `gcloud` CLI (`tpu-vm create`, or `queued-resources create` with `--queued true`),
runs the setup script and then the training command on every worker (`tpu-vm ssh --worker=all`), with
`--resume auto` appended when the command has no `--resume`, and watches the slice's state while it runs. When the
slice is preempted, terminated, gone or unhealthy (a lost worker), it deletes the slice, creates it again, runs the
setup script and the command again (which continues from its newest complete checkpoint), until the command exits 0
or `--max_restarts` is used up. A failed creation (no capacity) is retried after `--create_retry_delay` seconds. A
command that fails while the slice is healthy is the command's own error: the babysitter stops at once with the
command's exit code. Ctrl-C stops watching and deletes nothing (unless `--delete_on_interrupt true`).

The command after `--` is one shell command line run on every worker: one argument is taken as written (quote it
as above), several are joined with shell quoting. `--out_dir` must be storage that outlives the VMs (a bucket):
a preemption erases the VMs' disks.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import List, Optional, Tuple

from lit_gpt.utils import LitError, run_cli

# What `describe` reports, reduced to what the babysitter does about it.
READY = "ready"  # usable: run on it
PENDING = "pending"  # on its way to READY (queued, provisioning, creating): wait
LOST = "lost"  # preempted, terminated, unhealthy, failed, being deleted: delete and create again
MISSING = "missing"  # does not exist: create it

# TPU node states (tpu.googleapis.com v2 Node.State) that come before READY; every other one that is not READY
# (PREEMPTED, TERMINATED, REPAIRING, STOPPED, DELETING, UNKNOWN, ...) means the workers are gone or unusable.
NODE_PENDING = {"CREATING", "STARTING", "RESTARTING"}
# Node.Health values that mean a worker is unreachable or under maintenance; HEALTH_UNSPECIFIED / empty is "not
# reported yet", which a freshly created node shows.
NODE_UNHEALTHY = {"TIMEOUT", "UNHEALTHY_TENSORFLOW", "UNHEALTHY_MAINTENANCE", "DEPRECATED_UNHEALTHY"}
# QueuedResourceState values before ACTIVE; FAILED / SUSPENDING / SUSPENDED (a preempted spot request) / DELETING
# are LOST.
QUEUED_PENDING = {"CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING"}
# how long one delete may take to make the slice disappear (a large slice takes minutes) before it is sent again
DELETE_TIMEOUT = 1200.0
# gcloud errors that another attempt cannot fix (a typo in a flag, no permission): creation stops at once
FATAL_CREATE_ERRORS = ("INVALID_ARGUMENT", "PERMISSION_DENIED", "UNAUTHENTICATED", "unrecognized arguments")


def log(message: str) -> None:
    """One timestamped line on stderr (the workers' output goes to stdout)."""
    print(f"[babysit {datetime.now():%Y-%m-%d %H:%M:%S}] {message}", file=sys.stderr, flush=True)


def short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def command_line(words: List[str]) -> str:
    """The shell command line run on the workers: one word is a command line already (`-- "cd x && python ..."`),
    several are arguments to quote (`-- python xla/finetune/lora.py --out_dir ...`)."""
    return words[0] if len(words) == 1 else shlex.join(words)


def with_resume_auto(command: str) -> str:
    """Append `--resume auto` unless the command sets --resume itself: every run after a preemption must continue
    from the newest complete checkpoint, and the first one starts fresh with the same flag."""
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise LitError(f"the training command is not a valid shell command line ({e}): {command!r}") from None
    if any(w == "--resume" or w.startswith("--resume=") for w in words):
        return command
    return f"{command} --resume auto"


@dataclass
class Status:
    kind: str  # READY, PENDING, LOST or MISSING
    detail: str  # what gcloud said, for the log ("PREEMPTED", "queued WAITING_FOR_RESOURCES", ...)


class Slice:
    """One TPU slice and the gcloud commands that manage it: a TPU VM node, or a queued resource owning one."""

    def __init__(self, gcloud: str, name: str, zone: str, accelerator_type: str, version: str, spot: bool,
                 preemptible: bool, queued: bool, best_effort: bool, queued_resource: Optional[str],
                 project: Optional[str], create_flags: List[str]) -> None:
        self.gcloud, self.name, self.zone = gcloud, name, zone
        self.accelerator_type, self.version = accelerator_type, version
        self.spot, self.preemptible, self.queued, self.best_effort = spot, preemptible, queued, best_effort
        self.queued_resource = queued_resource or name
        self.project, self.create_flags = project, create_flags

    # -- commands --------------------------------------------------------------------------------------------
    def _cmd(self, *args: str) -> List[str]:
        return [self.gcloud, *args, *(["--project", self.project] if self.project else [])]

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
    def _describe(self, *what: str) -> Optional[dict]:
        """The resource as JSON, or None when gcloud says it does not exist. Any other failure (network, auth) is
        retried a few times and then reported: without knowing the state nothing may be deleted."""
        cmd = self._cmd("compute", "tpus", *what, "--zone", self.zone, "--format", "json")
        for attempt in range(3):
            proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if proc.returncode == 0:
                return json.loads(proc.stdout or "{}")
            if "NOT_FOUND" in proc.stderr or "was not found" in proc.stderr:
                return None
            if attempt < 2:
                time.sleep(2.0 * (attempt + 1))
        raise LitError(f"cannot get the state of {what[-1]!r}: {short(last_line(proc.stderr))}")

    def status(self) -> Status:
        if self.queued:
            qr = self._describe("queued-resources", "describe", self.queued_resource)
            if qr is None:
                return Status(MISSING, "no queued resource")
            state = qr.get("state")
            state = state.get("state", "") if isinstance(state, dict) else str(state or "")
            if state in QUEUED_PENDING:
                return Status(PENDING, f"queued resource {state}")
            if state != "ACTIVE":
                return Status(LOST, f"queued resource {state or 'in no state'}")
        node = self._describe("tpu-vm", "describe", self.name)
        if node is None:
            # an ACTIVE queued resource whose node is gone lost its slice
            return Status(LOST if self.queued else MISSING, "no TPU VM")
        state, health = node.get("state", ""), node.get("health", "")
        if state == "READY" and health not in NODE_UNHEALTHY:
            return Status(READY, "READY" + (f" {health}" if health else ""))
        if state in NODE_PENDING:
            return Status(PENDING, state)
        return Status(LOST, f"{state} {health}".strip())


class Babysitter:
    """The loop: bring the slice up, run the setup script and the command on it, and tell a lost slice (delete,
    create again, rerun) from a failed command (stop)."""

    def __init__(self, tpu: Slice, setup: Optional[str], command: str, max_restarts: int, create_attempts: int,
                 create_retry_delay: float, poll_interval: float, preemption_grace: float,
                 delete_on_success: bool, delete_on_interrupt: bool) -> None:
        self.tpu, self.setup, self.command = tpu, setup, command
        self.max_restarts, self.create_attempts = max_restarts, create_attempts
        self.create_retry_delay = create_retry_delay
        self.poll_interval, self.preemption_grace = poll_interval, preemption_grace
        self.delete_on_success, self.delete_on_interrupt = delete_on_success, delete_on_interrupt
        self.running: Optional[subprocess.Popen] = None
        self.last_detail = ""

    def gcloud(self, cmd: List[str], what: str) -> subprocess.CompletedProcess:
        log(f"{what}: {shlex.join(cmd)}")
        return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)

    def observe(self) -> Status:
        """The slice's status; logged when it changes (polling itself is not logged: once a minute adds noise)."""
        status = self.tpu.status()
        if status.detail != self.last_detail:
            log(f"slice {self.tpu.name}: {status.detail}")
            self.last_detail = status.detail
        return status

    # -- bringing the slice up -------------------------------------------------------------------------------
    def wait_until_usable(self) -> Status:
        """Poll until the slice is READY or LOST (a queued resource can wait for capacity for hours)."""
        status = self.observe()
        while status.kind == PENDING:
            time.sleep(self.poll_interval)
            status = self.observe()
        return status

    def delete(self) -> None:
        """Delete the slice and wait until it is gone: creating it again under the same name needs the old one
        gone, and a delete can return (or fail transiently) before it is."""
        for _ in range(3):
            proc = self.gcloud(self.tpu.delete_cmd(), "deleting the slice")
            if proc.returncode != 0 and "NOT_FOUND" not in proc.stderr:
                log(f"delete failed: {short(last_line(proc.stderr))}")
            deadline = time.monotonic() + DELETE_TIMEOUT
            while time.monotonic() < deadline:
                if self.observe().kind == MISSING:
                    return
                time.sleep(self.poll_interval)
        raise LitError(f"could not delete the slice {self.tpu.name}: it is still {self.last_detail}; delete it with"
                       f" {shlex.join(self.tpu.delete_cmd())} and run the babysitter again")

    def create(self) -> None:
        """Create the slice and wait until it is READY; capacity errors are retried after a delay."""
        for attempt in range(1, self.create_attempts + 1):
            proc = self.gcloud(self.tpu.create_cmd(), f"creating the slice (attempt {attempt}/{self.create_attempts})")
            if proc.returncode == 0:
                status = self.wait_until_usable()
                if status.kind == READY:
                    log(f"slice {self.tpu.name} is ready")
                    return
                reason = f"the slice came up {status.detail}"
            else:
                reason = short(last_line(proc.stderr))
                # exit 2 is gcloud's usage error; these and the errors in FATAL_CREATE_ERRORS will not go away
                if proc.returncode == 2 or any(e in proc.stderr for e in FATAL_CREATE_ERRORS):
                    raise LitError(f"gcloud refused to create the slice {self.tpu.name}: {reason}")
            log(f"creation failed: {reason}")
            if self.observe().kind != MISSING:  # a failed queued request or half-made node blocks the name
                self.delete()
            if attempt < self.create_attempts:
                log(f"retrying in {self.create_retry_delay:g} s")
                time.sleep(self.create_retry_delay)
        raise LitError(
            f"could not create the slice {self.tpu.name} in {self.create_attempts} attempts (last: {reason}); raise"
            " --create_attempts or --create_retry_delay, or try another zone"
        )

    def bring_up(self) -> None:
        status = self.wait_until_usable()
        if status.kind == READY:
            log(f"slice {self.tpu.name} exists and is ready: using it")
            return
        if status.kind == LOST:
            self.delete()
        self.create()

    # -- running on the workers ------------------------------------------------------------------------------
    def stop_running(self) -> None:
        """End the local ssh session (its own process group: gcloud and the ssh it started)."""
        proc, self.running = self.running, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def run_on_workers(self, command: str, what: str, shown: str) -> Optional[int]:
        """Run a command on every worker, watching the slice meanwhile. Returns its exit code, or None when the
        slice was lost while it ran (ssh to a vanished worker can hang for a long time instead of failing)."""
        cmd = self.tpu.ssh_cmd(command)
        log(f"{what}: {shlex.join(cmd[:-1])} {shlex.quote(short(shown, 200))}")
        # a session of its own, so that Ctrl-C in the terminal reaches only the babysitter, which ends it itself
        self.running = proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        while True:
            try:
                code = proc.wait(timeout=self.poll_interval)
                self.running = None
                return code
            except subprocess.TimeoutExpired:
                pass
            status = self.observe()
            if status.kind != READY:
                log(f"the slice is {status.detail} while the command runs: ending the ssh session")
                self.stop_running()
                return None

    def lost_after_failure(self) -> Tuple[bool, str]:
        """Was a failure the slice's doing? The state can lag the connection drop, so a healthy-looking slice is
        asked again for up to --preemption_grace seconds before the failure counts as the command's own."""
        deadline = time.monotonic() + self.preemption_grace
        while True:
            status = self.observe()
            if status.kind != READY:
                return True, status.detail
            if time.monotonic() >= deadline:
                return False, status.detail
            time.sleep(min(self.poll_interval, 10.0, max(0.0, deadline - time.monotonic())))

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> int:
        restarts = 0
        while True:
            self.bring_up()
            code: Optional[int] = 0
            step = "the setup script"
            if self.setup is not None:
                code = self.run_on_workers(f"bash -ec {shlex.quote(self.setup)}", "running the setup script",
                                           "<setup script>")
            if code == 0:
                step = "the command"
                code = self.run_on_workers(self.command, "running the command", self.command)
            if code == 0:
                log("the command finished: exit code 0")
                if self.delete_on_success:
                    self.delete()
                else:
                    log(f"the slice {self.tpu.name} is left running (pass --delete_on_success true to delete it)")
                return 0
            lost, detail = (True, self.last_detail) if code is None else self.lost_after_failure()
            if not lost:
                assert code is not None  # None: the slice was lost while the command ran
                # not a preemption: rerunning would fail the same way. (A local signal death, code -N, exits 128+N
                # like a shell would report it.)
                code = code if code > 0 else 128 - code
                print(f"error: {step} failed with exit code {code} while the slice {self.tpu.name} is healthy"
                      f" ({detail}): not a preemption, not retrying; the slice is left running", file=sys.stderr,
                      flush=True)
                return code
            restarts += 1
            ended = "was stopped" if code is None else f"ended with exit code {code}"
            log(f"preempted: the slice {self.tpu.name} is {detail} ({step} {ended}); lost {restarts} time(s),"
                f" --max_restarts {self.max_restarts}")
            if restarts > self.max_restarts:
                raise LitError(
                    f"the slice {self.tpu.name} was lost {restarts} times, more than --max_restarts"
                    f" {self.max_restarts}: giving up (the checkpoints in the command's --out_dir are kept; run the"
                    " babysitter again to go on)"
                )
            self.delete()

    def interrupted(self) -> int:
        self.stop_running()
        if self.delete_on_interrupt:
            log("interrupted: deleting the slice (--delete_on_interrupt)")
            self.delete()
        else:
            log(f"interrupted: the slice {self.tpu.name} is left as it is (delete it with:"
                f" {shlex.join(self.tpu.delete_cmd())})")
        return 130


def babysit(
    name: str,
    zone: str,
    accelerator_type: str,
    version: str,
    command: str = "",
    spot: bool = False,
    preemptible: bool = False,
    queued: bool = False,
    best_effort: bool = False,
    queued_resource: Optional[str] = None,
    project: Optional[str] = None,
    setup_script: Optional[Path] = None,
    create_flags: str = "",
    max_restarts: int = 20,
    create_attempts: int = 60,
    create_retry_delay: float = 60.0,
    poll_interval: float = 60.0,
    preemption_grace: float = 120.0,
    delete_on_success: bool = False,
    delete_on_interrupt: bool = False,
) -> None:
    """Run a training command on a preemptible TPU slice, recreating the slice after each preemption until the
    command succeeds. Give the command after `--`.

    Args:
        name: the TPU VM's name (gcloud's TPU / --node-id).
        zone: the zone, e.g. us-central2-b.
        accelerator_type: e.g. v4-32, v5litepod-16, v6e-8.
        version: the TPU software version, e.g. tpu-ubuntu2204-base (queued resources: the runtime version).
        command: the training command, one shell command line run on every worker; usually given after `--`.
            `--resume auto` is appended unless it sets --resume.
        spot: create a spot slice (cheaper, preemptible at any time).
        preemptible: create a preemptible slice (the older kind; not with --queued).
        queued: create the slice through a queued resource, which waits for capacity instead of failing.
        best_effort: a best-effort queued resource (gcloud alpha; with --queued true, not with --spot).
        queued_resource: the queued resource's name. Default: the TPU name.
        project: the Google Cloud project. Default: gcloud's configured one.
        setup_script: a bash script run on every worker after each creation, before the command (clone, install,
            mount the bucket); it runs with `bash -e` and must succeed.
        create_flags: more flags for the create command, as one string (e.g. "--scopes cloud-platform").
        max_restarts: how many times the slice may be lost and recreated before giving up.
        create_attempts: how many times to try creating the slice each time it is (re)created.
        create_retry_delay: seconds between creation attempts (a zone without capacity may have it later).
        poll_interval: seconds between checks of the slice's state while waiting or while the command runs.
        preemption_grace: after the command fails, seconds to keep checking whether the slice was lost before
            taking the failure as the command's own (the reported state can lag the dropped connection).
        delete_on_success: delete the slice when the command has succeeded.
        delete_on_interrupt: delete the slice on Ctrl-C (by default nothing is deleted).
    """
    if not command.strip():
        raise LitError("no training command: give it after `--`, e.g. -- \"cd lit-gpt-xla && python"
                       " xla/finetune/lora.py --out_dir /mnt/gcs/out/lora\"")
    if spot and preemptible:
        raise LitError("--spot and --preemptible exclude each other: spot is the newer kind of preemptible slice")
    if queued and preemptible:
        raise LitError("queued resources take --spot, not --preemptible")
    if best_effort and (not queued or spot):
        raise LitError("--best_effort applies to queued resources only (--queued true) and excludes --spot")
    if create_attempts < 1 or max_restarts < 0:
        raise LitError("--create_attempts must be at least 1 and --max_restarts at least 0")
    setup = None
    if setup_script is not None:
        try:
            setup = Path(setup_script).read_text()
        except OSError as e:
            raise LitError(f"cannot read the setup script {str(setup_script)!r}: {e.strerror or e}") from None
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        raise LitError("gcloud is not on PATH: install the Google Cloud CLI"
                       " (https://cloud.google.com/sdk/docs/install)")
    command = with_resume_auto(command)
    log(f"gcloud: {gcloud}")
    log(f"command on every worker: {command}")
    if "--out_dir" not in command:
        log("note: the command sets no --out_dir; the default is on the VMs' disks, which a preemption erases")
    tpu = Slice(gcloud, name, zone, accelerator_type, version, spot, preemptible, queued, best_effort, queued_resource,
                project, shlex.split(create_flags))
    sitter = Babysitter(tpu, setup, command, max_restarts, create_attempts, create_retry_delay, poll_interval,
                        preemption_grace, delete_on_success, delete_on_interrupt)

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # a `kill` (SIGTERM) is handled like Ctrl-C: nothing deleted unless asked

    signal.signal(signal.SIGTERM, terminate)
    try:
        code = sitter.run()
    except KeyboardInterrupt:
        code = sitter.interrupted()
    if code:
        sys.exit(code)


def split_argv(argv: List[str]) -> List[str]:
    """Everything after `--` is the training command: pass it as --command, so that jsonargparse never sees its
    flags (they are the recipe's, not the babysitter's)."""
    if "--" not in argv:
        return argv
    i = argv.index("--")
    return [*argv[:i], f"--command={command_line(argv[i + 1:])}"] if argv[i + 1:] else argv[:i]


if __name__ == "__main__":
    run_cli(babysit, as_positional=False, args=split_argv(sys.argv[1:]))
