"""Keep a training run going on a preemptible (spot) TPU slice until it finishes (xla/README.md, "Preemptible
slices: the babysitter").

    python xla/scripts/babysit.py --name my-tpu --zone us-central2-b --accelerator_type v4-32 \\
        --version tpu-ubuntu2204-base --spot true --setup_script setup.sh -- \\
        "cd lit-gpt-xla && python xla/finetune/lora.py --out_dir gs://my-bucket/lora --train.save_interval 100"

It creates the slice with `gcloud`, runs the setup script and the command (`--resume auto` appended) on every
worker, and after a preemption deletes the slice, creates it again and reruns them, until the command exits 0. It
checks everything before it creates anything; every `gcloud` call has a time limit and a failed or garbled state
query is retried with backoff, then named in one `error:` line, which also names a slice that is left and the command
that deletes it (or `--delete_on_error true` deletes it). Ctrl-C or SIGTERM deletes nothing unless
`--delete_on_interrupt true`, and says the same.

The gcloud calls themselves (time limits, retries, reading `describe`) and the checks of the names, the flags, the
setup script and the gcloud program are in lit_gpt/xla/gcloud.py; here are the slice, the loop and the command line.
"""

import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from lit_gpt.utils import LitError, error_reason, run_cli
from lit_gpt.xla.gcloud import (FATAL_CREATE_ERRORS, NODE_PENDING, NODE_UNHEALTHY, QUEUED_PENDING, Gcloud,
                                check_bash, check_names, find_gcloud, last_line, log, not_found, parse_state,
                                read_setup, short, split_create_flags)

# What `describe` reports, reduced to what the babysitter does about it.
READY = "ready"  # usable: run on it
PENDING = "pending"  # on its way to READY (queued, provisioning, creating): wait
LOST = "lost"  # preempted, terminated, unhealthy, failed, being deleted: delete and create again
MISSING = "missing"  # does not exist: create it
# the numbers' ranges: (lowest, highest, whether the lowest itself is refused)
RANGES = {"max_restarts": (0, math.inf, False), "create_attempts": (1, math.inf, False),
          "gcloud_retries": (0, 10, False),
          **{k: (0, math.inf, False) for k in ("create_retry_delay", "preemption_grace", "gcloud_backoff")},
          **{k: (0, math.inf, True) for k in ("poll_interval", "gcloud_timeout", "create_timeout", "setup_timeout")}}


def with_resume_auto(command: str) -> str:
    """Append `--resume auto` unless the command sets --resume itself: every run after a preemption must continue
    from the newest complete checkpoint, and the first one starts fresh with the same flag."""
    command = command.rstrip()
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise LitError(f"the training command is not a valid shell command line ({e}): {command!r}") from None
    check_bash(command, f"the training command {short(command, 120)!r}")
    if any(w == "--resume" or w.startswith("--resume=") for w in words):
        return command
    return f"{command} --resume auto"


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


