"""xla/scripts/babysit.py against a stand-in `gcloud` (tests/fake_gcloud.py, first on PATH; the real one is never
run, nothing reaches the network).

The fake keeps the TPU VMs and queued resources in a JSON file next to itself. `create` fails with "no more
capacity" as often as the scenario says; `ssh --worker=all --command CMD` runs CMD here with bash (the real recipe),
and preempts the slice in the middle of a run: when a trigger file appears (a checkpoint's commit marker) it
SIGKILLs the command, marks the node PREEMPTED (its queued resource SUSPENDED) and exits 255 like an ssh session
whose VM vanished. Its scenario can also make any call fail, hang, print junk, or do its work and then fail or hang
(a slice left half created).

The main test babysits the real `xla/finetune/lora.py` (LoRA with dropout, XLA:CPU, 1 device) through one failed
creation and two preemptions (after the step-2 and step-4 checkpoints); the final LoRA weights must be bit-identical
to an uninterrupted run of the same command, which runs meanwhile. The others use shell commands: the retry limit,
a failure on a healthy slice, Ctrl-C and SIGTERM, a queued spot resource, and the fault table (bad arguments and a
gcloud that fails, hangs, prints junk or leaves a slice half created; run in this process, for speed: the fake
gcloud still runs as its own program), which checks the exit code, the one error line and what is left afterwards.

The command runs detached on the fake's workers (processes on this machine, each worker with a home of its own);
one test each: ssh that fails transiently twice, a job whose heartbeat stops (restarted, one line), a worker that
exits non-zero (the others stopped), and a babysitter SIGKILLed mid-run whose job `--attach true` picks up. Every
process a fake VM still runs ends with its test (`turn_off_the_vms`). The workers' scripts also run directly: what a
stall shows (a stand-in `py-spy` on PATH gives the stacks; without one, the logs and a line saying so) and each
worker's log copied to a gs:// --out_dir (the fake's `storage cp` writes into its `buckets` folder).
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BABYSIT = REPO / "xla" / "scripts" / "babysit.py"
TIMEOUT = 300
HAS_XLA = importlib.util.find_spec("torch_xla") is not None

FAKE_GCLOUD = Path(__file__).resolve().parent / "fake_gcloud.py"  # the stand-in gcloud, copied per test

XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}
# one process per run: ~8 s of XLA:CPU start-up each, so the run is 6 tiny steps with a checkpoint every 2
RECIPE_ARGS = ["--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1", "--train.save_interval", "2",
               "--train.max_steps", "6", "--train.global_batch_size", "2", "--train.micro_batch_size", "1",
               "--eval.interval", "1000", "--eval.final_validation", "false", "--eval.max_new_tokens", "0",
               "--accelerator", "cpu"]
FAST = ["--create_retry_delay", "0.2", "--poll_interval", "1", "--preemption_grace", "1"]
TPU = ["--name", "my-tpu", "--zone", "us-central2-b", "--accelerator_type", "v4-8", "--version",
       "tpu-ubuntu2204-base"]
DELETE = "compute tpus tpu-vm delete my-tpu --zone us-central2-b --quiet"  # after the gcloud's path


FAKES: List["Fake"] = []  # the fakes of the running test: their VMs' processes end with it


@pytest.fixture(autouse=True)
def turn_off_the_vms():
    """Every process a test's fake VMs still run (detached jobs, the VM watchers) ends with the test."""
    from fake_gcloud import kill_vm_processes  # tests/fake_gcloud.py

    yield
    while FAKES:
        kill_vm_processes(f"{FAKES.pop().dir.resolve()}|")


