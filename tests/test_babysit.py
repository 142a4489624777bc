"""xla/scripts/babysit.py against a fake `gcloud` (first on PATH; the real one is never run, nothing reaches the
network).

The fake keeps the TPU VMs and queued resources in a JSON file next to itself. `create` fails with "no more
capacity" as often as the scenario says; `ssh --worker=all --command CMD` runs CMD here with bash (the real recipe),
and preempts the slice in the middle of a run: when a trigger file appears (a checkpoint's commit marker) it
SIGKILLs the command, marks the node PREEMPTED (its queued resource SUSPENDED) and exits 255 like an ssh session
whose VM vanished.

The main test babysits the real `xla/finetune/lora.py` (LoRA with dropout, XLA:CPU, 1 device) through one failed
creation and two preemptions (after the step-2 and step-4 checkpoints); the final LoRA weights must be bit-identical
to an uninterrupted run of the same command, which runs meanwhile. The others use shell commands: the retry limit,
a failure on a healthy slice, Ctrl-C, and a queued spot resource.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BABYSIT = REPO / "xla" / "scripts" / "babysit.py"
TIMEOUT = 300
HAS_XLA = importlib.util.find_spec("torch_xla") is not None

FAKE_GCLOUD = r'''
import fcntl, json, os, signal, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATE, SCENARIO = HERE / "state.json", json.loads((HERE / "scenario.json").read_text())


class Locked:
    """Read-modify-write of the state file under a lock (describe polls while ssh preempts)."""
    def __enter__(self):
        self.lock = open(HERE / "state.lock", "w")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.state = json.loads(STATE.read_text()) if STATE.exists() else {
            "nodes": {}, "queued": {}, "create_failures": SCENARIO.get("create_failures", 0),
            "preempt_when": SCENARIO.get("preempt_when", [])}
        return self.state
    def __exit__(self, *exc):
        STATE.with_suffix(".tmp").write_text(json.dumps(self.state))
        os.replace(STATE.with_suffix(".tmp"), STATE)
        self.lock.close()


def happened(trigger):
    """A trigger file exists; a JSON one (a checkpoint's marker) also holds its whole content: the fake preempts
    after the commit, not while the marker is being written (file:// writes it in place)."""
    path = Path(trigger)
    if not path.exists():
        return False
    if path.suffix != ".json":
        return True
    try:
        json.loads(path.read_text())
        return True
    except ValueError:
        return False


def fail(message, code=1):
    print(f"ERROR: (gcloud.compute.tpus.{'.'.join(cmd)}) {message}", file=sys.stderr)
    sys.exit(code)


def flag(name, default=None):
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


argv = sys.argv[1:]
with open(HERE / "calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\n")
if argv and argv[0] == "alpha":
    argv = argv[1:]
if argv[:2] != ["compute", "tpus"] or len(argv) < 5:
    sys.exit(f"fake gcloud: unexpected command {argv}")
cmd, name, args = argv[2:4], argv[4], argv[5:]
not_found = f"NOT_FOUND: Resource 'projects/p/locations/{flag('--zone')}/x/{name}' was not found"
assert flag("--zone"), "every command names the zone"

if cmd == ["tpu-vm", "create"] or cmd == ["queued-resources", "create"]:
    with Locked() as s:
        if SCENARIO.get("create_error"):
            fail(SCENARIO["create_error"])
        if s["create_failures"] > 0:
            s["create_failures"] -= 1
            fail('{"code": 8, "message": "There is no more capacity in the zone; you can try in another zone"}')
        node = flag("--node-id", name)
        if node in s["nodes"] or name in s["queued"]:
            fail(f"ALREADY_EXISTS: {name}")
        tier = "spot" if "--spot" in args else "preemptible" if "--preemptible" in args else \
            "best-effort" if "--best-effort" in args else "on-demand"
        if cmd[0] == "queued-resources":
            s["queued"][name] = {"state": "WAITING_FOR_RESOURCES", "node": node, "tier": tier,
                                 "waits": SCENARIO.get("queue_waits", 0)}
        else:
            s["nodes"][name] = {"state": "READY", "health": "HEALTHY", "tier": tier}
elif cmd == ["tpu-vm", "describe"] or cmd == ["queued-resources", "describe"]:
    with Locked() as s:
        if cmd[0] == "queued-resources":
            qr = s["queued"].get(name)
            if qr is None:
                fail(not_found)
            if qr["state"] == "WAITING_FOR_RESOURCES":
                qr["waits"] -= 1
                if qr["waits"] < 0:  # capacity came: the node exists
                    qr["state"] = "ACTIVE"
                    s["nodes"][qr["node"]] = {"state": "READY", "health": "HEALTHY", "tier": qr["tier"]}
            print(json.dumps({"name": name, "state": {"state": qr["state"]}}))
        else:
            if name not in s["nodes"]:
                fail(not_found)
            print(json.dumps({"name": name, **s["nodes"][name]}))
elif cmd == ["tpu-vm", "delete"] or cmd == ["queued-resources", "delete"]:
    with Locked() as s:
        if cmd[0] == "queued-resources":
            if name not in s["queued"]:
                fail(not_found)
            s["nodes"].pop(s["queued"].pop(name)["node"], None)
        elif s["nodes"].pop(name, None) is None:
            fail(not_found)
elif cmd == ["tpu-vm", "ssh"]:
    assert flag("--worker") == "all", args
    with Locked() as s:
        node = s["nodes"].get(name, {})
    if node.get("state") != "READY":
        print(f"ssh: connect to host {name} port 22: Connection timed out", file=sys.stderr)
        sys.exit(255)
    command = flag("--command")
    # the babysitter ends a session with SIGTERM: take the remote command down too, like a closed connection.
    # SIGTERM stays blocked until the handler knows the command, so none can end this fake alone and leave the
    # command (in a session of its own) running with the babysitter's output pipes
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    proc = subprocess.Popen(["bash", "-c", command], cwd=SCENARIO["workdir"], start_new_session=True)
    signal.signal(signal.SIGTERM, lambda *a: (os.killpg(proc.pid, signal.SIGKILL), sys.exit(143)))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    watched = SCENARIO.get("preempt_match", "") in command
    while proc.poll() is None:
        time.sleep(0.05)
        with Locked() as s:
            triggers = s["preempt_when"]
            if not (watched and triggers and happened(triggers[0])):
                continue
            os.killpg(proc.pid, signal.SIGKILL)  # the VM is gone, and its processes with it
            proc.wait()
            if not SCENARIO.get("preempt_repeat"):
                triggers.pop(0)
            s["nodes"][name].update(state="PREEMPTED", health="")
            for qr in s["queued"].values():
                if qr["node"] == name:
                    qr["state"] = "SUSPENDED"
        print(f"Connection to {name} closed by remote host.", file=sys.stderr)
        sys.exit(255)
    sys.exit(proc.returncode)
else:
    sys.exit(f"fake gcloud: unexpected command {argv}")
'''

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


class Fake:
    """A directory holding the fake gcloud, its scenario, state and call record."""

    def __init__(self, root: Path, workdir: Path, **scenario) -> None:
        self.dir = root / "bin"
        self.dir.mkdir(parents=True)
        gcloud = self.dir / "gcloud"
        gcloud.write_text(f"#!{sys.executable}\n" + FAKE_GCLOUD)
        gcloud.chmod(0o755)
        (self.dir / "scenario.json").write_text(json.dumps({"workdir": str(workdir), **scenario}))

    def env(self, **extra: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_", "CPU_NUM"))}
        env.update(PATH=f"{self.dir}{os.pathsep}{env.get('PATH', '')}", **extra)
        return env

    def state(self) -> dict:
        return json.loads((self.dir / "state.json").read_text())

    def calls(self) -> List[List[str]]:
        return [json.loads(line) for line in (self.dir / "calls.jsonl").read_text().splitlines()]

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
def words(tmp_path_factory):
    """The tiny word-level checkpoint and its prepared Alpaca data."""
    from words import alpaca_rows, make_word_checkpoint  # tests/words.py, a shared test helper
    tmp = tmp_path_factory.mktemp("babysit_words")
    tiny = make_word_checkpoint(tmp / "tiny-words")
    (tmp / "alpaca.json").write_text(json.dumps(alpaca_rows()))
    prep = subprocess.run(
        [sys.executable, str(REPO / "scripts/prepare_alpaca.py"), "--checkpoint_dir", str(tiny), "--data_file",
         str(tmp / "alpaca.json"), "--destination_path", str(tmp / "data"), "--val_split_fraction", str(4 / 44)],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert prep.returncode == 0, prep.stderr[-3000:]
    return tiny, tmp / "data"


def recipe_command(tiny: Path, data: Path, out_dir: Union[Path, str]) -> List[str]:
    """The training command as a user writes it after `--` (the environment selects XLA:CPU with 1 device)."""
    env = [f"{k}={v}" for k, v in XLA_ENV.items()]
    return ["env", *env, sys.executable, "xla/finetune/lora.py", "--checkpoint_dir", str(tiny), "--data.data_dir",
            str(data), "--out_dir", str(out_dir), *RECIPE_ARGS]


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
    # --resume auto was appended to the command that ran
    ssh = [c for c in fake.calls() if c[2:4] == ["tpu-vm", "ssh"]]
    assert ssh[0][ssh[0].index("--command") + 1] == "python -c 'import sys; sys.exit(3)' --resume auto"


@pytest.mark.parametrize("delete", [False, True], ids=["keeps", "delete_on_interrupt"])
def test_ctrl_c_stops_watching_and_deletes_only_when_asked(tmp_path, delete):
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
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and not (tmp_path / "finished").exists()
    deleted = any(c[2:4] == ["tpu-vm", "delete"] for c in fake.calls())
    assert deleted == delete
    assert ("my-tpu" in fake.state()["nodes"]) == (not delete)
    if not delete:
        assert "left as it is" in err and "gcloud compute tpus tpu-vm delete my-tpu" in err


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
