"""The finetune recipes on a tiny checkpoint (CPU): training lowers the loss, 2 processes (DDP over gloo) match
one process, resume is exact, only the trained weights are saved and they load for generation."""

import csv
import importlib.util
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.utils import LitError
from tiny import TINY, tiny_llama_config

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("full", "lora", "adapter", "adapter_v2")
WEIGHTS_FILE = {
    "full": "lit_model.safetensors",
    "lora": "lit_model.lora.safetensors",
    "adapter": "lit_model.adapter.safetensors",
    "adapter_v2": "lit_model.adapter_v2.safetensors",
}
# per-method settings that make 10 steps on the tiny random model visibly lower the loss
METHOD_ARGS = {
    "full": dict(lr=1e-3, kwargs={}),
    "lora": dict(lr=2e-2, kwargs={"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_mlp": True}),
    "adapter": dict(lr=5e-2, kwargs={"adapter_start_layer": 0}),
    "adapter_v2": dict(lr=1e-2, kwargs={"adapter_start_layer": 0}),
}
WORDS = "the a cat dog runs quickly over lazy river mountain blue red green small large happy sad".split()


def load_script(directory: str, name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{directory}_{name}", ROOT / directory / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe(name: str):
    """Import finetune/<name>.py (recipes are scripts, not a package)."""
    return load_script("finetune", name)


def alpaca_rows(n: int, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        rows.append({
            "instruction": "Repeat: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))),
            "input": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4))),
            "output": " ".join(rng.choice(WORDS[:6]) for _ in range(rng.randint(6, 14))),
        })
    return rows


@pytest.fixture(scope="module")
def data_dir(tiny_dir, tmp_path_factory) -> Path:
    from lit_gpt import data

    root = tmp_path_factory.mktemp("ft_data")
    src = root / "alpaca.json"
    src.write_text(json.dumps(alpaca_rows(48)))
    records, bad = data.read_records(src)
    rows, bad2 = data.records_to_rows(records, data.instruction_rows())
    data.prepare(rows, bad + bad2, checkpoint_dir=tiny_dir, destination=root / "prepared", source=str(src),
                 max_seq_length=96, val_split_fraction=0.25, seed=1)
    return root / "prepared"


def run_args(method: str, tiny_dir: Path, data_dir: Path, out_dir: Path, steps: int = 10, micro: int = 2,
             global_batch: int = 4, save_interval=5, eval_interval=5, **overrides):
    cfg = METHOD_ARGS[method]
    args = dict(
        checkpoint_dir=tiny_dir,
        out_dir=out_dir,
        precision="32-true",
        accelerator="cpu",  # the backend under test, also on a machine with a GPU
        data=DataArgs(data_dir=data_dir),
        train=TrainArgs(global_batch_size=global_batch, micro_batch_size=micro, max_steps=steps,
                        learning_rate=cfg["lr"], min_lr=cfg["lr"] / 10, lr_warmup_steps=2,
                        save_interval=save_interval, log_interval=1, seed=3),
        eval=EvalArgs(interval=eval_interval, max_iters=2, max_new_tokens=4),
        **cfg["kwargs"],
    )
    args.update(overrides)
    return args


