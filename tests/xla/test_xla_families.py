"""The dense families of the one model file (Qwen3, Gemma 2, Gemma 3, Phi-4-mini, OLMo 2, SmolLM3) through the real
recipes on every backend: `finetune/X.py` on the CPU, `xla/finetune/X.py` on XLA:CPU with 1 device and with 8
(FSDP over SPMD). Each family is a tiny word-tokenizer checkpoint built from its named config with its per-layer
features switched on where they matter (tests/words.py `FAMILIES`: sliding windows of 4 tokens on 61/81-token
sequences, Gemma 3's local RoPE base and linear scaling, LongRoPE with partial rotary dims whose original context
lies between the two steps' lengths, soft-caps in range, a NoPE layer).

Default: Gemma 3 generation through `xla/generate/base.py` on 1 device (8 under -m slow; windows and the local
RoPE table in the static-cache graphs, a prompt longer than the window): 2 compilations for the first prompt's
bucket, 0 for a second prompt of another length in that bucket, and the same greedy text as `generate/base.py` on
the CPU. (The default suite trains every method on XLA in tests/xla/test_xla_finetune.py and checks every family's
forward against transformers in tests/test_model.py.)

Slow (`pytest -m slow tests/xla/test_xla_families.py`; CI runs it, the README's default command leaves it out): every
family x LoRA / adapter / full on the three backends (two optimizer steps, fp32, dropout 0: the same logged loss at
both steps, relative 1e-4, and final weights within `WEIGHT_ATOL`; adapter_v2 on the CPU: there is no XLA
adapter_v2 recipe), and resume after step 1 bit-exact for each of them on each backend.

Cost: each XLA device count is one process that runs all its recipe calls in turn, generation and the matrix
together (tests/xla/families_worker.py: the runtime starts once; each family pays for its own compilations only); the
two processes run side by side while the CPU runs happen in this process."""

import contextlib
import csv
import importlib.util
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from fork_server import popen
from words import FAMILIES, family_checkpoints, family_rows

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "families_worker.py"
TIMEOUT_PER_JOB = 120  # a worker's wait grows with its jobs (the slow matrix gives one worker ~36 runs)
STEPS = 2
GEN_TOKENS = 12
# both in the 16-token prompt bucket, both longer than the 4-token window
GEN_PROMPTS = {"a": "red green blue cat dog sun", "b": "moon tree river stone bird fish red green blue cat"}

COMMON = [
    "--train.global_batch_size", "8", "--train.max_steps", str(STEPS), "--train.save_interval", "1",
    "--train.log_interval", "1", "--train.lr_warmup_steps", "1", "--data.shuffle", "false",
    "--eval.interval", "1000", "--eval.final_validation", "false", "--accelerator", "cpu",
]
# micro-batches: 1 on the CPU and per device on 8 devices; in the default tests 8 on one XLA device (one micro-step
# per optimizer step: one compilation per padded length instead of three; every step's rows have one length, so the
# padding and the per-token mean loss are the same on every backend). The slow matrix uses 1 there too: full and
# adapter finetuning's weights differ by up to 3e-5 after summing the gradients in another order (AdamW's first
# steps scale tiny gradients up), beyond the 1e-5 the contract holds them to
MICRO = {"cpu": "1", "xla1": "8", "xla8": "1"}
MICRO_SLOW = {**MICRO, "xla1": "1"}
# final weights against the CPU's: 1e-5, as tests/xla/test_xla_finetune.py; full finetuning of the one-layer Phi-4
# and OLMo 2 models ends 1.1e-5 / 2.8e-5 away in an MLP weight (with the same losses to 1e-4, and micro-batches of
# 1 everywhere): rounding differences of near-zero gradient entries that AdamW scales up to a step's size (lr 2e-3),
# so full finetuning is held to 5e-5 (2.5% of one step). The adapters' gating and prompt weights meet the same
# rounding at a 25x larger step (lr 0.05): on the 2-core machine of 2026-11-26 Gemma 2's and SmolLM3's adapter runs
# ended 1.6e-5 / 1.0e-5 away (losses equal to 1e-4), 0.03% of one step; held to 5e-5 (0.1% of one step)
WEIGHT_ATOL = {"full": 5e-5, "adapter": 5e-5, "adapter_v2": 5e-5}
METHODS = {
    # method: (recipe arguments, weights file, has an XLA recipe)
    "lora": (["--lora_r", "4", "--lora_alpha", "8", "--lora_mlp", "true", "--lora_dropout", "0",
              "--train.learning_rate", "0.02"], "lit_model.lora.safetensors", True),
    "adapter": (["--adapter_start_layer", "0", "--train.learning_rate", "0.05"], "lit_model.adapter.safetensors", True),
    "adapter_v2": (["--adapter_start_layer", "0", "--train.learning_rate", "0.05"], "lit_model.adapter_v2.safetensors",
                   False),
    "full": (["--train.learning_rate", "0.002"], "lit_model.safetensors", True),
}


