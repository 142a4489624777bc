"""What the one training loop promises on the CPU (and on CUDA where a GPU is present), beyond the per-method recipe
tests in test_finetune.py:

* every method runs on checkpoints stored in fp32, bf16 and fp16 under every precision the CPU accepts (the Hub
  serves bf16; the GGUF converter writes fp32), and on the real SmolLM2 converted from a bf16 HF folder;
* a used --out_dir is never overwritten, and a resume refuses a run with other arguments;
* data whose targets are all cropped away is refused before training;
* FSDP keeps a tied head tied (the state-dict handling it relies on, exercised with torch's FSDP on the CPU);
* several processes where one gets no validation batch finish (no hang); 2 nodes x 1 process == 1 node x 2;
* SIGKILL at random moments with --resume auto each time ends bit-identical to an uninterrupted run (LoRA with
  dropout), and on a GPU the CUDA generator is restored too.
"""

import hashlib
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.utils import LitError
from tiny import TINY

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog runs quickly over lazy river mountain blue red green small large happy sad".split()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
METHOD_KWARGS = {
    "full": {},
    "lora": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
    "adapter": {"adapter_start_layer": 0},
    "adapter_v2": {"adapter_start_layer": 0},
}
WEIGHTS = {"full": "lit_model.safetensors", "lora": "lit_model.lora.safetensors",
           "adapter": "lit_model.adapter.safetensors", "adapter_v2": "lit_model.adapter_v2.safetensors"}
STEP_FILE = "checkpoint.pth"  # a CPU/GPU step checkpoint: Fabric's file (model, optimizer, train state)


def final_weights(path: Path) -> Dict[str, torch.Tensor]:
    from lit_gpt.weights import load_weights

    return load_weights(path)


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"contract_{name}", ROOT / "finetune" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(n: int, seed: int = 0, prompt_words: int = 6):
    rng = random.Random(seed)
    return [{"instruction": "Repeat: " + " ".join(rng.choice(WORDS) for _ in range(prompt_words)),
             "input": "", "output": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8)))} for _ in range(n)]


def prepare(checkpoint_dir: Path, destination: Path, data_rows, val_fraction: float = 0.25) -> Path:
    from lit_gpt import data

    src = destination.with_suffix(".json")
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps(data_rows))
    records, bad = data.read_records(src)
    parsed, bad2 = data.records_to_rows(records, data.instruction_rows())
    data.prepare(parsed, bad + bad2, checkpoint_dir=checkpoint_dir, destination=destination, source=str(src),
                 max_seq_length=96, val_split_fraction=val_fraction, seed=1)
    return destination


def args(method: str, checkpoint_dir: Path, data_dir: Path, out_dir: Path, steps: int = 1, precision="32-true",
         **overrides):
    a = dict(checkpoint_dir=checkpoint_dir, out_dir=out_dir, precision=precision, accelerator="cpu",
             data=DataArgs(data_dir=data_dir),
             train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=steps, learning_rate=1e-3,
                             lr_warmup_steps=1, save_interval=None, seed=1),
             eval=EvalArgs(interval=1000, max_iters=1, max_new_tokens=0, final_validation=False),
             **METHOD_KWARGS[method])
    a.update(overrides)
    return a


def tree_digest(root: Path) -> Dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stored(tiny_dir, tmp_path_factory) -> Dict[str, Path]:
    """The tiny checkpoint stored in fp32, bf16 and fp16 (what the converters keep from the source files)."""
    import shutil

    out = {}
    from lit_gpt.weights import find_weights, save_weights

    state = final_weights(find_weights(tiny_dir))
    for name, dtype in DTYPES.items():
        d = tmp_path_factory.mktemp(f"stored_{name}") / "tiny-llama"
        shutil.copytree(tiny_dir, d)
        find_weights(d).unlink()
        save_weights({k: v.to(dtype) for k, v in state.items()}, d)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def data_dir(tiny_dir, tmp_path_factory) -> Path:
    return prepare(tiny_dir, tmp_path_factory.mktemp("contract") / "prepared", rows(16))


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("method", list(METHOD_KWARGS))
def test_every_method_on_every_stored_dtype_and_precision(method, dtype, precision, stored, data_dir, tmp_path):
    summary = load_recipe(method).setup(**args(method, stored[dtype], data_dir, tmp_path / "out", steps=1,
                                               precision=precision))
    assert summary["steps"] == 1
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["losses"].values()), summary["losses"]
    saved = final_weights(tmp_path / "out" / "final" / WEIGHTS[method])
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {expected}


