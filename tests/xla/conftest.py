"""XLA test setup: the tests in this folder are marked `xla` and skipped without torch_xla (except modules that set
`NEEDS_XLA = False`). Fixtures: `xla_workers` (below), `xla_env(devices)`, `tiny_config`.

The XLA work runs in worker processes (tests/xla/worker.py) with PJRT_DEVICE=CPU and CPU_NUM_DEVICES=8, 4 or 1:
the runtime reads those variables once per process and SPMD mode cannot be turned off again, so the pytest process
itself never starts an XLA runtime. Multi-process collectives hang on XLA:CPU (pytorch/xla #9089); SPMD in one
process over 8 virtual devices is the design under test, not a workaround. The workers start together (they
spend most of their time importing and compiling) and each test waits for the result it needs.
"""

import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from fork_server import popen

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
TIMEOUT = 900

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
ONE_AT_A_TIME = HERE / "one_at_a_time"
MULTI_DEVICE_LOCK = None  # the run's lock file for 8-device processes (set below, once per worker)


@pytest.fixture(scope="session", autouse=True)
def _multi_device_lock(tmp_path_factory):
    """The lock file that 8-device XLA processes hold while they run, in the folder the session's process made for
    the run (tests/conftest.py `pytest_configure`, shared by every xdist worker), so that the XLA modules can run on
    several workers; the processes log their waits and holds beside it (the run's summary prints them)."""
    global MULTI_DEVICE_LOCK
    folder = os.environ.get("LIT_GPT_TEST_XLA_LOCK_DIR")
    MULTI_DEVICE_LOCK = Path(folder) / "xla-8-devices.lock" if folder else tmp_path_factory.getbasetemp() / "xla.lock"
    yield
    MULTI_DEVICE_LOCK = None


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        # a test module that needs plain torch only (checkpoint files) says so with NEEDS_XLA = False
        if Path(str(item.fspath)).resolve().parent != HERE or not getattr(item.module, "NEEDS_XLA", True):
            continue
        # the suite's budget (tests/README.md): end-to-end runs on 8 virtual devices run under -m slow; the default
        # suite runs them on 1 device (and test_xla.py keeps one 8-device FSDP contract test by default), except in
        # modules whose every run is slow (SLOW_DEVICES = (1, 8): features beside the recipes' own end-to-end runs)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("devices") in getattr(item.module, "SLOW_DEVICES", (8,)):
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xla)
        if not HAS_XLA:
            item.add_marker(pytest.mark.skip(reason="torch_xla is not installed (pip install torch_xla==2.9.0)"))


def selected_devices(request) -> List[int]:
    """The `devices` values (1, 8) that the selected tests of the requesting module are parametrized with, largest
    first: a module fixture starts only the runs those tests read (the default suite selects the 1-device ones)."""
    found = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec is not None and "devices" in callspec.params:
            found.add(callspec.params["devices"])
    return sorted(found, reverse=True)


def xla_env(devices: int, **extra: str) -> Dict[str, str]:
    # TPU_LOG_DIR stays: libtpu's logs go under the run's folder (tests/conftest.py), not /tmp/tpu_logs
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_")) or k == "TPU_LOG_DIR"}
    # TF_CPP_MIN_LOG_LEVEL=2: no "GSPMD sharding propagation is going to be deprecated" line per compilation.
    # XLA:CPU set to compile fast (the tests' XLA time is mostly compilation of tiny models' graphs: a family's LoRA
    # job compiled for 19.0 s of its 22 s of CPU and ran its graphs for 0.4 s; the tests check graphs, not speed):
    # --xla_backend_optimization_level=0 (~4x faster), LLVM without its expensive passes (bit-identical results) and
    # the elemental kernel emitters instead of the MLIR fusion emitters (results within ~1 ulp; no fast-math). A/B
    # pairs of whole modules, CPU time with the two last flags vs without (2026-11-29, load 2-5): the families
    # matrix 336 -> 157 s, MoE 326 -> 180, scan 174 -> 115, xla_finetune + xla_dpo 216 -> 156, xla_generate +
    # xla_precision 148 -> 106, xla_serve + xla 142 -> 149 (many executed decode steps: even)
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                         " --xla_cpu_use_fusion_emitters=false", **extra)
    if devices >= 8 and MULTI_DEVICE_LOCK is not None:
        # one 8-device process at a time across the run's workers (tests/xla/one_at_a_time/sitecustomize.py); the
        # wait for the lock counts in the caller's timeout, which the longest wait (~4 minutes) stays well within
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ONE_AT_A_TIME), env.get("PYTHONPATH", "")) if p)
        env["LIT_GPT_TEST_XLA_LOCK"] = str(MULTI_DEVICE_LOCK)
    return env


