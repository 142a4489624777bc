"""Launchers fail fast (`lit_gpt.launch`): several processes without the environment a launcher sets are refused in one
line before anything is loaded; the wait for the other processes has a timeout that ends in one line; Ctrl-C (or
SIGTERM) during that wait ends the process at once. And the CLI's lines for interrupts (`lit_gpt.utils.cli`)."""

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import pytest

from child_env import python_path
from lit_gpt.launch import check_launcher, strategy_timeout
from lit_gpt.utils import Interrupted, LitError, cli

TORCHRUN_2x1 = {"TORCHELASTIC_RUN_ID": "r", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "0"}
MANUAL = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}
SRUN_2x2 = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train"}


@dataclass
class Setting:
    id: str
    num_nodes: int
    devices: int
    env: Dict[str, str] = field(default_factory=dict)
    line: Optional[str] = None
    """A substring of the refusal; None: the setting passes."""
    accelerator: str = "cpu"


SETTINGS = [
    # refused: what is missing, and the command to run instead
    Setting("two-nodes-no-env", 2, 1, {},
            "--num_nodes 2 --devices 1 needs every process started by a launcher (MASTER_ADDR, MASTER_PORT, NODE_RANK"
            " not set): on each machine run `torchrun --nnodes 2 --node_rank MACHINE_RANK --master_addr FIRST_MACHINE"
            " --master_port 29500 --nproc_per_node 1"),
    Setting("two-nodes-partial-env", 2, 4, {"MASTER_ADDR": "10.0.0.1"}, "(MASTER_PORT, NODE_RANK not set)"),
    Setting("two-nodes-no-rank", 2, 1, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "(NODE_RANK not set)"),
    Setting("node-rank-out-of-range", 2, 1, {**MANUAL, "NODE_RANK": "2"},
            "NODE_RANK=2 is out of range for --num_nodes (0..1)"),
    Setting("bad-port", 2, 1, {**MANUAL, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a whole number"),
    Setting("by-hand-without-port", 1, 2, {"LOCAL_RANK": "1"}, "(MASTER_PORT not set)"),
    Setting("torchrun-partial", 2, 1, {"TORCHELASTIC_RUN_ID": "r", "MASTER_ADDR": "10.0.0.1"},
            "TORCHELASTIC_RUN_ID is set but RANK, LOCAL_RANK, WORLD_SIZE, MASTER_PORT not: start the command with"
            " torchrun itself"),
    Setting("torchrun-other-world", 1, 1, TORCHRUN_2x1,
            "torchrun started 2 processes (1 per machine) but --devices 1 x --num_nodes 1 asks for 1: pass --devices 1"
            " --num_nodes 2"),
    Setting("srun-missing-ids", 2, 2, {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2"},
            "SLURM_NTASKS is set but SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID not set: start every process with"
            " `srun --nodes 2 --ntasks-per-node 2"),
    Setting("srun-other-counts", 1, 2, SRUN_2x2, "SLURM started 4 tasks (2 per node on 2 nodes) but --devices 2 x"
            " --num_nodes 1 asks for 2"),
    Setting("zero-nodes", 0, 1, {}, "--num_nodes must be >= 1 (got 0)"),
    # accepted
    Setting("one-process", 1, 1, {}),
    Setting("one-machine-spawns", 1, 4, {}),  # Fabric starts the other processes of this machine itself
    Setting("two-nodes-manual", 2, 2, MANUAL),
    Setting("two-nodes-torchrun", 2, 1, TORCHRUN_2x1),
    Setting("two-nodes-srun", 2, 2, SRUN_2x2),
    Setting("slurm-interactive-shell", 1, 1, {"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "interactive"}),
    Setting("tpu-runtime", 4, 8, {}, accelerator="tpu"),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
def test_check_launcher(setting, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["finetune/lora.py", "--num_nodes", str(setting.num_nodes)])
    if setting.line is None:
        check_launcher(setting.num_nodes, setting.devices, setting.accelerator, env=setting.env)
    else:
        with pytest.raises(LitError) as e:
            check_launcher(setting.num_nodes, setting.devices, setting.accelerator, env=setting.env)
        assert setting.line in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert list(tmp_path.iterdir()) == []  # a check: nothing written


@pytest.mark.parametrize("value, line", [
    (2.5, None), (1800, None), (0, "--peer_timeout must be a positive number of seconds (got 0)"),
    (-1.0, "(got -1.0)"), (float("inf"), "(got inf)"), (float("nan"), "(got nan)"),
])
def test_strategy_timeout(value, line):
    if line is None:
        assert strategy_timeout(value) == datetime.timedelta(seconds=value)
    else:
        with pytest.raises(LitError, match=line.replace("(", r"\(").replace(")", r"\)")):
            strategy_timeout(value)


# --- a real wait for a peer that never comes: world size 2, one process ----------------------------------------------
PEER_SCRIPT = """
import sys
from lit_gpt.launch import check_launcher, launch, strategy_timeout
from lit_gpt.utils import cli

@cli
def main(timeout):
    check_launcher(2, 1, "cpu")
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    fabric = L.Fabric(accelerator="cpu", devices=1, num_nodes=2,
                      strategy=DDPStrategy(timeout=strategy_timeout(timeout)))
    launch(fabric, lambda fabric: print("joined", flush=True), peer_timeout=timeout)

main(float(sys.argv[1]))
"""


@dataclass
class Wait:
    id: str
    timeout: float
    signal: Optional[int]
    code: int
    line: str


WAITS = [
    Wait("timeout", 1.0, None, 1, "error: waited 1 s for the other processes: 1 of 2 joined; start the same command on"
         " every machine (each with its own NODE_RANK, the same MASTER_ADDR and MASTER_PORT), or raise --peer_timeout"),
    Wait("ctrl-c", 120.0, signal.SIGINT, 130, "interrupted (Ctrl-C) while waiting for the other processes of the run"
         " (2 in all): nothing was trained or saved"),
    Wait("sigterm", 120.0, signal.SIGTERM, 143, "interrupted (SIGTERM) while waiting for the other processes"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def waiting(tmp_path_factory):
    """One process per case, started together (each imports Lightning), each the first of two machines whose second
    never comes."""
    script = tmp_path_factory.mktemp("peer") / "peer.py"
    script.write_text(PEER_SCRIPT)
    procs = {}
    for w in WAITS:
        env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "NODE_RANK": "0"}
        procs[w.id] = subprocess.Popen([sys.executable, str(script), str(w.timeout)], env=env, cwd=script.parent,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("wait", WAITS, ids=[w.id for w in WAITS])
def test_peer_wait(wait, waiting):
    proc = waiting[wait.id]
    output = []
    if wait.signal is not None:
        for line in proc.stdout:  # Lightning's line just before it waits in init_process_group
            output.append(line)
            if "Initializing distributed" in line:
                break
        assert proc.poll() is None, "".join(output)
        time.sleep(0.5)  # inside the C++ wait
        sent = time.monotonic()
        proc.send_signal(wait.signal)
        rest, _ = proc.communicate(timeout=10)
        assert time.monotonic() - sent < 5, "the interrupt did not end the wait promptly"
    else:
        rest, _ = proc.communicate(timeout=300)
    text = "".join(output) + rest
    lines = [line for line in text.splitlines() if line.strip()]
    assert proc.returncode == wait.code, text[-3000:]
    assert "Traceback" not in text and "joined\n" not in text, text[-3000:]
    assert lines[-1] == wait.line or (wait.line in lines[-1] and wait.signal), lines[-1]


# --- the CLI's lines for interrupts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("raised, code, line", [
    (Interrupted("interrupted by SIGINT at step 5: step-000004 is complete; resume with: python finetune/lora.py"
                 " --resume auto"), 130,
     "interrupted by SIGINT at step 5: step-000004 is complete; resume with: python finetune/lora.py --resume auto"),
    (Interrupted("interrupted by SIGTERM during the save of step-000006", exit_code=143), 143,
     "interrupted by SIGTERM during the save of step-000006"),
    (Interrupted(), 130, "interrupted"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (LitError("--devices must be >= 1 (got 0)"), 1, "error: --devices must be >= 1 (got 0)"),
], ids=["interrupted", "terminated", "interrupted-no-message", "bare-ctrl-c", "lit-error"])
def test_cli_lines(raised, code, line, capsys):
    def entry():
        raise raised

    with pytest.raises(SystemExit) as e:
        cli(entry)()
    err = capsys.readouterr().err
    assert e.value.code == code
    assert err.splitlines() == [line]