class Babysitter:
    """The loop: bring the slice up, run the setup script and the command on it, and tell a lost slice (delete,
    create again, rerun) from a failed command (stop). `settings` are babysit()'s numbers and delete_on_* flags."""

    max_restarts: int
    create_attempts: int
    create_retry_delay: float
    poll_interval: float
    preemption_grace: float
    setup_timeout: float
    delete_on_success: bool
    delete_on_interrupt: bool
    delete_on_error: bool

    def __init__(self, tpu: Slice, setup: Optional[str], command: str, **settings: Any) -> None:
        self.tpu, self.setup, self.command = tpu, setup, command
        self.__dict__.update(settings)
        self.running: Optional[subprocess.Popen] = None
        self.last_detail = ""
        # does the slice exist? False: not that this run knows of (nothing to clean up); None: unknown (a create or
        # delete call was made, or cut short, and no state query has answered since)
        self.exists: Optional[bool] = False
        self.undeletable = False  # deleting failed already: --delete_on_error does not try again

    def gcloud(self, cmd: List[str], what: str) -> Tuple[Optional[int], str, str]:
        """A create or delete call, logged, with its time limit."""
        log(f"{what}: {shlex.join(cmd)}")
        self.exists = None
        return self.tpu.gcloud.once(cmd, self.tpu.gcloud.long_timeout)

    def observe(self, retries: Optional[int] = None) -> Status:
        """The slice's status; logged when it changes (polling itself is not logged: once a minute adds noise)."""
        status = self.tpu.status(retries)
        self.exists = status.kind != MISSING
        if status.detail != self.last_detail:
            log(f"slice {self.tpu.name}: {status.detail}")
            self.last_detail = status.detail
        return status

    def leftover(self) -> str:
        """Which slice is left and the exact command that deletes it."""
        state = f"is left as it is ({self.last_detail})" if self.exists else "may exist (its creation was cut short)"
        return f"the slice {self.tpu.name} {state}; delete it with: {shlex.join(self.tpu.delete_cmd())}"

    def failed(self, message: str) -> str:
        """The error line for `message`: as it is when no slice was made, else with the slice that is left and the
        command that deletes it, or (--delete_on_error) with the word that it was deleted."""
        self.stop_running()
        if self.exists is None:  # one quick look (no retries: the error may be that gcloud does not answer)
            try:
                self.observe(retries=0)
            except LitError:
                pass
        if self.exists is False:
            return message
        if self.delete_on_error and not self.undeletable:
            log("stopping on an error: deleting the slice (--delete_on_error)")
            try:
                self.delete()
                return f"{message}; the slice {self.tpu.name} was deleted (--delete_on_error)"
            except LitError as e:
                message = f"{message}; deleting the slice failed ({e})"
        return f"{message}; {self.leftover()}"

    # -- bringing the slice up -------------------------------------------------------------------------------
    def wait_until_usable(self) -> Status:
        """Poll until the slice is READY, LOST or MISSING (a queued resource can wait for capacity for hours)."""
        status = self.observe()
        while status.kind == PENDING:
            time.sleep(self.poll_interval)
            status = self.observe()
        return status

    def delete(self) -> None:
        """Delete the slice and wait until it is gone: creating it again under the same name needs the old one
        gone, and a delete can return (or fail transiently) before it is."""
        limit = self.tpu.gcloud.long_timeout
        for _ in range(3):
            code, _, err = self.gcloud(self.tpu.delete_cmd(), "deleting the slice")
            if code is None or (code != 0 and not not_found(err)):
                log(f"delete failed: {short(last_line(err))}" if code else f"the delete timed out after {limit:g} s")
            deadline = time.monotonic() + limit
            while self.observe().kind != MISSING:
                if time.monotonic() >= deadline:
                    break
                time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
            else:
                return
        self.undeletable = True
        raise LitError(f"could not delete the slice {self.tpu.name}: it is still {self.last_detail} after 3 deletes"
                       f" of up to --create_timeout {limit:g} s each")

    def create(self) -> None:
        """Create the slice and wait until it is READY; capacity errors are retried after a delay."""
        limit = self.tpu.gcloud.long_timeout
        for attempt in range(1, self.create_attempts + 1):
            cmd = self.tpu.create_cmd()
            code, _, err = self.gcloud(cmd, f"creating the slice (attempt {attempt}/{self.create_attempts})")
            if code == 0 or code is None:
                # a create cut short by its time limit may still be under way: its state says
                status = self.wait_until_usable()
                if status.kind == READY:
                    log(f"slice {self.tpu.name} is ready")
                    return
                reason = f"the slice came up {status.detail}" if code == 0 else \
                    f"`{self.tpu.gcloud.shown(cmd)}` timed out after {limit:g} s (--create_timeout)"
            else:
                reason = short(last_line(err))
                # exit 2 is gcloud's usage error; these and the errors in FATAL_CREATE_ERRORS will not go away
                if code == 2 or any(e in err for e in FATAL_CREATE_ERRORS):
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
        """End the local ssh session (its own process group: gcloud and the ssh it started): SIGTERM, then SIGKILL."""
        proc, self.running = self.running, None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                if proc is None or proc.poll() is not None:
                    return
                os.killpg(proc.pid, sig)
                proc.wait(10.0)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def run_on_workers(self, command: str, what: str, shown: str, limit: float = math.inf) -> Optional[int]:
        """Run a command on every worker, watching the slice meanwhile. Returns its exit code, or None when the
        slice was lost while it ran (ssh to a vanished worker can hang for a long time instead of failing)."""
        cmd = self.tpu.ssh_cmd(command)
        log(f"{what}: {shlex.join(cmd[:-1])} {shlex.quote(short(shown, 200))}")
        end = time.monotonic() + limit
        try:  # a session of its own, so that Ctrl-C in the terminal reaches only the babysitter, which ends it
            self.running = proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise LitError(f"cannot run {cmd[0]}: {error_reason(e)}") from None
        while True:
            try:
                code = proc.wait(timeout=max(0.01, min(self.poll_interval, end - time.monotonic())))
                self.running = None
                return code
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() >= end:
                self.stop_running()
                raise LitError(f"the setup script ran longer than --setup_timeout {limit:g} s on the slice"
                               f" {self.tpu.name}: ended it; make it finish sooner or raise --setup_timeout")
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
                                           "<setup script>", self.setup_timeout)
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
                message = self.failed(f"{step} failed with exit code {code} while the slice {self.tpu.name} is"
                                      f" healthy ({detail}): not a preemption, not retrying")
                print(f"error: {message}", file=sys.stderr, flush=True)
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
        """Ctrl-C or SIGTERM: end the ssh session, delete the slice only with --delete_on_interrupt, and say what
        is left and the command that deletes it."""
        self.stop_running()
        if self.delete_on_interrupt and self.exists is not False:
            log("interrupted: deleting the slice (--delete_on_interrupt)")
            try:
                self.delete()
                return 130
            except (LitError, KeyboardInterrupt) as e:
                log(f"the delete did not finish: {e or 'interrupted again'}")
        log(f"interrupted: {self.leftover()}" if self.exists is not False else "interrupted: no slice was created")
        return 130


