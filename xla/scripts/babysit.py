"""Keep a training run going on a preemptible (spot) TPU slice until it finishes (xla/README.md, "Preemptible
slices: the babysitter").

    python xla/scripts/babysit.py --name my-tpu --zone us-central2-b --accelerator_type v4-32 \\
        --version tpu-ubuntu2204-base --spot true --setup_script setup.sh -- \\
        "cd lit-gpt-xla && python xla/finetune/lora.py --out_dir gs://my-bucket/lora --train.save_interval 100"

It creates the slice with `gcloud`, runs the setup script on every worker and starts the command there (`--resume
auto` appended) detached from the ssh session (nohup + setsid, a pid file, a log and an exit-code file per worker),
then watches the slice, every worker's job and its heartbeat (lit_gpt/heartbeat.py). After a preemption it deletes
the slice, creates it again and reruns them; a job whose heartbeat stops for --stall_timeout (or that vanishes) is
stopped and started again on the same slice; one worker that fails stops the others; until the command exits 0 on
every worker. A killed babysitter leaves the job running: `--attach true` watches it again. It checks everything
before it creates anything; every `gcloud` call has a time limit; a failed or garbled state query, and an ssh call
that fails (exit 255, transient errors), is retried with backoff, then named in one `error:` line, which also names
a slice that is left and the command that deletes it (or `--delete_on_error true` deletes it). Ctrl-C or SIGTERM
deletes nothing unless `--delete_on_interrupt true`, and says the same; the job goes on.

The gcloud calls themselves (time limits, retries, reading `describe`) and the checks of the names, the flags, the
setup script and the gcloud program, the slice's gcloud commands and the workers' job scripts are in
lit_gpt/xla/gcloud.py; here are the loop and the command line.
"""

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from lit_gpt.utils import LitError, error_reason, run_cli
from lit_gpt.xla.gcloud import (FATAL_CREATE_ERRORS, JOB_ROOT, LOST, MISSING, PENDING, READY, Gcloud, Slice, Status,
                                Worker, check_bash, check_names, collect_script, find_gcloud, last_line, launch_script,
                                launched, log, not_found, out_dir_of, parse_workers, read_setup, short,
                                split_create_flags, status_script, stop_script)