class Fake:
    """A directory holding the fake gcloud, its scenario, state and call record."""

    def __init__(self, root: Path, workdir: Path, shebang: Optional[str] = None, mode: int = 0o755,
                 **scenario) -> None:
        self.dir = root / "bin"
        self.dir.mkdir(parents=True)
        FAKES.append(self)
        gcloud = self.dir / "gcloud"
        # -S: no site-packages to scan at each start (the fake needs only the standard library)
        gcloud.write_text(f"{shebang or f'#!{sys.executable} -S'}\n" + FAKE_GCLOUD.read_text())
        gcloud.chmod(mode)
        (self.dir / "scenario.json").write_text(json.dumps({"workdir": str(workdir), **scenario}))

    def env(self, **extra: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_", "CPU_NUM"))}
        env.update(PATH=f"{self.dir}{os.pathsep}{env.get('PATH', '')}", **extra)
        return env

    def home(self, worker: int = 0, node: str = "my-tpu") -> Path:
        """A fake worker's home folder (the babysitter's detached job lives in ~/.lit-gpt-babysit)."""
        return self.dir / "home" / node / str(worker)

    def state(self) -> dict:
        return json.loads((self.dir / "state.json").read_text())

    def nodes(self) -> set:
        """The TPU VMs that exist afterwards (none when no call changed or read the state)."""
        return set(self.state()["nodes"]) if (self.dir / "state.json").exists() else set()

    def calls(self) -> List[List[str]]:
        log = self.dir / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def count(self, verb: str) -> int:
        return sum(len(c) > 3 and verb == (c[3] if c[0] != "alpha" else c[4]) for c in self.calls())

    def babysit(self, *args: str, timeout: float = TIMEOUT, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(BABYSIT), *args], cwd=REPO, env=self.env(**env),
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def check_only_the_fake_ran(fake: Fake, log: str) -> None:
    """The babysitter runs the gcloud that PATH names (the fake), and every mutating call it logs reached it."""
    assert f"gcloud: {fake.dir / 'gcloud'}" in log
    recorded = [" ".join(c) for c in fake.calls()]
    for line in re.findall(r"^\[babysit [^]]+\] (?:creating|deleting)[^:]*: (\S+) (.*)$", log, re.M):
        assert line[0] == str(fake.dir / "gcloud")
        assert " ".join(line[1].split()) in recorded, line


def script(path: Path, body: str) -> str:
    """A command for the workers that takes the appended `--resume auto` as harmless arguments."""
    path.write_text(body + "\n")
    return f"bash {path}"


def weights(path: Path) -> Dict[str, torch.Tensor]:
    """The LoRA tensors of a final `lit_model.lora.safetensors`."""
    from lit_gpt.weights import load_weights

    return load_weights(path)


@pytest.fixture(scope="module")
def words(tmp_path_factory, forks):
    """The tiny word-level checkpoint and its prepared Alpaca data."""
    from fork_server import run_captured
    from words import alpaca_rows, make_word_checkpoint  # tests/words.py, a shared test helper
    tmp = tmp_path_factory.mktemp("babysit_words")
    tiny = make_word_checkpoint(tmp / "tiny-words")
    (tmp / "alpaca.json").write_text(json.dumps(alpaca_rows()))
    # forked from the fork server (tests/conftest.py `forks`): the data script without a fresh interpreter's imports
    prep = run_captured(
        forks, [str(REPO / "scripts/prepare_alpaca.py"), "--checkpoint_dir", str(tiny), "--data_file",
                str(tmp / "alpaca.json"), "--destination_path", str(tmp / "data"), "--val_split_fraction",
                str(4 / 44)], REPO, os.environ, timeout=TIMEOUT,
    )
    assert prep.returncode == 0, prep.stderr[-3000:]
    return tiny, tmp / "data"


def recipe_command(tiny: Path, data: Path, out_dir: Union[Path, str]) -> List[str]:
    """The training command as a user writes it after `--` (the environment selects XLA:CPU with 1 device)."""
    env = [f"{k}={v}" for k, v in XLA_ENV.items()]
    return ["env", *env, sys.executable, "xla/finetune/lora.py", "--checkpoint_dir", str(tiny), "--data.data_dir",
            str(data), "--out_dir", str(out_dir), *RECIPE_ARGS]


@pytest.mark.slow  # the babysitter's soak: the real recipe, 3 runs across preemptions (~45 s); the fault tables are fast
@pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed (pip install torch_xla==2.9.0)")
def test_babysat_recipe_survives_a_failed_creation_and_two_preemptions_bit_exactly(words, tmp_path):
    tiny, data = words
    bucket = tmp_path / "bucket"  # a local directory standing in for the bucket both runs write to
    # the uninterrupted reference runs meanwhile (the same command, --resume auto included, another out_dir)
    ref_cmd = recipe_command(tiny, data, bucket / "reference") + ["--resume", "auto"]
    with open(tmp_path / "reference.log", "w") as ref_log:
        reference = subprocess.Popen(ref_cmd, cwd=REPO, stdout=ref_log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
    try:
        out = bucket / "run"
        fake = Fake(tmp_path, REPO, create_failures=1, preempt_match="lora.py",
                    preempt_when=[str(out / "step-000002" / "lit_checkpoint.json"),
                                  str(out / "step-000004" / "lit_checkpoint.json")])
        setup = tmp_path / "setup.sh"
        setup.write_text(f"# runs on every worker after each creation\necho set up >> {tmp_path / 'setups.txt'}\n")
        t0 = time.perf_counter()
        # the babysat run writes to the "bucket" through fsspec (file:// like gs://: marker-last commits, no
        # renames); the reference writes to a plain folder: the two must still end with equal weights
        proc = fake.babysit(*TPU, "--spot", "true", "--setup_script", str(setup), *FAST, "--",
                            *recipe_command(tiny, data, f"file://{out}"))
        print(f"babysat run: {time.perf_counter() - t0:.1f} s")
        assert reference.wait(TIMEOUT) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    finally:
        if reference.poll() is None:
            reference.kill()
    log = proc.stderr
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{log[-5000:]}"
    check_only_the_fake_ran(fake, log)
    stamped = [line for line in log.splitlines() if line.startswith("[babysit ")]
    assert all(re.match(r"\[babysit \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ", line) for line in stamped)

    # one failed creation (no capacity), retried; then two preemptions, each followed by delete + create
    assert log.count("creation failed: ERROR:") == 1 and "no more capacity" in log
    assert "retrying in 0.2 s" in log
    assert len(re.findall(r"preempted: the slice my-tpu is PREEMPTED", log)) == 2, log
    creates = [c for c in fake.calls() if c[2:4] == ["tpu-vm", "create"]]
    assert len(creates) == 4 and all("--spot" in c for c in creates)  # 1 failed + first + 2 recreations
    assert sum(c[2:4] == ["tpu-vm", "delete"] for c in fake.calls()) == 2
    assert log.count("running the command:") == 3 and "--resume auto" in log
    assert (tmp_path / "setups.txt").read_text().splitlines() == ["set up"] * 3
    assert "the command finished: exit code 0" in log
    assert fake.state()["nodes"]["my-tpu"]["state"] == "READY"  # kept: no --delete_on_success
    # the runs really were cut short and resumed
    assert proc.stdout.count("Resumed from") == 2, proc.stdout[-3000:]
    # the training loop's heartbeat (lit_gpt/heartbeat.py): in the bucket, and on the worker for the babysitter
    beat = json.loads((out / "logs" / "heartbeat" / "rank-00000.json").read_text())
    assert beat["rank"] == 0 and beat["host"] and 0 <= beat["step"] <= 6
    assert json.loads((fake.home() / ".lit-gpt-babysit" / "my-tpu" / "heartbeat.json").read_text())["step"] == 6

    ref = weights(bucket / "reference" / "final" / "lit_model.lora.safetensors")
    got = weights(out / "final" / "lit_model.lora.safetensors")
    assert ref.keys() == got.keys() and ref
    for name in ref:
        assert torch.equal(ref[name], got[name]), (name, (ref[name] - got[name]).abs().max())


def test_retry_limit_gives_one_error_line(tmp_path):
    """Preempted on every run: after --max_restarts recreations it gives up with one line and exit 1."""
    fake = Fake(tmp_path, tmp_path, preempt_match="run.sh", preempt_repeat=True,
                preempt_when=[str(tmp_path / "started")])
    proc = fake.babysit(*TPU, "--max_restarts", "2", *FAST, "--",
                        script(tmp_path / "run.sh", f"touch {tmp_path / 'started'} && sleep 60"))
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost 3 times, more than --max_restarts 2" in errors[0], proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    assert proc.stderr.count("running the command:") == 3
    assert sum(c[2:4] == ["tpu-vm", "create"] for c in fake.calls()) == 3
    check_only_the_fake_ran(fake, proc.stderr)


def test_a_command_failing_on_a_healthy_slice_stops_at_once_with_its_exit_code(tmp_path):
    fake = Fake(tmp_path, tmp_path)
    proc = fake.babysit(*TPU, "--delete_on_success", "true", *FAST, "--", "python -c 'import sys; sys.exit(3)'")
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "exit code 3" in errors[0] and "not retrying" in errors[0], proc.stderr
    assert proc.stderr.count("running the command:") == 1
    assert [c[2:4] for c in fake.calls() if c[3] in ("create", "delete")] == [["tpu-vm", "create"]]
    assert fake.state()["nodes"]["my-tpu"]["state"] == "READY"
    # --resume auto was appended to the command that ran (detached: the job's script on the worker holds it)
    assert (fake.home() / ".lit-gpt-babysit" / "my-tpu" / "command.sh").read_text().strip() == \
        "python -c 'import sys; sys.exit(3)' --resume auto"


@pytest.mark.parametrize("sig, delete", [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["keeps", "delete_on_interrupt", "sigterm_keeps"])
def test_ctrl_c_stops_watching_and_deletes_only_when_asked(tmp_path, sig, delete):
    fake = Fake(tmp_path, tmp_path)
    marker = tmp_path / "running"
    args = [sys.executable, str(BABYSIT), *TPU, *FAST, "--delete_on_interrupt", str(delete).lower(), "--",
            script(tmp_path / "run.sh", f"touch {marker} && sleep 60 && touch {tmp_path / 'finished'}")]
    # Ctrl-C reaches a foreground process whose SIGINT is at its default; a suite started as a background job
    # (`pytest ... &` in a script, CI runners) ignores SIGINT, and a child inherits that: reset it for the child
    proc = subprocess.Popen(args, cwd=REPO, env=fake.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate(timeout=30)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and not (tmp_path / "finished").exists()
    deleted = any(c[2:4] == ["tpu-vm", "delete"] for c in fake.calls())
    assert deleted == delete
    assert ("my-tpu" in fake.state()["nodes"]) == (not delete)
    if not delete:  # the slice that is left and the exact command that deletes it
        assert "left as it is" in err, err
        assert f"delete it with: {fake.dir / 'gcloud'} {DELETE}" in err


def test_queued_spot_resource_waits_is_recreated_and_deleted_on_success(tmp_path):
    """A queued spot resource: waits through WAITING_FOR_RESOURCES, is preempted once (SUSPENDED), deleted with
    --force and requested again, and deleted after success with --delete_on_success."""
    fake = Fake(tmp_path, tmp_path, queue_waits=1, preempt_match="runs.sh", preempt_when=[str(tmp_path / "first")])
    command = script(tmp_path / "runs.sh", f"echo run >> {tmp_path / 'runs.txt'}\n"
                                           f"if [ ! -e {tmp_path}/first ]; then touch {tmp_path}/first; sleep 60; fi")
    proc = fake.babysit(*TPU, "--queued", "true", "--spot", "true", "--queued_resource", "my-request",
                        "--delete_on_success", "true", *FAST, "--", command)
    assert proc.returncode == 0, proc.stderr
    log = proc.stderr
    assert "queued resource WAITING_FOR_RESOURCES" in log
    assert "preempted: the slice my-tpu is queued resource SUSPENDED" in log
    creates = [c for c in fake.calls() if c[2:4] == ["queued-resources", "create"]]
    assert len(creates) == 2
    for c in creates:
        assert c[4] == "my-request" and c[c.index("--node-id") + 1] == "my-tpu" and "--spot" in c
        assert c[c.index("--runtime-version") + 1] == "tpu-ubuntu2204-base"
    deletes = [c for c in fake.calls() if c[2:4] == ["queued-resources", "delete"]]
    assert len(deletes) == 2 and all("--force" in c for c in deletes)
    assert fake.state()["queued"] == {} and fake.state()["nodes"] == {}
    assert (tmp_path / "runs.txt").read_text().splitlines() == ["run", "run"]
    check_only_the_fake_ran(fake, log)


def test_a_creation_gcloud_refuses_stops_at_once(tmp_path):
    """A usage or permission error is not a capacity problem: one error line, no retries."""
    fake = Fake(tmp_path, tmp_path, create_error="INVALID_ARGUMENT: Invalid accelerator type v4-7")
    proc = fake.babysit(*TPU, *FAST, "--", "true")
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "refused to create" in errors[0] and "v4-7" in errors[0], proc.stderr
    assert sum(c[2:4] == ["tpu-vm", "create"] for c in fake.calls()) == 1
    assert not any(c[2:4] == ["tpu-vm", "ssh"] for c in fake.calls())


# -- the fault table ---------------------------------------------------------------------------------------------
# Each case runs the babysitter's command line in this process (its `main`) against a fresh fake gcloud, with quick
# limits: a state query may take 10 s and is tried twice (0.05 s apart), one creation attempt. A case overrides them
# (the last flag wins). Placeholders: {tmp} is the case's folder, {gcloud} the fake's path. A case that sets PATH
# leaves out the system's folders: a real gcloud there must never run.
QUICK = ["--create_retry_delay", "0", "--poll_interval", "0.2", "--preemption_grace", "0", "--gcloud_timeout", "10",
         "--create_timeout", "10", "--gcloud_retries", "1", "--gcloud_backoff", "0.05", "--create_attempts", "1"]
LEFT = "is left as it is (READY HEALTHY); delete it with: {gcloud} " + DELETE


def case(id: str, *args: str, line: Optional[str] = None, code: int = 1, creates: int = 0, deletes: int = 0,
         nodes: tuple = (), no_leftover: bool = False, hangs: int = 0, command: str = "bash {tmp}/run.sh",
         run_sh: str = "true", setup: Optional[Union[str, bytes]] = None, path: Optional[str] = None,
         **fake) -> "pytest.param":
    """One row: the flags and fake (faults, starting nodes, ...), then what must come of it: the exit code, a part of
    the one error line (none: success), how many create and delete calls reached the fake, the TPU VMs left, whether
    the line must not name a leftover slice, and how many hung gcloud calls (each with a child) were killed."""
    return pytest.param(dict(args=args, line=line, code=code, creates=creates, deletes=deletes, nodes=set(nodes),
                             no_leftover=no_leftover, hangs=hangs, command=command, run_sh=run_sh, setup=setup,
                             path=path, fake=fake), id=id)


def describe_fault(**fault) -> dict:
    return {"faults": {"tpu-vm describe": fault}}


ARGUMENT_CASES = [
    case("name_not_a_resource_name", "--name", "My_TPU", line="--name 'My_TPU' is not a valid value"),
    case("zone_without_letter", "--zone", "us-central2", line="--zone 'us-central2' is not a valid value"),
    case("accelerator_type_malformed", "--accelerator_type", "v4_32", line="--accelerator_type 'v4_32'"),
    case("version_with_space", "--version", "tpu ubuntu", line="--version 'tpu ubuntu' is not a valid value"),
    case("project_malformed", "--project", "X!", line="--project 'X!' is not a valid value"),
    case("spot_and_preemptible", "--spot", "true", "--preemptible", "true", line="exclude each other"),
    case("best_effort_without_queued", "--best_effort", "true", line="--best_effort applies to queued resources"),
    case("best_effort_with_spot", "--queued", "true", "--best_effort", "true", "--spot", "true",
         line="excludes --spot"),
    case("queued_preemptible", "--queued", "true", "--preemptible", "true", line="queued resources take --spot"),
    case("queued_resource_without_queued", "--queued_resource", "req", line="pass --queued true with it"),
    case("max_restarts_negative", "--max_restarts", "-1", line="--max_restarts -1 is out of range"),
    case("poll_interval_zero", "--poll_interval", "0", line="--poll_interval 0.0 is out of range: give a number above"),
    case("create_timeout_negative", "--create_timeout", "-5", line="--create_timeout -5.0 is out of range"),
    case("gcloud_retries_too_many", "--gcloud_retries", "11", line="--gcloud_retries 11 is out of range"),
    case("create_attempts_zero", "--create_attempts", "0", line="--create_attempts 0 is out of range"),
    case("create_flags_set_the_zone", "--create_flags=--scopes x --zone=europe-west4-a", line="sets --zone, which"),
    case("create_flags_unbalanced_quote", "--create_flags", "--labels 'a=b", line="--create_flags is not a valid"),
    case("setup_script_missing", "--setup_script", "{tmp}/nope.sh", line="cannot read the setup script"),
    case("setup_script_is_a_folder", "--setup_script", "{tmp}", line="Is a directory"),
    case("setup_script_binary", setup=b"\x7fELF\x02\x01\x01\x00\xff\xfe", line="is not a text file"),
    case("setup_script_bad_bash", setup="if true; then echo x\n", line="is not valid bash"),
    case("command_unbalanced_quote", command="python train.py --out_dir 'gs://b", line="not a valid shell command"),
    case("command_bad_bash", command="python train.py )", line="is not valid bash"),
    case("command_empty", command=" ", line="no training command"),
    case("gcloud_not_on_path", path="{tmp}/empty", line="gcloud is not on PATH"),
    case("gcloud_not_executable", mode=0o644, path="{tmp}/bin", line="{gcloud} is not executable: chmod +x it"),
    case("gcloud_flag_a_folder", "--gcloud", "{tmp}", line="is not a file"),
    # found and executable, but it cannot start: the first state query (before any creation) says so
    case("gcloud_cannot_start", shebang="#!/nonexistent/python", line="cannot run {gcloud}"),
]
for row in ARGUMENT_CASES:
    row.values[0]["no_calls"] = True  # refused before the first gcloud call, not only before the first create

FAULT_CASES = [
    # state queries that fail before anything was created: no create call, nothing left
    case("describe_hangs", "--gcloud_timeout", "1", line="describe my-tpu --zone us-central2-b --format json` timed"
         " out after 1 s (2 tries)", hangs=2, no_leftover=True, **describe_fault(hang=True)),
    case("describe_hangs_once_then_answers", "--gcloud_timeout", "2", code=0, creates=1, nodes=["my-tpu"], hangs=1,
         **describe_fault(hang=True, times=1)),
    case("describe_fails", line="failed with exit code 1: ERROR: (gcloud.compute.tpus.tpu-vm.describe) UNAVAILABLE:"
         " try later (2 tries)", **describe_fault(exit=1, stderr="UNAVAILABLE: try later")),
    case("describe_prints_html", line="printed '<html><body>Sign in</body></html>', not the JSON it should",
         **describe_fault(stdout="<html><body>Sign in</body></html>\n")),
    case("describe_prints_a_list", line="printed '[]', not the JSON", **describe_fault(stdout="[]")),
    case("describe_prints_nothing", line="printed nothing, not the JSON", **describe_fault(stdout="")),
    case("describe_without_state", line="""printed '{"name": "my-tpu"}'""",
         **describe_fault(stdout='{"name": "my-tpu"}')),
    case("describe_prints_binary", line="not the JSON it should", **describe_fault(stdout_hex="fffe00017f")),
    case("queued_describe_wrong_shape", "--queued", "true", "--spot", "true", line="""printed '{"state": {}}'""",
         faults={"queued-resources describe": {"stdout": '{"state": {}}'}}),
    # creations that fail or hang, with or without making the slice
    case("create_fails_after_making_the_slice", line="could not create the slice my-tpu in 1 attempts (last: ERROR:"
         " (gcloud.compute.tpus.tpu-vm.create) INTERNAL: backend error)", creates=1, deletes=1, no_leftover=True,
         faults={"tpu-vm create": {"act": True, "stderr": "INTERNAL: backend error"}}),
    case("create_refused_after_making_the_slice", line="refused to create the slice my-tpu: ERROR:"
         " (gcloud.compute.tpus.tpu-vm.create) PERMISSION_DENIED: no quota; the slice my-tpu " + LEFT, creates=1,
         nodes=["my-tpu"], faults={"tpu-vm create": {"act": True, "stderr": "PERMISSION_DENIED: no quota"}}),
    case("create_refused_after_making_the_slice_delete_on_error", "--delete_on_error", "true",
         line="refused to create the slice my-tpu: ERROR: (gcloud.compute.tpus.tpu-vm.create) PERMISSION_DENIED: no"
         " quota; the slice my-tpu was deleted (--delete_on_error)", creates=1, deletes=1, no_leftover=True,
         faults={"tpu-vm create": {"act": True, "stderr": "PERMISSION_DENIED: no quota"}}),
    case("create_hangs_after_making_the_slice", "--create_timeout", "1.5", code=0, creates=1, nodes=["my-tpu"],
         hangs=1, faults={"tpu-vm create": {"act": True, "hang": True}}),
    case("create_hangs_without_a_slice", "--create_timeout", "1", line="could not create the slice my-tpu in 1"
         " attempts (last: `gcloud compute tpus tpu-vm create my-tpu --zone us-central2-b --accelerator-type v4-8"
         " --version tpu-ubuntu2204-base` timed out after 1 s (--create_timeout))", creates=1, hangs=1,
         no_leftover=True, faults={"tpu-vm create": {"hang": True}}),
    # errors after the slice was made: the line names it and the command that deletes it, or it is deleted
    case("describe_junk_while_the_command_runs", run_sh="sleep 30; touch {tmp}/finished",
         line="printed 'Traceback (most recent call last): oops', not the JSON it should (2 tries): is {gcloud} the"
         " Google Cloud CLI?; the command goes on running on the workers (re-attach with --attach true); the slice"
         " my-tpu " + LEFT, creates=1, nodes=["my-tpu"],
         **describe_fault(stdout="Traceback (most recent call last):\n  oops\n", skip=2)),
    case("describe_fails_while_the_command_runs_delete_on_error", "--delete_on_error", "true",
         run_sh="sleep 30; touch {tmp}/finished", line="UNAVAILABLE: try later (2 tries): run it by hand to see why;"
         " the slice my-tpu was deleted (--delete_on_error)", creates=1, deletes=1, no_leftover=True,
         **describe_fault(stderr="UNAVAILABLE: try later", skip=2, times=2)),
    case("delete_hangs_on_a_preempted_slice", "--create_timeout", "0.5", line="could not delete the slice my-tpu: it"
         " is still PREEMPTED after 3 deletes of up to --create_timeout 0.5 s each; the slice my-tpu is left as it is"
         " (PREEMPTED); delete it with: {gcloud} " + DELETE, deletes=3, hangs=3, nodes=["my-tpu"],
         nodes_at_start={"my-tpu": {"state": "PREEMPTED", "health": ""}}, faults={"tpu-vm delete": {"hang": True}}),
    case("setup_script_runs_too_long", "--setup_timeout", "1", setup="sleep 30", line="the setup script ran longer"
         " than --setup_timeout 1 s on the slice my-tpu: ended it; make it finish sooner or raise --setup_timeout;"
         " the slice my-tpu " + LEFT, creates=1, nodes=["my-tpu"]),
    case("ssh_never_connects", "--ssh_retries", "1", line="cannot reach the workers of the slice my-tpu over ssh"
         " (starting the command): `gcloud compute tpus tpu-vm ssh my-tpu --zone us-central2-b --worker=all` failed"
         " with exit code 255: ERROR: (gcloud.compute.tpus.tpu-vm.ssh) ssh: connect to host 10.130.0.7 port 22:"
         " Connection timed out (2 tries, --ssh_retries 1)", creates=1, nodes=["my-tpu"],
         faults={"tpu-vm ssh": {"exit": 255, "stderr": "ssh: connect to host 10.130.0.7 port 22: Connection timed"
                                                     " out"}}),
    case("attach_without_a_job", "--attach", "true", line="--attach: no job on the slice my-tpu (no worker has"
         " ~/.lit-gpt-babysit/my-tpu): run the babysitter without --attach true to start it; the slice my-tpu " + LEFT,
         nodes=["my-tpu"], nodes_at_start={"my-tpu": {"state": "READY", "health": "HEALTHY"}}),
    case("command_fails_delete_on_error", "--delete_on_error", "true", run_sh="exit 3", code=3,
         line="the command failed with exit code 3 on worker 0 (the other workers' jobs were stopped) while the slice"
         " my-tpu is healthy (READY HEALTHY): not a preemption, not retrying; each worker's log:"
         " ~/.lit-gpt-babysit/my-tpu/log; the slice my-tpu was deleted (--delete_on_error)", creates=1, deletes=1),
]


@pytest.fixture(scope="module")
def babysit_main():
    """The babysitter's command line, loaded once into this process."""
    spec = importlib.util.spec_from_file_location("babysit_script", BABYSIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def alive(pid: int, wait: float = 2.0) -> bool:
    """Is the process still running after up to `wait` s (a SIGKILLed process takes a moment to exit; a zombie whose
    parent was killed counts as dead)?"""
    deadline = time.monotonic() + wait
    while True:
        try:
            running = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.02)


@pytest.mark.parametrize("row", ARGUMENT_CASES + FAULT_CASES)
def test_fault_table(row, tmp_path, babysit_main, monkeypatch, capfd):
    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{gcloud}", str(tmp_path / "bin" / "gcloud"))

    fake_args = dict(row["fake"])
    if "nodes_at_start" in fake_args:
        fake_args["nodes"] = fake_args.pop("nodes_at_start")
    fake = Fake(tmp_path, tmp_path, **fake_args)
    (tmp_path / "empty").mkdir()
    (tmp_path / "run.sh").write_text(fill(row["run_sh"]) + "\n")
    setup = []
    if row["setup"] is not None:
        data = row["setup"] if isinstance(row["setup"], bytes) else row["setup"].encode()
        (tmp_path / "setup.sh").write_bytes(data)
        setup = ["--setup_script", str(tmp_path / "setup.sh")]
    monkeypatch.setenv("PATH", fill(row["path"]) if row["path"] else f"{fake.dir}{os.pathsep}{os.environ['PATH']}")
    args = [*TPU, *QUICK, *setup, *(fill(a) for a in row["args"]), "--", fill(row["command"])]
    try:
        babysit_main(args)
        code = 0
    except SystemExit as e:  # anything else (a traceback) fails the test
        code = e.code
    err = capfd.readouterr().err
    assert code == row["code"], err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if row["line"] is None:
        assert not errors, err
    else:
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
        assert fill(row["line"]) in errors[0], err
        if row["no_leftover"]:
            assert "delete it with" not in errors[0] and "may exist" not in errors[0]
    assert "Traceback (most recent call last):\n  File" not in err
    assert fake.count("create") == row["creates"], fake.calls()
    assert not (row.get("no_calls") and fake.calls()), fake.calls()
    assert fake.count("delete") == row["deletes"], fake.calls()
    assert fake.nodes() == row["nodes"]
    # every hung gcloud call was killed with its whole process group
    hung = (fake.dir / "hung.pids").read_text().split() if (fake.dir / "hung.pids").exists() else []
    assert len(hung) == 2 * row["hangs"] and not any(alive(int(pid)) for pid in hung), hung
    assert not (tmp_path / "finished").exists()  # a command stopped by an error does not go on


# -- the detached job: transient ssh failures, a stalled job, a failing worker, a killed babysitter ------------------
# quick limits for these: ssh retried after 0.05 s, 0.1 s, ...; the slice and the job polled every 0.2 s
JOB = ["--create_retry_delay", "0", "--poll_interval", "0.2", "--preemption_grace", "0.5", "--gcloud_backoff", "0.05"]


def pid_alive(path: Path) -> bool:
    """Is the process whose pid a job wrote into `path` still running?"""
    return alive(int(path.read_text()), wait=0.5)


@pytest.mark.slow  # stand-in workers run a real detached job: 3-5 s each (tests/README.md)
@pytest.mark.parametrize("code, message", [
    (255, "ssh: connect to host 10.130.0.7 port 22: Connection refused"),  # workers still booting
    (1, "UNAVAILABLE: The service is currently unavailable."),  # gcloud's transient errors
    (1, "DEADLINE_EXCEEDED: Deadline expired before operation could complete."),
    (255, "Connection reset by 10.130.0.7 port 22"),
], ids=["exit_255", "unavailable", "deadline_exceeded", "connection_reset"])
def test_ssh_failing_transiently_is_retried_with_backoff(tmp_path, code, message):
    """ssh fails twice (exit 255 while the workers boot, gcloud's UNAVAILABLE / DEADLINE_EXCEEDED, a reset
    connection): tried again, the command runs once and the run succeeds."""
    fake = Fake(tmp_path, tmp_path, faults={"tpu-vm ssh": {"times": 2, "exit": code, "stderr": message}})
    proc = fake.babysit(*TPU, *JOB, "--", script(tmp_path / "run.sh", f"echo run >> {tmp_path / 'runs.txt'}"),
                        timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    retries = re.findall(rf"ssh to the workers of my-tpu \(starting the command\) failed with exit code {code}: .*"
                         rf"{re.escape(message)}; trying again in (\S+) s \((\d)/6, --ssh_retries\)", proc.stderr)
    assert retries == [("0.05", "1"), ("0.1", "2")], proc.stderr
    assert (tmp_path / "runs.txt").read_text().splitlines() == ["run"]
    assert "the command finished: exit code 0 on every worker" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow  # stand-in workers run a real detached job: 3-5 s each (tests/README.md)
def test_a_stalled_job_is_restarted_from_the_newest_intact_step(tmp_path):
    """The first run's heartbeat stops at step 3 while its process lives on (a hang): after --stall_timeout the
    babysitter says so in one line, stops it and starts the command again, which resumes and finishes."""
    fake = Fake(tmp_path, tmp_path)
    body = f"""echo "args: $*"
if [ ! -e {tmp_path}/first ]; then
  touch {tmp_path}/first; echo $$ > {tmp_path}/hung.pid
  for s in 1 2 3; do
    echo "{{\\"step\\": $s, \\"time\\": 0, \\"host\\": \\"w0\\"}}" > "$LIT_GPT_HEARTBEAT"; sleep 0.1
  done
  echo "step 3: waiting in a collective"; sleep 60
fi
echo "{{\\"step\\": 4, \\"time\\": 0, \\"host\\": \\"w0\\"}}" > "$LIT_GPT_HEARTBEAT"; echo "resumed and finished"
"""
    proc = fake.babysit(*TPU, *JOB, "--stall_timeout", "1.5", "--", script(tmp_path / "run.sh", body), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    stalled = [line for line in proc.stderr.splitlines() if "] stalled" in line]
    assert len(stalled) == 1, proc.stderr
    assert re.search(r"stalled: worker 0 wrote no heartbeat for --stall_timeout 1.5 s \(last: step 3 on w0\): stopping"
                     r" it and restarting the command on the slice my-tpu from the newest intact step \(--resume auto;"
                     r" restart 1, --max_restarts 20\)$", stalled[0]), stalled[0]
    assert "[worker 0] step 3: waiting in a collective" in proc.stderr  # its last log lines are shown
    assert not pid_alive(tmp_path / "hung.pid")  # the hung job was stopped, not left beside the new one
    assert proc.stdout.count("args: --resume auto") == 2 and "resumed and finished" in proc.stdout
    assert sum(c[2:4] == ["tpu-vm", "create"] for c in fake.calls()) == 1  # the same slice: no recreation


@pytest.mark.slow  # stand-in workers run a real detached job: 3-5 s each (tests/README.md)
def test_a_worker_exiting_non_zero_stops_the_others(tmp_path):
    """Worker 1 of 2 fails: worker 0's job (which would wait for it forever) is stopped, and the one error line
    names the worker and its exit code."""
    fake = Fake(tmp_path, tmp_path, workers=2)
    body = f"""if [ "$TPU_WORKER_ID" = 1 ]; then sleep 0.3; echo "worker 1: CUDA-free but broken" >&2; exit 3; fi
echo $$ > {tmp_path}/worker0.pid; sleep 60; touch {tmp_path}/finished"""
    proc = fake.babysit(*TPU, *JOB, "--", script(tmp_path / "run.sh", body), timeout=TIMEOUT)
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr
    assert "the command failed with exit code 3 on worker 1 (the other workers' jobs were stopped) while the slice" \
           " my-tpu is healthy (READY HEALTHY): not a preemption, not retrying" in errors[0]
    assert "worker 1 failed with exit code 3: stopping the job on the other workers" in proc.stderr
    assert "[worker 1] worker 1: CUDA-free but broken" in proc.stderr
    assert not pid_alive(tmp_path / "worker0.pid") and not (tmp_path / "finished").exists()
    assert (fake.home(1) / ".lit-gpt-babysit" / "my-tpu" / "exit").read_text().strip() == "3"
    assert (fake.home(0) / ".lit-gpt-babysit" / "my-tpu" / "stopped").exists()


@pytest.mark.slow  # stand-in workers run a real detached job: 3-5 s each (tests/README.md)
def test_a_killed_babysitter_leaves_training_running_and_attach_picks_it_up(tmp_path):
    """SIGKILL the babysitter mid-run: the detached job goes on; `--attach true` finds it running, watches it to
    the end without creating, setting up or starting anything, and shows its log."""
    fake = Fake(tmp_path, tmp_path)
    release = tmp_path / "release"
    body = f"""echo run >> {tmp_path}/runs.txt; echo $$ > {tmp_path}/job.pid
while [ ! -e {release} ]; do echo tick; sleep 0.1; done; echo "the run is complete\""""
    setup = tmp_path / "setup.sh"
    setup.write_text(f"echo set up >> {tmp_path / 'setups.txt'}\n")
    args = [sys.executable, str(BABYSIT), *TPU, *JOB, "--setup_script", str(setup), "--",
            script(tmp_path / "run.sh", body)]
    first = subprocess.Popen(args, cwd=REPO, env=fake.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT
    while not (tmp_path / "job.pid").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.kill()  # no handler runs: like a closed laptop or a killed terminal
    first.wait(10)
    assert pid_alive(tmp_path / "job.pid")  # training goes on without its babysitter
    with open(tmp_path / "attach.out", "w") as out, open(tmp_path / "attach.err", "w") as err:
        second = subprocess.Popen(args[:2] + ["--attach", "true"] + args[2:], cwd=REPO, env=fake.env(), stdout=out,
                                  stderr=err, stdin=subprocess.DEVNULL)
        try:  # the run ends once the new babysitter watches it
            deadline = time.monotonic() + TIMEOUT
            while "attached to the job" not in (tmp_path / "attach.err").read_text() and second.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            release.touch()
            second.wait(TIMEOUT)
        finally:
            second.kill()
    proc = subprocess.CompletedProcess(second.args, second.returncode, (tmp_path / "attach.out").read_text(),
                                       (tmp_path / "attach.err").read_text())
    assert "attached to the job on the slice my-tpu (worker 0 running)" in proc.stderr, proc.stderr
    assert "the command finished: exit code 0 on every worker" in proc.stderr
    assert "tick" in proc.stdout and "the run is complete" in proc.stdout
    assert (tmp_path / "runs.txt").read_text().splitlines() == ["run"]  # not started again
    assert (tmp_path / "setups.txt").read_text().splitlines() == ["set up"]
    assert sum(c[2:4] == ["tpu-vm", "create"] for c in fake.calls()) == 1


# -- what a stall shows (py-spy stacks, or the logs) and each worker's log in a bucket --out_dir: the workers' scripts
# run directly with bash here (fast), a stand-in `py-spy` and the fake gcloud's `storage cp` on PATH ---------------
def worker_job(home: Path, job: str = "my-tpu") -> Path:
    """A worker's job folder (~/.lit-gpt-babysit/JOB) with a 30-line log."""
    folder = home / ".lit-gpt-babysit" / job
    folder.mkdir(parents=True)
    (folder / "worker").write_text("0\n")
    (folder / "log").write_text("".join(f"step {i}\n" for i in range(30)))
    return folder


def on_worker(script_text: str, home: Path, path: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "TPU_WORKER_ID": "0", "PATH": path}
    return subprocess.run(["bash", "-c", script_text], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def path_without_py_spy(*first: Path) -> str:
    """PATH with `first` in front and no folder that holds a real py-spy (whether this machine has one or not)."""
    folders = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "py-spy").exists()]
    return os.pathsep.join([*map(str, first), *folders])


def test_a_stall_shows_the_py_spy_stacks_of_the_jobs_python_processes_where_installed(tmp_path):
    from lit_gpt.xla.gcloud import collect_script

    folder = worker_job(tmp_path / "home")
    spy = tmp_path / "bin" / "py-spy"
    spy.parent.mkdir()
    spy.write_text('#!/bin/sh\necho "py-spy $*"\necho \'Thread 7 (idle): "MainThread"\'\n'
                   'echo "    all_reduce (torch_xla/core/xla_model.py:588)"\n')
    spy.chmod(0o755)
    # the hung job: a Python process leading its own process group, as `nohup setsid` starts it
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (folder / "pid").write_text(f"{job.pid}\n")
        proc = on_worker(collect_script("my-tpu"), tmp_path / "home", path_without_py_spy(spy.parent), tmp_path)
    finally:
        job.kill()
        job.wait()
    lines = proc.stdout.splitlines()
    assert lines[0] == "LITBS 0 collected", proc.stdout
    assert lines[1:21] == [f"[worker 0] step {i}" for i in range(10, 30)]  # the last 20 log lines
    assert lines[21:] == [f"[worker 0 stack] py-spy dump --pid {job.pid}",
                          '[worker 0 stack] Thread 7 (idle): "MainThread"',
                          "[worker 0 stack]     all_reduce (torch_xla/core/xla_model.py:588)"], proc.stdout


def test_without_py_spy_a_stall_shows_the_logs_and_says_how_to_get_stacks(tmp_path):
    from lit_gpt.xla.gcloud import collect_script

    (worker_job(tmp_path / "home") / "pid").write_text(f"{os.getpid()}\n")
    proc = on_worker(collect_script("my-tpu"), tmp_path / "home", path_without_py_spy(), tmp_path)
    lines = proc.stdout.splitlines()
    assert lines[1:21] == [f"[worker 0] step {i}" for i in range(10, 30)], proc.stdout
    assert lines[21:] == ["[worker 0] no Python stacks: py-spy is not installed on this worker (add pip install py-spy"
                          " to the setup script)"], proc.stdout


def test_each_workers_log_is_copied_to_a_bucket_out_dir(tmp_path):
    """The detached job's wrapper copies the worker's log to OUT_DIR/logs/babysit/worker-N.log (here at its end; every
    minute while it runs) with `gcloud storage cp`, and nothing is copied for a local --out_dir."""
    from lit_gpt.xla.gcloud import launch_script

    fake = Fake(tmp_path, tmp_path)
    path = f"{fake.dir}{os.pathsep}{os.environ['PATH']}"
    for job, url in (("to-bucket", "gs://my-lit-bucket/runs/lora"), ("local", "")):
        home = tmp_path / "home"
        proc = on_worker(launch_script(job, "echo training; echo 'a warning' >&2", url), home, path, tmp_path)
        assert re.fullmatch(r"LITBS 0 launched \d+ 0\n", proc.stdout), proc.stdout + proc.stderr
        done = home / ".lit-gpt-babysit" / job / "exit"
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.read_text().strip() == "0"
    log = home / ".lit-gpt-babysit" / "to-bucket" / "log"
    assert "training\na warning\n" in log.read_text()
    copied = fake.dir / "buckets" / "my-lit-bucket" / "runs" / "lora" / "logs" / "babysit" / "worker-0.log"
    assert copied.read_text() == log.read_text()
    assert [c for c in fake.calls() if c[:1] == ["storage"]] == [
        ["storage", "cp", "-q", str(log), "gs://my-lit-bucket/runs/lora/logs/babysit/worker-0.log"]]


@pytest.mark.slow  # stand-in workers run a real detached job: 3-5 s (tests/README.md)
def test_a_bucket_out_dir_gets_every_workers_log_through_the_babysitter(tmp_path):
    """The babysitter passes the command's gs:// --out_dir to the workers' jobs: each of 2 workers' logs lands in the
    bucket's logs/babysit/ folder."""
    fake = Fake(tmp_path, tmp_path, workers=2)
    body = 'echo "worker $TPU_WORKER_ID trained"'
    proc = fake.babysit(*TPU, *JOB, "--", script(tmp_path / "run.sh", body) + " --out_dir gs://my-lit-bucket/runs/x",
                        timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    folder = fake.dir / "buckets" / "my-lit-bucket" / "runs" / "x" / "logs" / "babysit"
    for w in (0, 1):
        assert f"worker {w} trained\n" in (folder / f"worker-{w}.log").read_text()


def test_a_job_that_ends_between_the_status_checks_is_exited_not_vanished(tmp_path):
    """The status script checks the exit file, then whether the job's process runs: a job that writes its exit code
    and ends in between was reported "vanished", and the babysitter restarted a finished run (seen in the slow
    suite under load: the command ran twice). `ps` here ends the job at exactly that moment."""
    from lit_gpt.xla.gcloud import JOB_ROOT, status_script

    folder = tmp_path / "home" / JOB_ROOT / "job"
    folder.mkdir(parents=True)
    (folder / "worker").write_text("0\n")
    (folder / "pid").write_text("12345\n")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ps").write_text(f'#!/bin/sh\necho 0 > "{folder}/exit"\nexit 1\n')  # ends now: no such process
    (fake_bin / "ps").chmod(0o755)
    proc = subprocess.run(["bash", "-c", status_script("job", 0)], capture_output=True, text=True, timeout=30,
                          env={"HOME": str(tmp_path / "home"), "PATH": f"{fake_bin}:/usr/bin:/bin"})
    assert proc.stdout.split()[:4] == ["LITBS", "0", "exited", "0"], proc.stdout + proc.stderr