@pytest.mark.slow
def test_lora_on_real_smollm2_from_a_bf16_hub_folder_at_the_cpu_default(smollm2_bf16_dir, tmp_path):
    """The user's first run: the Hub's bf16 weights, LoRA, the CPU's default precision (32-true)."""
    from lit_gpt.weights import find_weights

    state = final_weights(find_weights(smollm2_bf16_dir))
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    data_dir = prepare(smollm2_bf16_dir, tmp_path / "prepared", rows(8))
    a = args("lora", smollm2_bf16_dir, data_dir, tmp_path / "out", steps=2, precision=None)
    summary = load_recipe("lora").setup(**a)
    assert summary["steps"] == 2 and all(v == v for v in summary["losses"].values())
    saved = final_weights(tmp_path / "out" / "final" / WEIGHTS["lora"])
    assert {t.dtype for t in saved.values()} == {torch.float32}


def test_used_out_dir_is_refused_and_a_resume_must_be_the_same_run(tiny_dir, data_dir, tmp_path):
    recipe = load_recipe("lora")
    out = tmp_path / "out"
    recipe.setup(**args("lora", tiny_dir, data_dir, out, steps=2, train=TrainArgs(
        global_batch_size=2, micro_batch_size=2, max_steps=2, save_interval=1, seed=1)))
    before = tree_digest(out)
    with pytest.raises(LitError, match=r"already holds a run \(final, step-000001, step-000002\).*--resume auto"):
        recipe.setup(**args("lora", tiny_dir, data_dir, out, steps=2))
    with pytest.raises(LitError, match=r"other arguments \(method_config.lora_r: 4 -> 8\)"):
        recipe.setup(**args("lora", tiny_dir, data_dir, out, steps=2, resume="auto", lora_r=8, train=TrainArgs(
            global_batch_size=2, micro_batch_size=2, max_steps=2, save_interval=1, seed=1)))
    with pytest.raises(LitError, match=r"other arguments \(train.learning_rate: 0.0003 -> 0.01\)"):
        recipe.setup(**args("lora", tiny_dir, data_dir, out, resume="auto", train=TrainArgs(
            global_batch_size=2, micro_batch_size=2, max_steps=2, save_interval=1, seed=1, learning_rate=0.01)))
    logs = {k for k in tree_digest(out) if k.startswith("logs/")}
    after = {k: v for k, v in tree_digest(out).items() if not k.startswith("logs/") or k in before}
    assert after == before and logs == {k for k in before if k.startswith("logs/")}
    # a file where the folder should be, and a folder that cannot be written: refused before anything is loaded
    (tmp_path / "file").write_text("x")
    with pytest.raises(LitError, match="is a file, not a folder"):
        recipe.setup(**args("lora", tiny_dir, data_dir, tmp_path / "file"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(LitError, match="is not writable"):
            recipe.setup(**args("lora", tiny_dir, data_dir, ro / "run"))


def test_data_without_targets_is_refused(tiny_dir, tmp_path):
    data_dir = prepare(tiny_dir, tmp_path / "prepared", rows(8, prompt_words=30))
    a = args("lora", tiny_dir, data_dir, tmp_path / "out")
    a["train"].max_seq_length = 16  # the prompts are longer: no target token survives the crop
    with pytest.raises(LitError, match="no training sample keeps a target token within max_seq_length 16"):
        load_recipe("lora").setup(**a)
    assert not (tmp_path / "out" / "final").exists()


FSDP_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig
from torch.distributed.fsdp import FullOptimStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from lit_gpt.config import Config
from lit_gpt.model import GPT, Block
from lit_gpt.recipes.finetune import materialize_outside

cfg = Config(name="t", block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=16, tie_embeddings=True)
torch.manual_seed(0)
reference = {k: v.clone() for k, v in GPT(cfg).state_dict().items()}
results = {}
for fixed in (False, True):
    with torch.device("meta"):  # how Lightning's FSDP builds big models
        model = GPT(cfg)
    if fixed:
        materialize_outside(model, Block, torch.device("cpu"))
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                   use_orig_params=True)
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT):
        wrapped.load_state_dict(reference)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    wrapped(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        state = wrapped.state_dict()
        FSDP.optim_state_dict(wrapped, optimizer)
    results[fixed] = (model.lm_head.weight is model.transformer.wte.weight,
                      torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]))