def read_metrics(out_dir: Path, key: str = "loss"):
    """{step: value} over every logged run (version) in out_dir, later versions overriding earlier ones."""
    values = {}
    for path in sorted((out_dir / "logs" / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(key):
                    values[int(float(row["step"]))] = float(row[key])
    return values


def saved_state(path: Path):
    """A step checkpoint (Fabric's file: model, optimizer, train state)."""
    return torch.load(path, weights_only=True, map_location="cpu")


def final_weights(path: Path):
    """The exported weights (`lit_gpt.weights`: safetensors, tensors only)."""
    from lit_gpt.weights import load_weights

    return load_weights(path)


STEP_FILE = "checkpoint.pth"


# The reference run of each method: 10 steps of 4 samples (micro-batches of 1, accumulated), validation and a
# checkpoint every 5 steps. The DDP test reproduces it with 2 processes, the resume test with a kill at step 5.
STRAIGHT = dict(steps=10, micro=1, global_batch=4, save_interval=5, eval_interval=5)
# LoRA's reference run uses dropout, so that resuming must restore the RNG state to match
STRAIGHT_EXTRA = {"lora": {"lora_dropout": 0.1}}


@pytest.fixture(scope="module", params=METHODS)
def trained(request, tiny_dir, data_dir, tmp_path_factory):
    method = request.param
    out = tmp_path_factory.mktemp(f"straight_{method}")
    summary = load_recipe(method).setup(
        **run_args(method, tiny_dir, data_dir, out, **STRAIGHT, **STRAIGHT_EXTRA.get(method, {}))
    )
    return method, out, summary


def test_recipe_trains_and_saves_only_trained_weights(trained, tiny_dir):
    method, out, summary = trained
    assert summary["steps"] == 10
    losses = read_metrics(out)
    assert sorted(losses) == list(range(1, 11))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (8, 9, 10)) / 3
    assert last < first - 0.05, losses
    val = read_metrics(out, "val_loss")
    assert sorted(val) == [5, 10] and val[10] < val[5]

    final = final_weights(out / "final" / WEIGHTS_FILE[method])
    # tensors only: no optimizer state, no train state (a safetensors file holds nothing else)
    assert final and all(isinstance(v, torch.Tensor) for v in final.values())
    assert not any(k.startswith(("optimizer", "train_state")) for k in final)
    from lit_gpt.weights import find_weights

    base = final_weights(find_weights(tiny_dir))
    if method == "full":
        assert set(final) == set(base)
        assert any(not torch.equal(final[k], base[k]) for k in base)
    else:
        from lit_gpt import adapter, adapter_v2, lora
        from lit_gpt.weights import read_finetuned_metadata

        assert read_finetuned_metadata(out / "final" / WEIGHTS_FILE[method])["method"] == method
        keys = set(final)
        # nothing but the method's own weights (adapter v2 also trains the norms, which the base has too)
        own = {"lora": lora.lora_filter, "adapter": adapter.adapter_filter, "adapter_v2": adapter_v2.adapter_v2_filter}
        assert keys and all(own[method](k) for k in keys)
        assert not keys & {k for k in base if not own[method](k)}
    for name in ("lit_config.json", "tokenizer.json", "finetune.json"):
        assert (out / "final" / name).is_file()
    for step in (5, 10):
        ckpt = saved_state(out / f"step-{step:06d}" / STEP_FILE)
        assert ckpt["train_state"]["step"] == step and "optimizer" in ckpt
    assert not list(out.glob(".*partial"))


def test_result_loads_for_generation(trained, tiny_dir, capsys):
    from lit_gpt import adapter, adapter_v2, lora
    from lit_gpt.generate import generate, load_model
    from lit_gpt.peft import load_variant_model

    method, out, _ = trained
    # the method's generate recipe reads what the finetune recipe wrote
    path_arg = {"full": "checkpoint_path", "lora": "lora_path"}.get(method, "adapter_path")
    capsys.readouterr()
    load_script("generate", method).setup(
        prompt="Repeat: the cat", checkpoint_dir=tiny_dir, max_new_tokens=6, temperature=0.0, prompt_style="alpaca",
        accelerator="cpu", **{path_arg: out / "final" / WEIGHTS_FILE[method]},
    )
    assert capsys.readouterr().out.strip()

    base = load_model(tiny_dir)
    if method == "full":
        model = load_model(out / "final")  # a complete checkpoint directory
    else:
        mod = {"lora": lora, "adapter": adapter, "adapter_v2": adapter_v2}[method]
        model = load_variant_model(mod.GPT, mod.Config, tiny_dir, out / "final" / WEIGHTS_FILE[method]).eval()
    idx = torch.tensor([[1, 200, 300, 400, 500]])
    with torch.no_grad():
        assert not torch.allclose(model(idx), base(idx))  # the finetuned weights are in effect
    assert generate(model, idx[0], 5, temperature=0.0).numel() == 5


def test_resume_after_kill_equals_uninterrupted(trained, tiny_dir, data_dir, tmp_path, monkeypatch):
    """Killed right after the step-5 checkpoint, resumed with --resume auto to step 10 == 10 steps in one go
    (fp32): same losses, same validation, same weights. The data order crosses an epoch boundary (36 training
    samples, 4 per step); LoRA's dropout needs the RNG state restored."""
    method, straight, _ = trained
    recipe = load_recipe(method)
    args = dict(**STRAIGHT, **STRAIGHT_EXTRA.get(method, {}))

    class Killed(Exception):
        pass

    from lit_gpt.runtime import Runtime

    original = Runtime.save_step

    def save_then_die(self, directory, *a, **kw):
        result = original(self, directory, *a, **kw)
        if Path(directory).name == "step-000005":
            raise Killed
        return result

    resumed = tmp_path / "resumed"
    monkeypatch.setattr(Runtime, "save_step", save_then_die)
    with pytest.raises(Killed):
        recipe.setup(**run_args(method, tiny_dir, data_dir, resumed, **args))
    monkeypatch.setattr(Runtime, "save_step", original)
    assert not (resumed / "step-000010").exists()
    # a checkpoint being written when the process died must be ignored by --resume auto
    (resumed / ".step-000008.partial").mkdir()
    (resumed / ".step-000008.partial" / STEP_FILE).write_bytes(b"truncated")
    recipe.setup(**run_args(method, tiny_dir, data_dir, resumed, resume="auto", **args))

    a, b = read_metrics(straight), read_metrics(resumed)
    assert sorted(b) == list(range(1, 11))
    assert [a[s] for s in range(1, 11)] == [b[s] for s in range(1, 11)]
    assert read_metrics(straight, "val_loss") == read_metrics(resumed, "val_loss")
    wa = final_weights(straight / "final" / WEIGHTS_FILE[method])
    wb = final_weights(resumed / "final" / WEIGHTS_FILE[method])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("trained", ["lora"], indirect=True)  # the storage layer is the same for every method
def test_bucket_out_dir_resumes_after_kill_and_logs_there(trained, tiny_dir, data_dir, monkeypatch):
    """--out_dir in a bucket (an in-memory object store that refuses renames and appends, like GCS/S3): killed
    right after the step-5 checkpoint, resumed with --resume auto from the bucket to step 10 == the uninterrupted
    local run (losses, validation, final weights); a step whose commit file is missing is skipped; the CSV logs
    of both runs are in the bucket."""
    import objstore  # tests/objstore.py

    objstore.register()
    method, straight, _ = trained
    from upath import UPath

    from lit_gpt.runtime import Runtime

    recipe = load_recipe(method)
    args = dict(**STRAIGHT, **STRAIGHT_EXTRA.get(method, {}))
    bucket = "objstore://bucket/lora-run"

    class Killed(Exception):
        pass

    original = Runtime.save_step

    def save_then_die(self, directory, *a, **kw):
        result = original(self, directory, *a, **kw)
        if str(directory).endswith("step-000005"):
            raise Killed
        return result

    monkeypatch.setattr(Runtime, "save_step", save_then_die)
    with pytest.raises(Killed):
        recipe.setup(**run_args(method, tiny_dir, data_dir, bucket, **args))
    monkeypatch.setattr(Runtime, "save_step", original)
    root = UPath(bucket)
    assert (root / "step-000005" / STEP_FILE).is_file() and not (root / "step-000010").exists()
    # a save that died before its commit (the weights file, written last) must be ignored by --resume auto
    (root / "step-000008").mkdir(parents=True, exist_ok=True)
    (root / "step-000008" / "finetune.json").write_text("{}")
    summary = recipe.setup(**run_args(method, tiny_dir, data_dir, bucket, resume="auto", **args))
    assert summary["steps"] == 10

    local = Path(tempfile.mkdtemp())
    from lit_gpt.storage import download

    download(root / "logs", local / "logs")
    assert len(list((local / "logs" / "csv").glob("version_*/metrics.csv"))) == 2
    a, b = read_metrics(straight), read_metrics(local)
    assert sorted(b) == list(range(1, 11)) and [a[s] for s in range(1, 11)] == [b[s] for s in range(1, 11)]
    assert read_metrics(straight, "val_loss") == read_metrics(local, "val_loss")
    wa = final_weights(straight / "final" / WEIGHTS_FILE[method])
    wb = final_weights(root / "final" / WEIGHTS_FILE[method])  # read from the bucket
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (root / "final" / "finetune.json").is_file() and (root / "final" / "lit_config.json").is_file()


def test_resume_auto_without_checkpoint_starts_fresh_and_true_requires_one(tiny_dir, data_dir, tmp_path):
    recipe = load_recipe("lora")
    with pytest.raises(LitError, match="no complete checkpoint"):
        recipe.setup(**run_args("lora", tiny_dir, data_dir, tmp_path / "a", steps=2, resume=True))
    summary = recipe.setup(**run_args("lora", tiny_dir, data_dir, tmp_path / "b", steps=2, resume="auto"))
    assert summary["steps"] == 2
    # resuming a finished run does no further step
    again = recipe.setup(**run_args("lora", tiny_dir, data_dir, tmp_path / "b", steps=2, resume="auto"))
    assert again["steps"] == 2 and sorted(read_metrics(tmp_path / "b")) == [1, 2]


def test_bad_settings_are_one_line_errors(tiny_dir, data_dir, tmp_path):
    recipe = load_recipe("lora")
    with pytest.raises(LitError, match="multiple of micro_batch_size"):
        recipe.setup(**run_args("lora", tiny_dir, data_dir, tmp_path, global_batch=3, micro=2))
    with pytest.raises(LitError, match="FSDP needs GPUs"):
        recipe.setup(**run_args("lora", tiny_dir, data_dir, tmp_path, strategy="fsdp"))
    with pytest.raises(LitError, match="no prepared data"):
        recipe.setup(**run_args("lora", tiny_dir, tmp_path / "nothing", tmp_path))
    with pytest.raises(LitError, match="lora_r must be positive"):
        recipe.setup(**run_args("lora", tiny_dir, data_dir, tmp_path, lora_r=0))
    with pytest.raises(LitError, match="context length"):
        args = run_args("lora", tiny_dir, data_dir, tmp_path)
        args["train"].max_seq_length = 10_000
        recipe.setup(**args)


def test_compiled_blocks_train_like_eager(tiny_dir, data_dir, tmp_path, monkeypatch, capsys):
    """--train.compile: the blocks run through torch.compile (here its aot_eager backend: dynamo's capture and
    AOT autograd's forward/backward graphs, without Inductor's code generation, which costs tens of seconds per
    graph on this CPU) and train exactly like the eager blocks on the same power-of-two padding, with one
    compilation per padded length, mode and block kind (not per layer), no graph break, and resumable."""
    from lit_gpt.runtime import Runtime

    monkeypatch.setattr(Runtime, "compile_backend", "aot_eager")
    torch._dynamo.reset()
    method = "lora"  # adapter blocks: test_compiled_blocks_share_one_graph
    recipe = load_recipe(method)
    extra = {"lora_dropout": 0.1}
    eager = recipe.setup(**run_args(method, tiny_dir, data_dir, tmp_path / "eager", steps=4, save_interval=2,
                                    eval_interval=2, data=DataArgs(data_dir=data_dir, pad_pow2=True), **extra))
    capsys.readouterr()
    args = run_args(method, tiny_dir, data_dir, tmp_path / "compiled", steps=4, save_interval=2, eval_interval=2,
                    **extra)
    args["train"].compile = True
    compiled = recipe.setup(**args)
    err, out = capsys.readouterr()
    assert "pads each batch to a power-of-two length" in out + err
    lengths = compiled["padded_lengths"]  # each step's longest padded batch
    assert lengths and all(n & (n - 1) == 0 or n == max(lengths) for n in lengths)  # powers of two, or the cap
    # per padded length: one graph for the blocks whose input needs a gradient and one for block 0, whose input
    # (the frozen embedding's output) does not (test_compiled_blocks_share_one_graph checks "not per layer")
    from lit_gpt.data import load_prepared, pad_length

    samples = load_prepared(data_dir, tiny_dir).train
    cap = max(s["input_ids"].numel() - 1 for s in samples)
    possible = {pad_length(s["input_ids"].numel() - 1, cap, pad_pow2=True) for s in samples}
    assert len(lengths) <= compiled["train_compiles"] <= 2 * len(possible)
    assert "torch.compile (blocks) compilations: train step" in out + err
    for step, loss in read_metrics(tmp_path / "eager").items():
        assert read_metrics(tmp_path / "compiled")[step] == pytest.approx(loss, rel=1e-5), step
    # a compiled run resumes from its checkpoint like an eager one
    resumed_args = run_args(method, tiny_dir, data_dir, tmp_path / "compiled", steps=4, save_interval=2,
                            eval_interval=2, resume=str(tmp_path / "compiled" / "step-000002"), **extra)
    resumed_args["train"].compile = True
    resumed = recipe.setup(**resumed_args)
    assert resumed["steps"] == 4 and resumed["first_step"] == 3
    eager_losses, after_resume = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    for step in (3, 4):  # the resumed run's own log (the newest version) draws the same dropout masks
        assert after_resume[step] == pytest.approx(eager_losses[step], rel=1e-5), step


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_compiled_blocks_share_one_graph(method, monkeypatch):
    """12 blocks, one compiled graph per kind of block for the forward and backward of a padded length, not one
    per layer; a new length compiles again, a seen one does not; losses and gradients equal the eager model's.
    Kinds, with the embedding frozen: LoRA (dropout on) has 2, block 0 (its input needs no gradient) and the
    rest; adapter with adapter_start_layer 6 has 3: the plain blocks 0-5 (no input needs a gradient), block 6
    (adapted, input without gradient) and blocks 7-11."""
    import torch.nn.functional as F

    from lit_gpt import adapter, lora
    from lit_gpt.runtime import Runtime

    monkeypatch.setattr(Runtime, "compile_backend", "aot_eager")
    torch._dynamo.reset()  # graphs are cached on the compiled function's code: start without earlier tests' graphs
    shape = dict(TINY, vocab_size=96, n_layer=12, n_embd=32, intermediate_size=64, tie_embeddings=False)
    if method == "lora":
        variant, per_length = lora, 2
        config = lora.Config(**shape, lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_query=True, lora_value=True)
    else:
        variant, per_length = adapter, 3
        config = adapter.Config(**shape, adapter_prompt_length=4, adapter_start_layer=6)
    torch.manual_seed(0)
    model = variant.GPT(config)
    reference = variant.GPT(config)
    reference.load_state_dict(model.state_dict())
    mark = lora.mark_only_lora_as_trainable if method == "lora" else adapter.mark_only_adapter_as_trainable
    mark(model)
    mark(reference)
    runtime = Runtime(device=torch.device("cpu"))
    assert runtime.compile_count() == 0
    runtime.compile_blocks(model)
    start = runtime.compile_count()
    for i, length in enumerate([16, 16, 32, 16]):
        idx = torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(i))
        losses = []
        for m in (model, reference):
            torch.manual_seed(100 + i)  # the same dropout masks: aot_eager draws them like eager
            loss = F.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        assert runtime.compile_count() - start == per_length * (1 if i < 2 else 2)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # Inductor compiles C++ kernels: ~35 s (the default suite compiles the blocks with aot_eager above)
