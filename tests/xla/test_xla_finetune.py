"""The one training loop on every backend, tested as the contract between the recipes: `finetune/X.py` on the CPU,
`xla/finetune/X.py` on XLA:CPU with 1 device and with 8 devices (FSDP over SPMD), for full, LoRA and adapter
finetuning, epoch-driven (`--train.epochs`, no `max_steps`: what users run), same data, seed and settings (fp32,
dropout 0):

* the same number of optimizer steps (epochs x samples / global batch, on any number of devices);
* the same logged loss step by step (the mean per target token over the whole step: relative difference <= 1e-4);
* final weights equal within float32's bound (eps x tokens per step x magnitude: tests/tolerance.py); each
  method's final weights generate the same text on the CPU and on XLA;
* the train step compiles at most twice per padded length; validation with a sample compiles nothing later;
* exact resume under SIGKILL (LoRA with dropout on 8 devices, so the XLA generator state matters): killed right
  after a checkpoint, then at a random moment (possibly inside a save), resumed with --resume auto each time: the
  same losses and bit-identical final weights as the uninterrupted run;
* the final export takes the step this run wrote, never a newer one left in the folder by an earlier run.

The tiny checkpoint has a word-level tokenizer of ~50 words (a 128-row embedding), which keeps the runs fast. XLA
runs are separate processes (the runtime reads PJRT_DEVICE / CPU_NUM_DEVICES once), one at a time; the CPU
references run in this process meanwhile."""

import csv
import importlib.util
import json
import os
import random
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import pytest
import torch
from fork_server import popen
from words import GEN_PROMPT, alpaca_rows as _alpaca_rows, make_word_checkpoint

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 1200
EPOCHS = 2
STEPS = EPOCHS * 40 // 8  # 40 training samples, 8 per step
GEN_TOKENS = 12

COMMON = [
    "--train.global_batch_size", "8", "--train.micro_batch_size", "1", "--train.epochs", str(EPOCHS),
    "--train.save_interval", "5", "--train.log_interval", "1", "--train.lr_warmup_steps", "2",
    "--data.shuffle", "false", "--eval.interval", "5", "--eval.max_iters", "1", "--accelerator", "cpu",
]
NO_VALIDATION = ["--eval.interval", "1000", "--eval.final_validation", "false"]  # shown once, for the adapter
METHODS = {
    # method: (recipe arguments, weights file, CPU generate recipe + flag, XLA generate recipe + flag)
    "adapter": (["--adapter_start_layer", "0", "--train.learning_rate", "0.05", "--eval.max_new_tokens", "4"],
                "lit_model.adapter.safetensors", ("generate/adapter.py", "--adapter_path"),
                ("xla/generate/adapter.py", "--adapter_path")),
    "lora": (["--lora_r", "4", "--lora_alpha", "8", "--lora_mlp", "true", "--lora_dropout", "0",
              "--train.learning_rate", "0.02", *NO_VALIDATION],
             "lit_model.lora.safetensors", ("generate/lora.py", "--lora_path"), ("xla/generate/lora.py", "--lora_path")),
    "full": (["--train.learning_rate", "0.002", "--train.min_lr", "0.0002", *NO_VALIDATION],
             "lit_model.safetensors", ("generate/full.py", "--checkpoint_path"), ("xla/generate/base.py", None)),
}
# the soak: LoRA with dropout, a checkpoint every 2 steps
SOAK = ["--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1", "--train.learning_rate", "0.02",
        *NO_VALIDATION, "--train.save_interval", "2"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    killed: bool


class Sequential:
    """Runs recipe commands one after another in a background thread, so the tests can check a finished run while
    the next ones go on. One at a time: several processes with 8 virtual devices each on a small machine can starve
    a device thread past XLA:CPU's collective rendezvous timeout (10 s), which aborts the process."""

    def __init__(self, jobs: List[Tuple[str, List[str], object, int]], env, log_dir: Path, forks) -> None:
        self.jobs, self.env, self.log_dir, self.forks = jobs, env, log_dir, forks
        self.results: Dict[str, Result] = {}
        self.done = {name: threading.Event() for name, _, _, _ in jobs}
        self.proc = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run_all, daemon=True)
        self.thread.start()

    def _run_all(self) -> None:
        for name, cmd, kill_on, devices in self.jobs:
            if self.stopped:
                break
            stderr_path = self.log_dir / f"{name}.stderr"
            read_end, write_end = os.pipe()
            with open(stderr_path, "w") as err, os.fdopen(write_end, "w") as out, os.fdopen(read_end) as stdout:
                # from the XLA fork server (tests/conftest.py `xla_forks`): a process without the imports' ~8 s
                self.proc = proc = popen(self.forks, cmd[1:], cwd=REPO, env=self.env(devices), stdout=out,
                                         stderr=err)
                out.close()  # the command has its copy: the pipe ends with it
                lines, killed = [], []
                timer = None
                if isinstance(kill_on, float):  # SIGKILL after a delay: wherever the run is then
                    timer = threading.Timer(kill_on, lambda: killed.append(1) or proc.kill())
                    timer.start()
                for line in stdout:
                    lines.append(line)
                    if isinstance(kill_on, str) and kill_on in line and not killed:
                        proc.kill()  # SIGKILL right after the checkpoint, like a preempted TPU VM
                        killed.append(1)
                proc.wait()
                if timer is not None:
                    timer.cancel()
            self.results[name] = Result(proc.returncode, "".join(lines), stderr_path.read_text(), bool(killed))
            self.done[name].set()

    def result(self, name: str, expect_ok: Optional[bool] = True) -> Result:
        """The finished job; `expect_ok` True: it must have succeeded; None: killed or not, it must not have
        failed on its own."""
        if not self.done[name].wait(TIMEOUT):
            pytest.fail(f"{name} did not finish in {TIMEOUT} s")
        r = self.results[name]
        if expect_ok is None:
            assert r.killed or r.returncode == 0, f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
        if expect_ok:
            assert r.returncode == 0, f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
        return r

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()