class Workers:
    """Worker processes started at once; `result(name)` waits for one and returns its JSON."""

    def __init__(self, out: Path, forks) -> None:
        self.out, self.forks = out, forks
        self.procs: Dict[str, Tuple[Any, float]] = {}

    def start(self, name: str, devices: int) -> None:
        # from the XLA fork server (tests/conftest.py `xla_forks`): a process of its own without the imports' ~8 s
        with open(self.out / f"{name}.log", "w") as log:
            proc = popen(self.forks, [str(WORKER), name, str(self.out)], env=xla_env(devices), stdout=log,
                         stderr=log)
        self.procs[name] = (proc, time.time())

    def wait(self, name: str) -> int:
        proc, started = self.procs[name]
        try:
            return proc.wait(timeout=max(1.0, TIMEOUT - (time.time() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"worker {name} timed out; log: {self.out / (name + '.log')}")

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text()[-6000:]

    def result(self, name: str, killed: bool = False) -> dict:
        """The worker's results; `killed`: it ends by SIGKILL on purpose (after writing them)."""
        rc = self.wait(name)
        path = self.out / f"{name}.json"
        if rc != (-9 if killed else 0) or not path.is_file():
            pytest.fail(f"worker {name} failed (exit {rc}):\n{self.log(name)}")
        return json.loads(path.read_text())

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def xla_workers(tmp_path_factory, request, xla_forks):
    if not HAS_XLA:
        pytest.skip("torch_xla is not installed")
    import torch

    out = tmp_path_factory.mktemp("xla")
    from lit_gpt import GPT, Config
    from tiny import TINY, random_model
    from lit_gpt.weights import save_weights

    # the models the workers load, written before any of them starts (so they measure loading, not writing)
    for name, config in (("tiny", TINY), ("mem", _worker_dict("MEMORY"))):
        torch.manual_seed(0)
        with torch.device("meta"):
            meta = GPT(Config(**config))
        if name == "tiny":
            state = random_model(Config(**config)).state_dict()  # what worker.tiny_checkpoint writes
        else:
            state = {k: torch.randn(t.shape) * 0.02 for k, t in meta.state_dict().items()}
        if name == "tiny":  # the project's format (the others test the staged loader on an earlier version's file)
            save_weights(state, out / name)
        else:
            (out / name).mkdir()
            torch.save(state, out / name / "lit_model.pth")
        del state
    workers = Workers(out, xla_forks)
    workers.start("train8", 8)
    # the extra 8-device and the 4-device reshard workers serve tests of the slow suite only (tests/README.md)
    if any(item.get_closest_marker("slow") and item.fspath.basename == "test_xla.py" for item in request.session.items):
        workers.start("extra8", 8)
        workers.start("reshard", 4)
    workers.start("ref1", 1)
    yield workers
    workers.stop()


@pytest.fixture(scope="session")
def tiny_config():
    from tiny import tiny_llama_config

    return tiny_llama_config()


@pytest.fixture(scope="session", name="selected_devices")
def selected_devices_fixture():
    return selected_devices


@pytest.fixture(scope="session", name="xla_env")
def xla_env_fixture():
    return xla_env


def _worker_dict(name: str) -> dict:
    """A `NAME = dict(...)` constant of worker.py, read without importing it (that would import torch_xla here)."""
    import ast

    for node in ast.parse(WORKER.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return {kw.arg: ast.literal_eval(kw.value) for kw in node.value.keywords}
    raise RuntimeError(f"{name} not found in worker.py")