def test_inductor_compiled_blocks_match_eager():
    """The default backend (Inductor's generated kernels) once, on one padded length: the LoRA model's loss and
    gradients match the eager model's, and the second step reuses the graph."""
    import torch.nn.functional as F

    from lit_gpt import lora
    from lit_gpt.runtime import Runtime

    assert Runtime.compile_backend == "inductor"
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_llama_config(lora.Config, vocab_size=96, n_layer=3, n_embd=32, intermediate_size=64,
                               tie_embeddings=False, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True,
                               lora_value=True, lora_mlp=True)
    model = lora.GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # B = 0 at init would leave the LoRA path out of the comparison
    lora.mark_only_lora_as_trainable(model)
    model.transformer.wte.weight.requires_grad_(True)  # every block's input needs a gradient: one graph
    reference = lora.GPT(config)
    reference.load_state_dict(model.state_dict())
    for a, b in zip(model.parameters(), reference.parameters()):
        b.requires_grad_(a.requires_grad)
    runtime = Runtime(device=torch.device("cpu"))
    runtime.compile_blocks(model)
    start = runtime.compile_count()
    for i in range(2):
        idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i))
        losses = []
        for m in (model, reference):
            loss = F.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert runtime.compile_count() - start == 1
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_refuses_what_it_cannot_do(tiny_dir, data_dir, tmp_path):
    args = run_args("lora", tiny_dir, data_dir, tmp_path)
    args["train"].compile = True
    with pytest.raises(LitError, match="not supported with --quantize"):
        load_recipe("lora").setup(**{**args, "quantize": "bnb.nf4"})