# the numbers' ranges: (lowest, highest, whether the lowest itself is refused)
RANGES = {"max_restarts": (0, math.inf, False), "create_attempts": (1, math.inf, False),
          "gcloud_retries": (0, 10, False), "ssh_retries": (0, 20, False), "stall_timeout": (0, math.inf, False),
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


SSH_BACKOFF_CAP = 60.0  # seconds: the longest wait between two ssh tries (the backoff doubles up to it)


class SliceLost(Exception):
    """The slice stopped being READY while the babysitter talked to its workers."""


def beat_text(heartbeat: str) -> str:
    """A heartbeat file's text for a message: "last: step 3 on host-1", or what is there."""
    try:
        found = json.loads(heartbeat)
        return f"last: step {found['step']} on {found.get('host', '?')}"
    except (ValueError, TypeError, KeyError):
        return f"last: {short(heartbeat, 80)}" if heartbeat else "none since the start"


def shown_ssh(cmd: List[str], program: str = "gcloud") -> str:
    """An ssh call for a message, without the script it carries (`--command ...` is left out)."""
    i = cmd.index("--command")
    return shlex.join([program, *cmd[1:i], *cmd[i + 2:]])


def answered(out: str) -> str:
    """A worker script's output, which must hold its `LITBS` line (else ValueError: tried again)."""
    if "LITBS" not in out:
        raise ValueError(out)
    return out


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
    attach: bool
    stall_timeout: float
    ssh_retries: int
    gcloud_backoff: float

    def __init__(self, tpu: Slice, setup: Optional[str], command: str, **settings: Any) -> None:
        self.tpu, self.setup, self.command = tpu, setup, command
        self.__dict__.update(settings)
        self.running: Optional[subprocess.Popen] = None
        self.last_detail = ""
        # does the slice exist? False: not that this run knows of (nothing to clean up); None: unknown (a create or
        # delete call was made, or cut short, and no state query has answered since)
        self.exists: Optional[bool] = False
        self.undeletable = False  # deleting failed already: --delete_on_error does not try again
        self.job = tpu.name  # the detached job's folder on each worker: ~/.lit-gpt-babysit/NAME
        self.job_live = False  # a job was started (or found) and not seen to end: an error leaves it running
        self.offset: Optional[int] = None  # how much of worker 0's log was shown
        out_dir = out_dir_of(command)
        self.log_url = out_dir.rstrip("/") if out_dir and out_dir.startswith("gs://") else ""

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
        if self.job_live and not self.delete_on_error:
            message = f"{message}; the command goes on running on the workers (re-attach with --attach true)"
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
        """Run a command (the setup script) on every worker in the foreground, watching the slice meanwhile, and
        again when ssh itself failed (exit 255: workers still booting, a dropped connection; the setup script must
        be safe to rerun), up to --ssh_retries times. Returns its exit code, or None when the slice was lost while
        it ran (ssh to a vanished worker can hang for a long time instead of failing)."""
        delay = self.gcloud_backoff
        for attempt in range(self.ssh_retries + 1):
            code = self._run_on_workers_once(command, what, shown, limit)
            if code != 255 or attempt == self.ssh_retries:
                return code
            if self.observe().kind != READY:
                return None
            log(f"ssh to the workers of {self.tpu.name} failed (exit 255) while {what}; trying again in {delay:g} s"
                f" ({attempt + 1}/{self.ssh_retries}, --ssh_retries)")
            time.sleep(delay)
            delay = min(delay * 2, SSH_BACKOFF_CAP)
        return 255

    def _run_on_workers_once(self, command: str, what: str, shown: str, limit: float) -> Optional[int]:
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

    # -- the detached job ------------------------------------------------------------------------------------
    def ssh(self, script: str, what: str, parse: Callable[[str], Any]) -> Any:
        """A short script on every worker (starting, reading or stopping the job: all safe to repeat), its output
        parsed. ssh exit 255, a time-out, gcloud's transient errors (UNAVAILABLE, DEADLINE_EXCEEDED, a connection
        reset) or garbled output are tried again up to --ssh_retries times, the wait doubling from --gcloud_backoff
        up to 60 s, while the slice stays READY (else SliceLost); then one LitError line."""
        cmd = self.tpu.ssh_cmd(script)
        delay = self.gcloud_backoff
        for attempt in range(self.ssh_retries + 1):
            code, out, err = self.tpu.gcloud.once(cmd, self.tpu.gcloud.timeout)
            if code == 0:
                try:
                    return parse(out)
                except (ValueError, TypeError, IndexError, UnicodeDecodeError):
                    problem = f"printed no status line ({short(last_line(out + chr(10) + err), 120)})"
            elif code is None:
                problem = f"timed out after {self.tpu.gcloud.timeout:g} s"
            else:
                problem = f"failed with exit code {code}: {short(last_line(err), 160)}"
            if attempt == self.ssh_retries:
                break
            status = self.observe()
            if status.kind != READY:
                raise SliceLost(status.detail)
            log(f"ssh to the workers of {self.tpu.name} ({what}) {problem}; trying again in {delay:g} s"
                f" ({attempt + 1}/{self.ssh_retries}, --ssh_retries)")
            time.sleep(delay)
            delay = min(delay * 2, SSH_BACKOFF_CAP)
        raise LitError(f"cannot reach the workers of the slice {self.tpu.name} over ssh ({what}): `{shown_ssh(cmd)}`"
                       f" {problem} ({self.ssh_retries + 1} tries, --ssh_retries {self.ssh_retries}); check the"
                       " slice's firewall and that `gcloud compute tpus tpu-vm ssh` works by hand")

    def launch(self) -> None:
        """Start the command detached on every worker (a worker whose job still runs keeps it)."""
        log(f"running the command: detached on every worker ({shown_ssh(self.tpu.ssh_cmd(''), self.tpu.gcloud.path)}"
            f" --command ...; each worker's log:"
            f" ~/{JOB_ROOT}/{self.job}/log): {short(self.command, 200)}")
        found = self.ssh(launch_script(self.job, self.command, self.log_url), "starting the command", launched)
        self.job_live = True
        size = found.get("0", next(iter(found.values())))[1]
        # a new VM has an empty log; the same VM (a restart after a stall) goes on from what was shown
        self.offset = size if self.offset is None else min(self.offset, size)
        running = sorted(w for w, (how, _) in found.items() if how == "already-running")
        if running:
            log(f"worker(s) {', '.join(running)} still run the job: kept")

    def workers(self) -> Dict[str, Worker]:
        """Every worker's job state, heartbeat and worker 0's new log lines (shown on stdout)."""
        found = self.ssh(status_script(self.job, self.offset or 0), "reading the job's state", parse_workers)
        if "0" in found:
            if self.offset is None:  # re-attached: the last lines only
                self.offset = max(0, found["0"].log_size - 2000)
                return self.workers()
            if found["0"].log:
                sys.stdout.buffer.write(found["0"].log)
                sys.stdout.flush()
                self.offset += len(found["0"].log)
        return found

    def collect(self) -> None:
        """The workers' last log lines and stacks (py-spy where installed) on stderr, before the job is stopped."""
        log("the workers' last log lines (and Python stacks, where py-spy is installed):")
        try:
            out = self.ssh(collect_script(self.job), "collecting the logs", answered)
        except (LitError, SliceLost) as e:
            log(f"could not collect them: {e}")
            return
        for line in out.splitlines():
            if not line.startswith("LITBS"):
                print(line, file=sys.stderr, flush=True)

    def stop_job(self) -> None:
        """Stop the job on every worker (its whole process group)."""
        log(f"stopping the job on every worker of {self.tpu.name}")
        try:
            self.ssh(stop_script(self.job), "stopping the job", answered)
        except SliceLost as e:  # the job went with the slice
            log(f"the slice {self.tpu.name} is {e}: nothing left to stop")
        self.job_live = False

    def watch(self) -> Tuple[str, str, Any]:
        """Watch the job until it ends or goes wrong: ("done", "", None), ("lost", slice state, None),
        ("failed", worker, exit code), ("gone", workers, None): ended without an exit code, or ("stalled", worker,
        last heartbeat): no new heartbeat for --stall_timeout s (counted from the start before the first one)."""
        changed: Dict[str, Tuple[str, float]] = {}  # worker -> (heartbeat, when it last changed)
        start = time.monotonic()
        while True:
            status = self.observe()
            if status.kind != READY:
                return "lost", status.detail, None
            try:
                found = self.workers()
            except SliceLost as e:
                return "lost", str(e), None
            failed = [(w, x) for w, x in sorted(found.items()) if x.state == "exited" and x.detail != "0"]
            if failed:
                return "failed", failed[0][0], int(failed[0][1].detail)
            gone = [w for w, x in sorted(found.items()) if x.state in ("vanished", "none", "stopped")]
            if gone:
                return "gone", ", ".join(gone), None
            if all(x.state == "exited" for x in found.values()):
                if found.get("0") and found["0"].log_size > (self.offset or 0):
                    continue  # the rest of the log first
                self.job_live = False
                return "done", "", None
            now = time.monotonic()
            for w, x in sorted(found.items()):
                if x.state != "running":
                    continue
                if changed.get(w, ("", start))[0] != x.heartbeat:
                    changed[w] = (x.heartbeat, now)
                quiet = now - changed.get(w, ("", start))[1]
                if self.stall_timeout and quiet >= self.stall_timeout:
                    return "stalled", w, x.heartbeat
            time.sleep(self.poll_interval)

    def attach_to_job(self) -> bool:
        """--attach: is there a job on the slice to watch? (False: the slice is gone; run as usual.)"""
        status = self.wait_until_usable()
        if status.kind != READY:
            log(f"--attach: the slice {self.tpu.name} is {status.detail}: its job went with it; bringing the slice"
                " up again and starting the command (--resume auto)")
            return False
        try:
            found = self.workers()
        except SliceLost:
            return False
        if all(x.state == "none" for x in found.values()):
            raise LitError(f"--attach: no job on the slice {self.tpu.name} (no worker has ~/{JOB_ROOT}/{self.job}):"
                           " run the babysitter without --attach true to start it")
        self.job_live = True
        states = ", ".join(f"worker {w} {x.state}" for w, x in sorted(found.items()))
        log(f"attached to the job on the slice {self.tpu.name} ({states})")
        return True

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
        relaunch = self.attach and self.attach_to_job()  # True: the job runs (or ran) on a ready slice
        watching = relaunch
        while True:
            if not relaunch:
                self.bring_up()
            code: Optional[int] = 0
            step = "the setup script"
            if self.setup is not None and not relaunch:
                code = self.run_on_workers(f"bash -ec {shlex.quote(self.setup)}", "running the setup script",
                                           "<setup script>", self.setup_timeout)
            worker = ""
            if code == 0:
                step = "the command"
                try:
                    if not watching:
                        self.launch()
                    outcome, worker, value = self.watch()
                except SliceLost as e:
                    outcome, worker, value = "lost", str(e), None
                watching = relaunch = False
                if outcome == "done":
                    log("the command finished: exit code 0 on every worker")
                    if self.delete_on_success:
                        self.delete()
                    else:
                        log(f"the slice {self.tpu.name} is left running (pass --delete_on_success true to delete it)")
                    return 0
                if outcome in ("stalled", "gone"):
                    restarts += 1
                    if outcome == "stalled":
                        why = (f"stalled: worker {worker} wrote no heartbeat for --stall_timeout"
                               f" {self.stall_timeout:g} s ({beat_text(value)})")
                    else:
                        why = f"the job on worker(s) {worker} ended without an exit code (killed, or the VM restarted)"
                    self.check_restarts(restarts, why)
                    log(f"{why}: stopping it and restarting the command on the slice {self.tpu.name} from the newest"
                        f" intact step (--resume auto; restart {restarts}, --max_restarts {self.max_restarts})")
                    self.collect()
                    self.stop_job()
                    lost, detail = self.lost_after_failure()
                    if not lost:
                        relaunch = True
                        continue
                    restarts -= 1  # counted below as a preemption
                    code = None
                elif outcome == "failed":
                    code = value
                    log(f"worker {worker} failed with exit code {code}: stopping the job on the other workers")
                    self.collect()
                    self.stop_job()  # one failing worker stops the others (they would wait for it in a collective)
                else:
                    code = None
            lost, detail = (True, self.last_detail) if code is None else self.lost_after_failure()
            if not lost:
                assert code is not None  # None: the slice was lost while the command ran
                # not a preemption: rerunning would fail the same way. (A local signal death, code -N, exits 128+N
                # like a shell would report it.)
                code = code if code > 0 else 128 - code
                where = f" on worker {worker} (the other workers' jobs were stopped)" if worker else ""
                message = self.failed(f"{step} failed with exit code {code}{where} while the slice {self.tpu.name} is"
                                      f" healthy ({detail}): not a preemption, not retrying" +
                                      (f"; each worker's log: ~/{JOB_ROOT}/{self.job}/log" if worker else ""))
                print(f"error: {message}", file=sys.stderr, flush=True)
                return code
            restarts += 1
            self.job_live = False
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

    def check_restarts(self, restarts: int, why: str) -> None:
        if restarts > self.max_restarts:
            self.collect()
            raise LitError(f"{why}, and the job was restarted {restarts - 1} times already (--max_restarts"
                           f" {self.max_restarts}): giving up; see the workers' logs above (the"
                           " checkpoints in the command's --out_dir are kept)")

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
        if self.job_live and self.exists is not False:
            log(f"interrupted: the command goes on running on the workers (detached); re-attach with the same"
                " command line and --attach true")
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
    setup_timeout: float = 3600.0, attach: bool = False, stall_timeout: float = 1800.0, ssh_retries: int = 6,
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
        attach: watch the job a babysitter started earlier on the slice (its own process was killed, its terminal
            closed, its connection lost: the job runs on, detached) instead of starting the command.
        stall_timeout: seconds without a new heartbeat from a worker (the training loop writes one per step; before
            the first, counted from the start) after which the job counts as hung: it is stopped and restarted from
            the newest intact step. 0: not watched.
        ssh_retries: how often an ssh to the workers that failed (exit 255, time-out, a transient gcloud error) is
            tried again, the wait doubling from --gcloud_backoff up to 60 s (6: about 3 minutes).
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