def _recipe_args(ckpt: Path, family: str, method: str, backend: str, out_dir: Path, *extra: str,
                 micro: Dict[str, str] = MICRO) -> List[str]:
    args = ["--checkpoint_dir", str(ckpt / family), "--data.data_dir", str(ckpt / "data"), "--out_dir", str(out_dir),
            *COMMON, "--train.micro_batch_size", micro[backend], *METHODS[method][0], *extra]
    return args + (["--precision", "32-true"] if backend == "cpu" else [])


def _run_dir(root: Path, family: str, method: str, backend: str, resumed: bool = False) -> Path:
    return root / f"{family}_{method}_{backend}{'_resumed' if resumed else ''}"


def _load_recipe(script: str):
    spec = importlib.util.spec_from_file_location("recipe_" + script.replace("/", "_")[:-3], REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu(script: str, args: List[str]) -> str:
    """A recipe on the CPU, in this process, through jsonargparse like its command line; its stdout."""
    from jsonargparse import CLI

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        CLI(_load_recipe(script).setup, args=args)
    return out.getvalue()


def _losses(out_dir: Path) -> Dict[int, float]:
    values = {}
    for path in sorted((out_dir / "logs" / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("loss"):
                    values[int(float(row["step"]))] = float(row["loss"])
    return values


def _weights(path: Path) -> Dict[str, torch.Tensor]:
    from lit_gpt.weights import load_weights

    return load_weights(path)


class Workers:
    """One worker process per XLA device count, started together; `result(devices, job)` waits for the process."""

    def __init__(self, xla_env, out: Path, jobs: Dict[int, List[dict]], forks) -> None:
        self.out = out
        self.procs = {}
        self.timeouts = {devices: 300 + TIMEOUT_PER_JOB * len(device_jobs) for devices, device_jobs in jobs.items()}
        for devices, device_jobs in jobs.items():
            folder = out / f"worker{devices}"
            folder.mkdir(parents=True)
            (folder / "jobs.json").write_text(json.dumps(device_jobs))
            # from the XLA fork server (tests/conftest.py `xla_forks`): a process without the imports' ~8 s
            with open(folder / "worker.log", "w") as log:
                self.procs[devices] = popen(
                    forks, [str(WORKER), str(folder / "jobs.json"), str(folder / "results.json")], cwd=REPO,
                    env=xla_env(devices, PYTHONPATH=str(REPO / "tests")), stdout=log, stderr=subprocess.STDOUT,
                )
        self.results: Dict[int, dict] = {}

    def result(self, devices: int, name: str) -> dict:
        """The job's {"ok", "seconds", "error", "stdout", "stderr"}; fails the test if the job failed."""
        if devices not in self.results:
            proc, folder = self.procs[devices], self.out / f"worker{devices}"
            try:
                proc.wait(timeout=self.timeouts[devices])
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail(f"the {devices}-device worker timed out; logs in {folder}")
            path = folder / "results.json"
            if proc.returncode != 0 or not path.is_file():
                pytest.fail(f"the {devices}-device worker failed ({proc.returncode}):\n"
                            f"{(folder / 'worker.log').read_text()[-4000:]}")
            self.results[devices] = json.loads(path.read_text())
        folder = self.out / f"worker{devices}"
        r = self.results[devices].get(name)
        assert r is not None, f"job {name} did not run on {devices} devices"
        assert r["ok"], f"job {name} failed on {devices} devices:\n{r['error'][-4000:]}"
        return dict(r, stdout=(folder / f"{name}.out").read_text(), stderr=(folder / f"{name}.log").read_text())

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _train_jobs(ckpt: Path, root: Path, family: str, method: str, devices: int, resume: bool,
                micro: Dict[str, str] = MICRO) -> List[dict]:
    """The XLA run; with `resume`, then the same run "stopped" right after step 1's checkpoint (its step folder
    copied into a new out_dir, as a preempted run leaves it) and continued with --resume auto."""
    backend = f"xla{devices}"
    script = f"xla/finetune/{method}.py"
    full, resumed = _run_dir(root, family, method, backend), _run_dir(root, family, method, backend, resumed=True)
    jobs = [{"name": f"{family}_{method}", "script": script,
             "args": _recipe_args(ckpt, family, method, backend, full, micro=micro)}]
    if resume:
        jobs.append({"name": f"{family}_{method}_resumed", "script": script,
                     "copy_checkpoint": [str(full / "step-000001"), str(resumed / "step-000001")],
                     "args": _recipe_args(ckpt, family, method, backend, resumed, "--resume", "auto", micro=micro)})
    return jobs


def _cpu_runs(ckpt: Path, root: Path, family: str, method: str) -> None:
    """The CPU run, then the same stopped after step 1's checkpoint and resumed (as `_train_jobs`)."""
    full, resumed = _run_dir(root, family, method, "cpu"), _run_dir(root, family, method, "cpu", resumed=True)
    _cpu(f"finetune/{method}.py", _recipe_args(ckpt, family, method, "cpu", full))
    shutil.copytree(full / "step-000001", resumed / "step-000001")
    _cpu(f"finetune/{method}.py", _recipe_args(ckpt, family, method, "cpu", resumed, "--resume", "auto"))


def _gen_args(ckpt: Path, prompt: str) -> List[str]:
    return ["--checkpoint_dir", str(ckpt / "gemma3"), "--prompt", prompt, "--prompt_style", "raw",
            "--temperature", "0", "--max_new_tokens", str(GEN_TOKENS), "--accelerator", "cpu"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A checkpoint per family (one word tokenizer for all) and the prepared rows (`family_rows`)."""
    return family_checkpoints(tmp_path_factory.mktemp("families"), list(FAMILIES), family_rows())


MATRIX = [(f, m) for f in FAMILIES for m in METHODS]


def _selected(request, fixture: str) -> List[int]:
    """The device counts (1, 8) that the selected tests of this module reading `fixture` need (the matrix tests read
    both)."""
    found = set()
    for item in request.session.items:
        if item.module is request.module and fixture in getattr(item, "fixturenames", ()):
            callspec = getattr(item, "callspec", None)
            devices = callspec.params.get("devices") if callspec is not None else None
            found.update([devices] if devices is not None else (1, 8))
    return sorted(found, reverse=True)


@pytest.fixture(scope="module")
def runs(checkpoints, xla_env, request, xla_forks):
    """One XLA worker per device count that the selected tests need (the default suite: 1 device, generation only;
    -m slow: 8 devices for generation, and 1 and 8 for the matrix), running their jobs in one runtime: Gemma 3
    generation first (a fresh runtime: the first prompt's 2 compilations), then the matrix's training runs (each a
    fresh recipe run whose graphs no earlier job traced). The CPU runs happen here meanwhile."""
    ckpt, root = checkpoints, checkpoints / "runs"
    generation, matrix = _selected(request, "default_runs"), _selected(request, "matrix")
    jobs = {devices: [{"name": f"gen_{key}", "script": "xla/generate/base.py", "args": _gen_args(ckpt, prompt)}
                      for key, prompt in GEN_PROMPTS.items() if devices in generation]
            + [job for family, method in MATRIX if matrix and METHODS[method][2]
               for job in _train_jobs(ckpt, root, family, method, devices, resume=True, micro=MICRO_SLOW)]
            for devices in sorted(set(generation) | set(matrix), reverse=True)}
    workers = Workers(xla_env, root / "workers", jobs, xla_forks)
    cpu_gen = {key: _cpu("generate/base.py", _gen_args(ckpt, prompt)) for key, prompt in GEN_PROMPTS.items()
               } if generation else {}
    for family, method in MATRIX if matrix else ():
        _cpu_runs(ckpt, root, family, method)
    yield {"ckpt": ckpt, "root": root, "workers": workers, "cpu_gen": cpu_gen}
    workers.stop()


@pytest.fixture(scope="module")
def default_runs(runs):
    """Gemma 3 generation on the device counts the selected tests need (1; also 8 under -m slow), and on the CPU."""
    return runs


def _assert_same_training(root: Path, family: str, method: str, workers: Workers,
                          device_counts: Tuple[int, ...] = (1, 8)) -> None:
    """The CPU run's logged losses (both steps, relative 1e-4) and final weights (`WEIGHT_ATOL`) on 1 and 8 XLA
    devices (or those of `device_counts`)."""
    cpu_dir = _run_dir(root, family, method, "cpu")
    weights_file = METHODS[method][1]
    reference = _losses(cpu_dir)
    assert sorted(reference) == list(range(1, STEPS + 1)), reference
    assert all(torch.isfinite(torch.tensor(v)) for v in reference.values()), reference
    ref_weights = _weights(cpu_dir / "final" / weights_file)
    assert ref_weights
    for devices in device_counts:
        backend = f"xla{devices}"
        r = workers.result(devices, f"{family}_{method}")
        assert f"Saved the {method} weights of step {STEPS}" in r["stdout"], r["stdout"][-2000:]
        out_dir = _run_dir(root, family, method, backend)
        got = _losses(out_dir)
        assert sorted(got) == sorted(reference), (backend, got)
        for step in reference:
            assert got[step] == pytest.approx(reference[step], rel=1e-4), (backend, step, got, reference)
        weights = _weights(out_dir / "final" / weights_file)
        assert weights.keys() == ref_weights.keys()
        for name in weights:
            diff = (weights[name].float() - ref_weights[name].float()).abs().max().item()
            assert diff <= WEIGHT_ATOL.get(method, 1e-5), (backend, name, diff)


def _assert_exact_resume(full: Path, resumed: Path, weights_file: str) -> None:
    assert (resumed / "step-000001").is_dir() and (resumed / f"step-{STEPS:06d}").is_dir()
    ref, got = _weights(full / "final" / weights_file), _weights(resumed / "final" / weights_file)
    assert ref.keys() == got.keys() and ref
    for name in ref:
        assert torch.equal(ref[name], got[name]), (name, (ref[name].float() - got[name].float()).abs().max())
    # the resumed run logged step 2 only: the same value
    assert _losses(resumed) == {STEPS: _losses(full)[STEPS]}


def test_the_data_puts_each_step_on_one_side_of_the_longrope_context(checkpoints):
    """Step 1's rows are within Phi-4's (tiny) original context, step 2's beyond it, however a backend pads them:
    the two steps use LongRoPE's short and long factors, the same ones on every backend."""
    from lit_gpt import Config

    train = torch.load(checkpoints / "data" / "train.pt", weights_only=True)
    lengths = [len(row["input_ids"]) - 1 for row in train]  # the model sees all but the last token
    original = Config.from_checkpoint(checkpoints / "phi4").rope_scaling["original_max_seq_len"]
    assert len(lengths) == 8 * STEPS
    assert max(lengths[:8]) == min(lengths[:8]) and max(lengths[8:]) == min(lengths[8:])
    # a power of two: the XLA padding of step 1 (next power of two) stays within it
    assert original & (original - 1) == 0 and lengths[0] <= original < lengths[8]
    for family in FAMILIES:  # every sliding window is smaller than the sequences
        window = Config.from_checkpoint(checkpoints / family).sliding_window_size
        assert window is None or window < lengths[0]


# every family's LoRA run on 1 and 8 devices (and its resume) is part of the slow matrix below (every method of every
# family); the default suite checks every family's forward and cached generation against transformers
# (tests/test_model.py, tests/test_families.py) and its LoRA and adapter variants (tests/test_lora.py, ...), and trains
# every method on XLA (tests/xla/test_xla_finetune.py) and LoRA with one micro-batch of 8 rows on 1 XLA device
# (tests/xla/test_xla_moe.py)


@pytest.mark.parametrize("devices", [1, 8])
def test_gemma3_generation_compiles_twice_per_bucket_and_matches_cpu(default_runs, devices):
    from lit_gpt import Config
    from lit_gpt.generate import bucket_length
    from lit_gpt.tokenizer import Tokenizer

    ckpt = default_runs["ckpt"]
    config = Config.from_checkpoint(ckpt / "gemma3")
    assert set(config.layer_types) == {"sliding_attention", "full_attention"} and config.rope_kinds == 2
    tokenizer = Tokenizer(ckpt / "gemma3")
    lengths = {key: tokenizer.encode(p).numel() for key, p in GEN_PROMPTS.items()}
    buckets = {bucket_length(n, config.block_size) for n in lengths.values()}
    assert len(set(lengths.values())) == 2 and len(buckets) == 1, (lengths, buckets)
    assert min(lengths.values()) > config.sliding_window_size  # the window cuts the prompt already
    for key, prompt in GEN_PROMPTS.items():
        r = default_runs["workers"].result(devices, f"gen_{key}")
        compiles = 2 if key == "a" else 0  # the first prompt of the bucket: prefill + decode; then nothing new
        assert f"XLA compilations: {compiles} (" in r["stderr"], r["stderr"][-2000:]
        cpu_text = default_runs["cpu_gen"][key]
        assert r["stdout"] == cpu_text
        # the continuation is there (no early stop token), longer than the window: every token was compared
        prompt_text = tokenizer.decode(tokenizer.encode(prompt))
        assert cpu_text.startswith(prompt_text)
        assert len(cpu_text.split()) - len(prompt_text.split()) == GEN_TOKENS, cpu_text


# ---------------------------------------------------------------------------------------------------------------
# slow: the full matrix (MATRIX, above)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matrix(runs):
    """Every family x method: the CPU runs (and resumes), the XLA ones (and resumes) on 1 and 8 devices (the module's
    one worker per device count: `runs`). Marked slow: the README's default test command leaves it out
    (`-m "not slow"`), CI runs it."""
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("family, method", MATRIX)
def test_every_method_trains_the_same_and_resumes_exactly_on_every_backend(matrix, family, method):
    root, workers = matrix["root"], matrix["workers"]
    weights_file = METHODS[method][1]
    _assert_exact_resume(_run_dir(root, family, method, "cpu"), _run_dir(root, family, method, "cpu", resumed=True),
                         weights_file)
    if not METHODS[method][2]:
        pytest.skip(f"no XLA recipe for {method} (xla/finetune has adapter, full and lora): checked on the CPU only")
    _assert_same_training(root, family, method, workers)
    for devices in (1, 8):
        workers.result(devices, f"{family}_{method}_resumed")
        backend = f"xla{devices}"
        _assert_exact_resume(_run_dir(root, family, method, backend),
                             _run_dir(root, family, method, backend, resumed=True), weights_file)