def test_data_from_another_tokenizer_is_rejected(tiny_dir, data_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"] = tok["added_tokens"][:-1]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(LitError, match="prepare it again with --checkpoint_dir"):
        load_recipe("lora").setup(**run_args("lora", other, data_dir, tmp_path / "out"))


def test_cli_error_is_one_line(tiny_dir, tmp_path, forks):
    from fork_server import run_captured

    # `python finetune/lora.py ...` as a process of its own, forked from the fork server (tests/conftest.py `forks`)
    proc = run_captured(
        forks, [str(ROOT / "finetune" / "lora.py"), "--checkpoint_dir", str(tiny_dir),
                "--data.data_dir", str(tmp_path / "missing"), "--out_dir", str(tmp_path / "out")],
        ROOT, os.environ, timeout=300,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: no prepared data") and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_two_processes_ddp_match_one(trained, tiny_dir, data_dir, tmp_path, forks):
    """2 CPU processes (DDP over gloo), each accumulating 2 micro-batches of 1 sample == the reference run's 1
    process accumulating 4: the same samples per step and the same gradient (the step's loss is normalised by
    the target tokens of all processes), so the same losses and weights up to float summation order. (Fabric has no FSDP on the CPU: see test_bad_settings_are_one_line_errors.)"""
    method, one, _ = trained
    if method == "lora":
        # the reference uses dropout, whose masks differ per rank: compare with a dropout-free 1-process run
        one = tmp_path / "one"
        load_recipe(method).setup(**run_args(method, tiny_dir, data_dir, one, **STRAIGHT))
    two = tmp_path / "two"
    cfg = METHOD_ARGS[method]
    cmd = [
        sys.executable, str(ROOT / "finetune" / f"{method}.py"), "--devices", "2", "--precision", "32-true",
        "--accelerator", "cpu",
        "--checkpoint_dir", str(tiny_dir), "--data.data_dir", str(data_dir), "--out_dir", str(two),
        "--train.max_steps", "10", "--train.micro_batch_size", "1", "--train.global_batch_size", "4",
        "--train.learning_rate", str(cfg["lr"]), "--train.min_lr", str(cfg["lr"] / 10), "--train.lr_warmup_steps", "2",
        "--train.save_interval", "5", "--train.seed", "3", "--eval.interval", "5", "--eval.max_iters", "2",
        "--eval.max_new_tokens", "4",
    ]
    for k, v in cfg["kwargs"].items():
        cmd += [f"--{k}", str(v)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # rank 0 is forked from the fork server (tests/conftest.py `forks`: torch imported already), and starts rank 1
    # as the recipe does everywhere (a `python` process of its own)
    from fork_server import run_captured

    proc = run_captured(forks, cmd[1:], cwd=tmp_path, env=env, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    a, b = read_metrics(one), read_metrics(two)
    assert sorted(b) == list(range(1, 11))
    for s in a:
        assert b[s] == pytest.approx(a[s], abs=2e-4), (a, b)
    va, vb = read_metrics(one, "val_loss"), read_metrics(two, "val_loss")
    assert vb.keys() == va.keys() and all(vb[s] == pytest.approx(va[s], abs=2e-4) for s in va)
    wa = final_weights(one / "final" / WEIGHTS_FILE[method])
    wb = final_weights(two / "final" / WEIGHTS_FILE[method])
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-4) for k in wa)


@pytest.mark.slow
def test_lora_on_real_smollm2_lowers_validation_loss(smollm2_dir, tmp_path):
    """LoRA on the real SmolLM2-135M with 32 Alpaca-style samples: the validation loss goes down."""
    from lit_gpt import data

    rng = random.Random(0)
    colors = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
    rows = []
    for i in range(40):
        a, b = rng.sample(colors, 2)
        rows.append({"instruction": "Name the two colors in this list, separated by ' and '.",
                     "input": f"{rng.randint(1, 9)} {a} apples, {rng.randint(1, 9)} {b} pears",
                     "output": f"{a} and {b}"})
    src = tmp_path / "colors.json"
    src.write_text(json.dumps(rows))
    records, bad = data.read_records(src)
    parsed, bad2 = data.records_to_rows(records, data.instruction_rows())
    data.prepare(parsed, bad + bad2, checkpoint_dir=smollm2_dir, destination=tmp_path / "prepared",
                 source=str(src), max_seq_length=128, val_split_fraction=0.2, seed=0)
    out = tmp_path / "out"
    load_recipe("lora").setup(
        checkpoint_dir=smollm2_dir, out_dir=out, precision="32-true", accelerator="cpu",
        data=DataArgs(data_dir=tmp_path / "prepared"),
        train=TrainArgs(global_batch_size=4, micro_batch_size=4, max_steps=6, learning_rate=3e-3, min_lr=3e-4,
                        lr_warmup_steps=1, save_interval=None, seed=0),
        eval=EvalArgs(interval=6, max_iters=2, max_new_tokens=0, initial_validation=True),
        lora_r=8, lora_alpha=16, lora_dropout=0.0,
    )
    val = read_metrics(out, "val_loss")
    assert sorted(val) == [0, 6]
    print("validation loss", val)
    assert val[6] < val[0] - 0.1, val


def test_loss_runs_the_head_on_labelled_positions_only():
    """`targets_only`: the vocab projection sees exactly the positions that have a label, row by row (not the masked
    prompts, not the padding), and the loss and gradients equal those over full logits."""
    from lit_gpt import GPT, Config
    from lit_gpt.batches import IGNORE_INDEX
    from lit_gpt.losses import loss_sum

    torch.manual_seed(0)
    model = GPT(Config.from_name("pythia-70m", n_layer=2, vocab_size=100, block_size=64))
    model.apply(model._init_weights)
    idx = torch.randint(0, 100, (3, 20))
    labels = idx.clone()
    labels[0, :5] = labels[1, :12] = labels[2, :3] = labels[2, 15:] = IGNORE_INDEX  # prompts, and padding in row 2
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[:-1].numel()))
    loss = loss_sum(model, idx, labels)
    hook.remove()
    assert head_rows == [int((labels != IGNORE_INDEX).sum())] == [15 + 8 + 12]
    logits = model(idx)
    reference = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    weight = model.transformer.h[0].attn.qkv.weight
    (g,) = torch.autograd.grad(loss, weight)
    (g_ref,) = torch.autograd.grad(reference, weight)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)
    # nothing to learn: a zero loss with a graph, no error
    none = torch.full_like(labels, IGNORE_INDEX)
    zero = loss_sum(model, idx, none)
    assert zero.item() == 0.0 and zero.requires_grad