print(results[False], results[True])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_keeps_a_tied_head_tied(tmp_path, forks):
    """torch's FSDP on the CPU (gloo, one process), built on the meta device like Lightning's FSDP: without
    `materialize_outside` the head and the embedding become two tensors that train apart; with it the tie
    survives wrapping, loading, a step and the full state dict that the checkpoint is written from."""
    from fork_server import run_captured

    # `python -c SCRIPT` as a process of its own (its gloo group), forked from the fork server (tests/conftest.py)
    proc = run_captured(forks, ["-c", FSDP_SCRIPT, str(free_port())], ROOT, os.environ, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "(False, False) (True, True)"


def lora_cmd(out: Path, checkpoint_dir: Path, data_dir: Path, *extra: str, steps: int = 4):
    return [sys.executable, str(ROOT / "finetune" / "lora.py"), "--checkpoint_dir", str(checkpoint_dir),
            "--data.data_dir", str(data_dir), "--out_dir", str(out), "--accelerator", "cpu", "--precision", "32-true",
            "--train.global_batch_size", "4", "--train.micro_batch_size", "1", "--train.max_steps", str(steps),
            "--train.save_interval", "2", "--train.seed", "3", "--train.learning_rate", "0.02",
            "--lora_r", "4", "--lora_alpha", "8", "--eval.interval", "2", "--eval.max_iters", "1",
            "--eval.max_new_tokens", "2", *extra]


def forked(forks, cmd, cwd: Path, env, stdout, stderr: Path):
    """`cmd` (`python SCRIPT ARGS...`) started in the fork server (tests/conftest.py `forks`): a process of its own,
    signalled and SIGKILLed as one, without a fresh interpreter's ~5 s of imports. Its stdout: the file object
    `stdout` (or None: /dev/null); its stderr: the file `stderr`."""
    with open(os.devnull) as null_in, open(os.devnull, "w") as null_out, open(stderr, "w") as err:
        return forks.start(cmd[1:], cwd, env, (null_in.fileno(), (stdout or null_out).fileno(), err.fileno()))


def csv_losses(out: Path, key: str = "loss") -> Dict[int, float]:
    import csv

    values = {}
    for path in sorted((out / "logs" / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(key):
                    values[int(float(row["step"]))] = float(row[key])
    return values


@pytest.mark.slow
def test_one_process_without_validation_batch_and_two_nodes(tiny_dir, tmp_path, forks):
    """2 processes and a validation set of one batch: the second process validates nothing but still joins the
    sum (it used to wait forever). Then the same run as 2 nodes x 1 process (torchrun/SLURM style environment,
    both on localhost) gives the same losses."""
    data_dir = prepare(tiny_dir, tmp_path / "prepared", rows(17), val_fraction=1 / 17)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the processes are forked from the fork server (torch imported already); rank 1 of the one-node run is started
    # by the recipe itself, as everywhere (a `python` process of its own)
    from fork_server import run_captured

    one_node = run_captured(forks, lora_cmd(tmp_path / "one", tiny_dir, data_dir, "--devices", "2")[1:], tmp_path,
                            env, timeout=400)
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    assert sorted(csv_losses(tmp_path / "one", "val_loss")) == [2, 4]
    port = str(free_port())
    procs = []
    for node in (0, 1):
        node_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node),
                    "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
        procs.append(forked(forks, lora_cmd(tmp_path / "nodes", tiny_dir, data_dir, "--devices", "1", "--num_nodes",
                                            "2"), tmp_path, node_env, None, tmp_path / f"node{node}.err"))
    for node, p in enumerate(procs):
        p.wait(timeout=400)
        assert p.returncode == 0, (tmp_path / f"node{node}.err").read_text()[-3000:]
    a, b = csv_losses(tmp_path / "one"), csv_losses(tmp_path / "nodes")
    assert sorted(a) == [1, 2, 3, 4] and a.keys() == b.keys()
    assert all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a), (a, b)


@pytest.mark.slow
def test_lora_with_dropout_survives_random_kills_bit_exactly(tiny_dir, data_dir, tmp_path, forks):
    """The CPU soak: finetune/lora.py with dropout, a checkpoint every 2 steps, SIGKILLed at random moments (some
    during a save) and restarted with --resume auto until it finishes; the losses and the final weights equal an
    uninterrupted run's bit for bit."""
    steps = 8
    extra = ("--lora_dropout", "0.1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the uninterrupted run, timing its start-up (until its first checkpoint) and its steps: the kills below are
    # placed relative to the soak run's own progress, so that a loaded machine cannot let a run finish unkilled
    t0 = time.monotonic()
    # stderr to files: a pipe nobody reads while the test polls could fill up and stall the run. Each run is a
    # process of its own forked from the fork server (tests/conftest.py `forks`): SIGKILLed as one, without a fresh
    # interpreter's ~5 s of imports (its start-up, where the first kill lands, is the recipe's own loading)
    straight = forked(forks, lora_cmd(tmp_path / "straight", tiny_dir, data_dir, *extra, steps=steps), tmp_path, env,
                      None, tmp_path / "straight.err")
    first_save = None
    while straight.poll() is None:
        if first_save is None and (tmp_path / "straight" / "step-000002" / STEP_FILE).exists():
            first_save = time.monotonic() - t0
        time.sleep(0.02)
    straight.wait()
    assert straight.returncode == 0, (tmp_path / "straight.err").read_text()[-3000:]
    elapsed = time.monotonic() - t0
    first_save = first_save or elapsed
    step_time = max(elapsed - first_save, 0.1) / (steps - 2)
    rng = random.Random(1)
    soak = tmp_path / "soak"
    # SIGKILL at a random moment of the start-up (loading, first steps), then at a random moment after the step-2,
    # -4 and -6 checkpoints (inside the next step or save); then to the end
    plans = [(None, rng.uniform(0.2, 0.9) * first_save)]
    plans += [(soak / f"step-{s:06d}" / STEP_FILE, rng.uniform(0.0, 1.5) * step_time) for s in (2, 4, 6)]
    kills = 0
    for trigger, delay in plans + [("end", None)]:
        err_file = tmp_path / "soak.err"
        proc = forked(forks, lora_cmd(soak, tiny_dir, data_dir, *extra, "--resume", "auto", steps=steps), tmp_path,
                      env, None, err_file)
        if trigger != "end":
            while trigger is not None and proc.poll() is None and not trigger.exists():
                time.sleep(0.02)
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.kill()  # SIGKILL wherever the run is: loading, a step, a save
                proc.wait(timeout=60)
                kills += 1
                continue
        proc.wait(timeout=400)
        assert proc.returncode == 0, err_file.read_text()[-3000:]
    assert kills >= 3
    assert csv_losses(tmp_path / "soak") == csv_losses(tmp_path / "straight")
    a = final_weights(tmp_path / "straight" / "final" / WEIGHTS["lora"])
    b = final_weights(tmp_path / "soak" / "final" / WEIGHTS["lora"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "soak").glob(".*partial"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs where one is lent)")
@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_cuda_resume_is_exact_with_dropout_and_fsdp_saves_a_tied_model(tiny_dir, data_dir, tmp_path, monkeypatch,
                                                                        strategy):
    """On a GPU LoRA dropout draws from the CUDA generator: a run killed after its step-2 checkpoint and resumed
    equals the uninterrupted run exactly. With --strategy fsdp the tied-embedding tiny model saves and resumes."""
    from lit_gpt.runtime import Runtime

    recipe = load_recipe("lora")

    def run(out, **kw):
        a = args("lora", tiny_dir, data_dir, out, steps=4, precision="32-true", accelerator="cuda",
                 strategy=strategy, lora_dropout=0.1, **kw)
        a["train"] = TrainArgs(global_batch_size=2, micro_batch_size=1, max_steps=4, save_interval=2, seed=1)
        return recipe.setup(**a)

    run(tmp_path / "straight")

    class Killed(Exception):
        pass

    original = Runtime.save_step

    def die_after_step_2(self, directory, *a, **kw):
        result = original(self, directory, *a, **kw)
        if Path(directory).name == "step-000002":
            raise Killed
        return result

    monkeypatch.setattr(Runtime, "save_step", die_after_step_2)
    with pytest.raises(Killed):
        run(tmp_path / "resumed")
    monkeypatch.setattr(Runtime, "save_step", original)
    run(tmp_path / "resumed", resume="auto")
    assert csv_losses(tmp_path / "straight") == csv_losses(tmp_path / "resumed")
    a = final_weights(tmp_path / "straight" / "final" / WEIGHTS["lora"])
    b = final_weights(tmp_path / "resumed" / "final" / WEIGHTS["lora"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cpu_path_refuses_the_same_incomplete_checkpoints(tmp_path):
    """The CPU/GPU loader applies the rule of the staged XLA loader (tests/xla/test_xla.py::test_clear_errors): a
    base checkpoint lacking a weight of the model is refused, naming it; only a variant's own may be missing."""
    from lit_gpt import GPT, Config, lora
    from lit_gpt.recipes.finetune import load_base_weights
    from lit_gpt.weights import save_weights

    config = Config(**TINY)
    torch.manual_seed(0)
    state = GPT(config).state_dict()
    for missing, cfg in (("transformer.h.1.attn.proj.weight", config),
                         ("lm_head.weight", Config(**{**TINY, "tie_embeddings": False}))):
        (tmp_path / missing).mkdir()
        save_weights({k: v for k, v in state.items() if k != missing}, tmp_path / missing)
        with torch.device("meta"):
            model = GPT(cfg)
        with pytest.raises(LitError, match=rf"lacks 1 weight\(s\) of the model \({missing}\)"):
            load_base_weights(model, tmp_path / missing, None, assign=True)
    lora_model = lora.GPT(lora.Config(**TINY, lora_r=2, lora_alpha=4))
    (tmp_path / "base").mkdir()
    save_weights(state, tmp_path / "base")
    load_base_weights(lora_model, tmp_path / "base", lora.lora_filter, assign=False)  # its own may be missing


def test_forward_never_builds_rope_tables(monkeypatch):
    """The RoPE tables are set up explicitly (at construction, by max_seq_length, by the runtime): a forward, a
    KV-cache prefill and decode steps never rebuild them (on a tracing backend that would fold the table into the
    first graph, which then differs from the next)."""
    from lit_gpt import GPT, Config
    from lit_gpt.generate import generate

    model = GPT(Config(**TINY)).eval()
    model.apply(model._init_weights)
    calls = []
    monkeypatch.setattr(GPT, "reset_rope_cache", lambda self, device=None: calls.append(device))
    idx = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        model(idx)
        generate(model, idx[0], 5)
    assert calls == []
    model.cos = model.cos.to("meta")
    with pytest.raises(RuntimeError, match="RoPE tables are on meta"):
        model(idx)


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_checkpoint(tiny_dir, data_dir, tmp_path,
                                                                                  monkeypatch):
    """The disk fills up while step 2's checkpoint is written: one LitError naming it, step 1 intact, no litter."""
    import errno

    from lit_gpt.runtime import Runtime

    original = Runtime.save_step
    fabric_save = {}

    def full_disk_at_step_2(self, directory, *a, **kw):
        if Path(directory).name == "step-000002":
            real = self.fabric.save

            def save(path, *sa, **skw):
                Path(path).write_bytes(b"half a checkpoint")
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

            fabric_save["patched"] = True
            monkeypatch.setattr(self.fabric, "save", save)
            try:
                return original(self, directory, *a, **kw)
            finally:
                monkeypatch.setattr(self.fabric, "save", real)
        return original(self, directory, *a, **kw)

    monkeypatch.setattr(Runtime, "save_step", full_disk_at_step_2)
    out = tmp_path / "out"
    a = args("lora", tiny_dir, data_dir, out, steps=3)
    a["train"] = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=3, save_interval=1, seed=1)
    with pytest.raises(LitError, match=r"cannot write the checkpoint .*step-000002.* \(No space left on device\):"
                                       r" free space there or choose another --out_dir"):
        load_recipe("lora").setup(**a)
    assert fabric_save["patched"]
    assert sorted(p.name for p in out.iterdir() if p.name != "logs") == ["step-000001"]
    assert (out / "step-000001" / STEP_FILE).is_file()


def test_wandb_logger_offline_records_metrics_and_the_run_config(tiny_dir, data_dir, tmp_path, monkeypatch):
    """`--logger_name wandb` with WANDB_MODE=offline: the run's files under out_dir/logs/wandb, with the losses and
    the run's arguments, and nothing sent anywhere."""
    pytest.importorskip("wandb", reason="wandb is in requirements-test.txt")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "contract-test")
    out = tmp_path / "out"
    load_recipe("lora").setup(**args("lora", tiny_dir, data_dir, out, steps=2, logger_name="wandb"))
    import wandb

    wandb.finish()
    runs = list((out / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "logs").rglob("*"))[:20]
    # offline, the run is one record file (what `wandb sync` uploads): the run config and the metrics are in it.
    # wandb's service process writes it; once in a full-suite run (1 of 4) it held only its header right after
    # finish(), so it gets a bounded wait
    names = (b"lora_r", b"learning_rate", b"global_batch_size", b"loss", b"tokens_per_sec")
    deadline = time.monotonic() + 30
    while True:
        records = next(runs[0].glob("run-*.wandb")).read_bytes()
        missing = [name for name in names if name not in records]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, (missing, len(records))