def check_arguments(args: Dict[str, Any]) -> List[str]:
    """Refuse a malformed argument or combination of babysit()'s `args` in one line before anything is created;
    returns the create flags, split."""
    a = SimpleNamespace(**args)
    for refused, line in (
        (not a.command.strip(), "no training command: give it after `--`, e.g. -- \"cd lit-gpt-xla && python"
                                " xla/finetune/lora.py --out_dir gs://my-bucket/lora\""),
        (a.spot and a.preemptible, "--spot and --preemptible exclude each other: spot is the newer preemptible"),
        (a.queued and a.preemptible, "queued resources take --spot, not --preemptible"),
        (a.best_effort and (not a.queued or a.spot), "--best_effort applies to queued resources only (--queued"
                                                      " true) and excludes --spot"),
        (a.queued_resource is not None and not a.queued, "--queued_resource names a queued resource: pass --queued"
                                                         " true with it, or leave it out"),
    ):
        if refused:
            raise LitError(line)
    check_names(args)
    for flag, (low, high, above) in RANGES.items():
        value = args[flag]
        if not (math.isfinite(value) and low <= value <= high and (value > low or not above)):
            raise LitError(f"--{flag} {value} is out of range: give a number {'above' if above else 'at least'}"
                           f" {low:g}" + (f" and at most {high:g}" if high < math.inf else ""))
    return split_create_flags(a.create_flags)