def _cli_args(argv: List[str]) -> Dict[str, str]:
    """The recipe arguments above as {name: value} (for the in-process CPU reference runs)."""
    return {argv[i][2:]: argv[i + 1] for i in range(0, len(argv), 2)}


def _cpu_reference(method: str, tiny_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    """finetune/<method>.py on the CPU, in this process, through jsonargparse like the command line."""
    from jsonargparse import CLI

    spec = importlib.util.spec_from_file_location(f"cpu_recipe_{method}", REPO / "finetune" / f"{method}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    argv = ["--checkpoint_dir", str(tiny_dir), "--data.data_dir", str(data_dir), "--out_dir", str(out_dir),
            "--precision", "32-true", *COMMON, *METHODS[method][0]]
    return CLI(recipe.setup, args=argv)


SOAK_TEST = "test_lora_with_dropout_survives_kills_bit_exactly_and_exports_its_own_step"


def _selected(request) -> Tuple[set, bool]:
    """The (method, device count) runs the selected tests of this module ask for, and whether the soak is selected:
    the default suite runs LoRA on 1 device, `-m slow` every method on 1 and 8 devices and the soak
    (tests/README.md)."""
    runs, soak = set(), False
    for item in request.session.items:
        if item.module is request.module:
            params = getattr(item, "callspec", None)
            if params and "devices" in params.params:
                runs.add((params.params["method"], params.params["devices"]))
            soak = soak or item.originalname == SOAK_TEST
    return runs, soak


@pytest.fixture(scope="module")
def runs(xla_env, tmp_path_factory, request, forks, xla_forks):
    """Prepare the data, then run the XLA jobs one after another in a background thread (1 or 8 devices per method,
    as the selected tests need; the LoRA-with-dropout reference, the killed and resumed soak runs) while the CPU
    references run here."""
    tmp = tmp_path_factory.mktemp("xla_finetune")
    tiny_dir = make_word_checkpoint(tmp / "tiny-words")
    (tmp / "alpaca.json").write_text(json.dumps(_alpaca_rows()))
    data_dir = tmp / "data"
    from fork_server import run_captured

    # forked from the fork server (tests/conftest.py `forks`): a CPU script, without a fresh interpreter's imports
    prep = run_captured(
        forks, [str(REPO / "scripts/prepare_alpaca.py"), "--checkpoint_dir", str(tiny_dir),
                "--data_file", str(tmp / "alpaca.json"), "--destination_path", str(data_dir),
                "--val_split_fraction", str(4 / 44)],
        REPO, xla_env(1), timeout=TIMEOUT,
    )
    assert prep.returncode == 0, prep.stderr

    def cmd(method: str, out_dir: Union[Path, str], *extra: str, args: Optional[List[str]] = None) -> List[str]:
        return [sys.executable, str(REPO / f"xla/finetune/{method}.py"), "--checkpoint_dir", str(tiny_dir),
                "--data.data_dir", str(data_dir), "--out_dir", str(out_dir), *COMMON,
                *(METHODS[method][0] if args is None else args), *extra]

    soak = tmp / "soak"
    # the soak run keeps its checkpoints, logs and final export "in a bucket": file:// goes through fsspec like
    # gs:// (DCP's fsspec writer and reader, the marker as the commit, no renames), in a folder that survives kills
    bucket = f"file://{soak}"
    rng = random.Random(0)
    selected, with_soak = _selected(request)
    jobs = []
    for method in METHODS:
        for n in (8, 1):
            if (method, n) in selected:
                jobs.append((f"{method}{n}", cmd(method, tmp / f"{method}{n}"), None, n))
    if with_soak:
        jobs += [
            ("dropout8", cmd("lora", tmp / "dropout8", args=SOAK), None, 8),
            # killed right after a checkpoint, then at a random moment (maybe inside a save), then to the end
            ("soak_a", cmd("lora", bucket, args=SOAK), f"saved {bucket}/step-000004", 8),
            # (a fresh interpreter took 14-24 s to the same point: forked, the imports' ~6 s are saved)
            ("soak_b", cmd("lora", bucket, "--resume", "auto", args=SOAK), rng.uniform(8.0, 18.0), 8),
            ("soak_c", cmd("lora", bucket, "--resume", "auto", args=SOAK), None, 8),
        ]
    seq = Sequential(jobs, xla_env, tmp, xla_forks)
    cpu = {}
    for method in METHODS:
        if any(m == method for m, _ in selected):
            cpu[method] = (tmp / f"{method}_cpu", _cpu_reference(method, tiny_dir, data_dir, tmp / f"{method}_cpu"))
    yield {"tmp": tmp, "seq": seq, "tiny_dir": tiny_dir, "data_dir": data_dir, "env": xla_env, "cpu": cpu,
           "cmd": cmd, "forks": forks, "xla_forks": xla_forks}
    seq.stop()


@pytest.fixture(scope="module")
def generations(runs, request):
    """Once the runs are done: the final weights of each selected (method, devices) through the CPU and the XLA
    generate recipe, all started at once."""
    from fork_server import Captured

    test = "test_final_weights_generate_the_same_on_cpu_and_xla"
    selected = {(item.callspec.params["method"], item.callspec.params["devices"]) for item in request.session.items
                if item.module is request.module and item.originalname == test}
    procs = {}
    for (method, (_, weights_file, (cpu_script, cpu_flag), (xla_script, xla_flag))), n in (
            (m, n) for m in METHODS.items() for n in (1, 8) if (m[0], n) in selected):
        runs["seq"].result(f"{method}{n}")
        tiny_dir, final = runs["tiny_dir"], runs["tmp"] / f"{method}{n}" / "final"
        sampling = ["--prompt", _gen_prompt(), "--prompt_style", "raw", "--temperature", "0",
                    "--max_new_tokens", str(GEN_TOKENS)]
        cpu_cmd = [sys.executable, str(REPO / cpu_script), "--checkpoint_dir", str(tiny_dir), cpu_flag,
                   str(final / weights_file), *sampling, "--accelerator", "cpu"]
        if xla_flag is None:  # full finetuning: final/ is a complete checkpoint folder
            xla_cmd = [sys.executable, str(REPO / xla_script), "--checkpoint_dir", str(final), *sampling]
        else:
            xla_cmd = [sys.executable, str(REPO / xla_script), "--checkpoint_dir", str(tiny_dir), xla_flag,
                       str(final / weights_file), *sampling]
        # each forked from its fork server (tests/conftest.py `forks`, `xla_forks`: torch, torch_xla imported
        # already; the XLA runtime starts in the child, which reads its variables then)
        procs[(method, n, "cpu")] = Captured(runs["forks"], cpu_cmd[1:], REPO, runs["env"](1),
                                             runs["tmp"] / f"gen_{method}{n}_cpu.out",
                                             runs["tmp"] / f"gen_{method}{n}_cpu.err")
        procs[(method, n, "xla")] = Captured(runs["xla_forks"], xla_cmd[1:], REPO, runs["env"](1),
                                             runs["tmp"] / f"gen_{method}{n}_xla.out",
                                             runs["tmp"] / f"gen_{method}{n}_xla.err")
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _gen_prompt() -> str:
    """An Alpaca prompt like the training ones (so the model answers with words rather than stopping at once),
    passed as a raw prompt because the generate recipes take no --input."""
    from lit_gpt.prompts import Alpaca

    return Alpaca().apply(GEN_PROMPT, input="red cat sun tree")


def _losses(out_dir: Path, key: str = "loss") -> Dict[int, float]:
    """{step: value} over every logged run (version) in out_dir, later versions overriding earlier ones."""
    values = {}
    paths = sorted((out_dir / "logs" / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    for path in paths:
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(key):
                    values[int(float(row["step"]))] = float(row[key])
    return values


def _trained_weight_tolerance(reference: torch.Tensor) -> float:
    """float32's bound (tests/tolerance.py) for a weight trained on two backends: each step's gradient sums one
    term per token of the step (8 rows of at most 81 tokens here: `_alpaca_rows`), Adam passes a gradient's
    relative error on to its update, and the weight is its initial value plus its updates: eps x tokens per step x
    the weight's magnitude (8e-6 to 3e-4 here; a tuned 1e-5 failed at 1.6e-5 on an adapter_wte of magnitude 3.5
    with MKL's AVX-512 kernels). The differences measured on AVX-512 were 1e-7 to 1.6e-5, each 6x or more below."""
    from tolerance import fp32_tolerance

    return fp32_tolerance(8 * 81, reference.float().abs().max())


def _weights(path: Path) -> Dict[str, torch.Tensor]:
    from lit_gpt.weights import is_weights_file, load_weights

    if is_weights_file(path):  # safetensors (what consolidation writes)
        return load_weights(path)
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj["model"] if isinstance(obj.get("model"), dict) else obj


# every method on 1 device in the default suite; on 8 devices (FSDP over SPMD) under -m slow
# the default suite: LoRA on 1 device (the suite's budget, tests/README.md); -m slow: the adapter and full finetuning
# on 1 device and every method on 8
CASES = [pytest.param(m, n, id=f"{m}-{n}", marks=[] if (m, n) == ("lora", 1) else [pytest.mark.slow])
         for m in METHODS for n in (1, 8)]


@pytest.mark.parametrize("method, devices", CASES)
def test_cpu_and_xla_on_1_and_8_devices_train_the_same(runs, method, devices):
    """The parity contract: same steps, same per-step losses, same final weights on every backend."""
    cpu_dir, cpu_summary = runs["cpu"][method]
    weights_file = METHODS[method][1]
    reference = _losses(cpu_dir)
    assert cpu_summary["steps"] == STEPS and sorted(reference) == list(range(1, STEPS + 1))
    ref_weights = _weights(cpu_dir / "final" / weights_file)
    out = runs["seq"].result(f"{method}{devices}").stdout
    out_dir = runs["tmp"] / f"{method}{devices}"
    got = _losses(out_dir)
    assert sorted(got) == sorted(reference), (devices, got)
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-4), (devices, step, got, reference)
    weights = _weights(out_dir / "final" / weights_file)
    assert weights.keys() == ref_weights.keys() and weights
    for name in weights:
        diff = (weights[name].float() - ref_weights[name].float()).abs().max().item()
        bound = _trained_weight_tolerance(ref_weights[name])
        assert diff <= bound, (devices, name, diff, bound)
    assert f"Saved the {method} weights of step {STEPS}" in out
    # the loss went down over the two epochs (the same batches in each: compare epoch means)
    first, second = (sum(reference[s] for s in range(a, a + 5)) / 5 for a in (1, 6))
    assert second < first - 0.02, reference


@pytest.mark.parametrize("method, devices", CASES)
def test_epoch_driven_xla_runs_take_every_step_with_bounded_compilations(runs, method, devices):
    """`--train.epochs 2` and no max_steps: 10 optimizer steps (epochs x 40 samples / 8) on any number of devices,
    not 10 / 8; the train step compiles at most twice per padded length (4 times on 1 device, which accumulates 8
    micro-batches); checkpoints and the consolidated export are there."""
    out = runs["seq"].result(f"{method}{devices}").stdout
    out_dir = runs["tmp"] / f"{method}{devices}"
    m = re.search(r"XLA compilations: train step (\d+) for (\d+) padded length\(s\)", out)
    assert m, out[-2000:]
    compiles, lengths = int(m.group(1)), int(m.group(2))
    assert lengths == 2  # the data pads to two lengths (see _alpaca_rows)
    # per padded length: the first step (optimizer state created inside the graph) and the steady step, no more; on
    # 1 device the step of 8 rows is 8 micro-batches of 1, so the accumulating micro-step is a graph too (first, when
    # it creates the gradients, and steady): 4 (measured: {64: 4, 80: 3})
    per_length = 2 if devices == 8 else 4
    assert 1 <= compiles <= per_length * lengths, out[-2000:]
    for step in (5, 10):
        assert (out_dir / f"step-{step:06d}" / "lit_checkpoint.json").is_file()
        # the run's files are inside the checkpoint when it is committed, not copied in afterwards
        assert (out_dir / f"step-{step:06d}" / "lit_config.json").is_file()
        assert (out_dir / f"step-{step:06d}" / "finetune.json").is_file()
    assert (out_dir / "final" / METHODS[method][1]).is_file()
    assert (out_dir / "final" / "lit_config.json").is_file()
    assert re.search(r"Throughput: [\d.]+ tokens/s .* over \d+ steady step", out), out[-2000:]
    if method == "adapter":  # validation with a sample from the one generation loop
        assert re.search(r"step 5: val loss [\d.]+ \| sample: ", out), out[-2000:]


# LoRA's weights through xla/generate/lora.py in the default suite; the adapter's and full finetuning's through
# xla/generate/adapter.py and base.py, and every 8-device run's, under -m slow
GEN_CASES = [pytest.param(m, n, id=f"{m}-{n}", marks=[] if (m, n) == ("lora", 1) else [pytest.mark.slow])
             for m in METHODS for n in (1, 8)]


@pytest.mark.parametrize("method, devices", GEN_CASES)
def test_final_weights_generate_the_same_on_cpu_and_xla(runs, generations, method, devices):
    results = {}
    for kind in ("cpu", "xla"):
        stdout, stderr = generations[(method, devices, kind)].communicate(timeout=TIMEOUT)
        assert generations[(method, devices, kind)].returncode == 0, stderr[-3000:]
        results[kind] = (stdout, stderr)
    (cpu_text, _), (xla_text, xla_log) = results["cpu"], results["xla"]
    # raw style: the prompt and its continuation; the continuation must not be empty for the check to mean much
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(runs["tiny_dir"])
    prompt_text = tokenizer.decode(tokenizer.encode(_gen_prompt()))
    assert cpu_text.startswith(prompt_text) and len(cpu_text.strip()) > len(prompt_text.strip()), cpu_text
    assert xla_text == cpu_text
    assert "XLA compilations: 2 " in xla_log


@pytest.mark.slow  # the soak: 4 runs on 8 devices, ~75 s
def test_lora_with_dropout_survives_kills_bit_exactly_and_exports_its_own_step(runs):
    """With --out_dir in a bucket (file://, through fsspec): SIGKILL after the step-4 checkpoint, then at a random
    moment; each time --resume auto from the bucket. The losses (logs pushed to the bucket) and the final LoRA
    weights equal the uninterrupted run's exactly. Then a run resumed from step 4 with --train.max_steps
    4 exports step 4's weights, although the folder holds step 10."""
    seq = runs["seq"]
    reference_dir, soak = runs["tmp"] / "dropout8", runs["tmp"] / "soak"
    seq.result("dropout8")
    a = seq.result("soak_a", expect_ok=False)
    assert a.killed and a.returncode != 0 and (soak / "step-000004" / "lit_checkpoint.json").is_file()
    seq.result("soak_b", expect_ok=None)
    c = seq.result("soak_c")
    assert "Resumed from" in c.stdout or "Nothing to do" in c.stdout
    assert _losses(soak) == _losses(reference_dir)
    ref = _weights(reference_dir / "final" / "lit_model.lora.safetensors")
    got = _weights(soak / "final" / "lit_model.lora.safetensors")
    assert ref.keys() == got.keys() and ref
    for name in ref:
        assert torch.equal(ref[name], got[name]), (name, (ref[name] - got[name]).abs().max())

    # the export takes this run's last step: step 4 here, not the newer step 10 of the folder
    from lit_gpt.xla.consolidation import consolidate

    bucket = f"file://{soak}"
    from fork_server import run_captured

    again = run_captured(runs["xla_forks"], runs["cmd"]("lora", bucket, "--resume", f"{bucket}/step-000004",
                                                        "--train.max_steps", "4", args=SOAK)[1:],
                         REPO, runs["env"](8), timeout=TIMEOUT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to do" in again.stdout
    step4_file = consolidate(f"{bucket}/step-000004", runs["tmp"] / "step4", key="model")  # read from the bucket
    assert step4_file.name == "lit_model.lora.safetensors" and (step4_file.parent / "lit_model.lora.json").is_file()
    step4, final = _weights(step4_file), _weights(soak / "final" / "lit_model.lora.safetensors")
    assert step4.keys() == final.keys() and all(torch.equal(step4[k], final[k]) for k in step4)
    assert any(not torch.equal(step4[k], ref[k]) for k in step4)