def babysit(
    name: str, zone: str, accelerator_type: str, version: str, command: str = "", spot: bool = False,
    preemptible: bool = False, queued: bool = False, best_effort: bool = False, queued_resource: Optional[str] = None,
    project: Optional[str] = None, setup_script: Optional[Path] = None, create_flags: str = "",
    max_restarts: int = 20, create_attempts: int = 60, create_retry_delay: float = 60.0, poll_interval: float = 60.0,
    preemption_grace: float = 120.0, delete_on_success: bool = False, delete_on_interrupt: bool = False,
    delete_on_error: bool = False, gcloud: Optional[str] = None, gcloud_timeout: float = 300.0,
    create_timeout: float = 1800.0, gcloud_retries: int = 4, gcloud_backoff: float = 5.0,
    setup_timeout: float = 3600.0,
) -> None:
    """Run a training command on a preemptible TPU slice, recreating the slice after each preemption until the
    command succeeds. Give the command after `--`.

    Args:
        name: the TPU VM's name (gcloud's TPU / --node-id).
        zone: the zone, e.g. us-central2-b.
        accelerator_type: e.g. v4-32, v5litepod-16, v6e-8.
        version: the TPU software version, e.g. tpu-ubuntu2204-base (queued resources: the runtime version).
        command: the training command, one shell command line run on every worker, usually given after `--`.
        spot: create a spot slice (cheaper, preemptible at any time).
        preemptible: create a preemptible slice (the older kind; not with --queued).
        queued: create the slice through a queued resource, which waits for capacity instead of failing.
        best_effort: a best-effort queued resource (gcloud alpha; with --queued true, not with --spot).
        queued_resource: the queued resource's name (with --queued true). Default: the TPU name.
        project: the Google Cloud project. Default: gcloud's configured one.
        setup_script: a bash script run on every worker (`bash -e`) after each creation, before the command.
        create_flags: more flags for the create command, as one string (e.g. "--scopes cloud-platform").
        max_restarts: how many times the slice may be lost and recreated before giving up.
        create_attempts: how many times to try creating the slice each time it is (re)created.
        create_retry_delay: seconds between creation attempts (a zone without capacity may have it later).
        poll_interval: seconds between checks of the slice's state while waiting or while the command runs.
        preemption_grace: seconds to keep checking whether a failed command's slice was lost (the state lags).
        delete_on_success: delete the slice when the command has succeeded.
        delete_on_interrupt: delete the slice on Ctrl-C or SIGTERM (by default nothing is deleted).
        delete_on_error: delete the slice on an error (by default the error line gives the command that does).
        gcloud: the gcloud program to run (a path, or a name on PATH). Default: the `gcloud` on PATH.
        gcloud_timeout: seconds one state query (`describe`) may take before it is killed and tried again.
        create_timeout: seconds one create or delete call (or a deleted slice's vanishing) may take.
        gcloud_retries: how often a state query that failed, hung or printed junk is retried (at most 10).
        gcloud_backoff: seconds before the first retry of a state query, doubled for each further one.
        setup_timeout: seconds the setup script may run on the workers.
    """
    flags = check_arguments(dict(locals()))
    setup = None if setup_script is None else read_setup(setup_script)
    command = with_resume_auto(command)
    runner = Gcloud(find_gcloud(gcloud), gcloud_timeout, create_timeout, gcloud_retries, gcloud_backoff)
    log(f"gcloud: {runner.path}")
    log(f"command on every worker: {command}")
    if "--out_dir" not in command:
        log("note: the command sets no --out_dir; the default is on the VMs' disks, which a preemption erases")
    tpu = Slice(runner, name, zone, accelerator_type, version, spot, preemptible, queued, best_effort,
                queued_resource, project, flags)
    settings = {k: v for k, v in locals().items() if k in Babysitter.__annotations__}
    sitter = Babysitter(tpu, setup, command, **settings)

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # a `kill` (SIGTERM) is handled like Ctrl-C: nothing deleted unless asked

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        try:
            code = sitter.run()
        except LitError as e:  # the line says which slice is left and how to delete it
            raise LitError(sitter.failed(str(e))) from None
    except KeyboardInterrupt:
        code = sitter.interrupted()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code:
        sys.exit(code)


def split_argv(argv: List[str]) -> List[str]:
    """Everything after `--` is the training command: pass it as --command, so that jsonargparse never sees its
    flags (they are the recipe's, not the babysitter's)."""
    if "--" not in argv:
        return argv
    i = argv.index("--")
    # one word is a command line already (`-- "cd x && python ..."`), several are arguments to quote
    words = argv[i + 1:]
    return [*argv[:i], f"--command={words[0] if len(words) == 1 else shlex.join(words)}"] if words else argv[:i]


def main(argv: List[str]) -> None:
    """The command line: `error: ...` and exit 1 for a LitError; exit 130 for Ctrl-C before the babysitter ran."""
    try:
        run_cli(babysit, as_positional=False, args=split_argv(argv))
    except KeyboardInterrupt:
        print("error: interrupted before any slice was created", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main(sys.argv[1:])
