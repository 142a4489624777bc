"""Training mixture-of-experts models (tests/words.py `MOE_FAMILIES`: Mixtral, Qwen3-MoE with a dense first layer,
gpt-oss) through the real CPU recipes (`finetune/X.py`, in this process, through jsonargparse like their command
lines), on tiny word-tokenizer checkpoints:

* LoRA (attention, the dense MLP and, with --lora_experts, every expert), adapter, adapter v2 and full finetuning run
  2 steps on each family: finite losses that go down (both steps see the same 8 rows), `aux_loss` and the expert-load
  metrics in the CSV log, `expert_load.csv` beside it with k assignments per real token in every MoE layer; a dense
  model logs neither;
* the logged step-1 `aux_loss` is transformers' `load_balancing_loss_func` on the base model's router logits and
  the micro-batches' attention masks (padding out);
* one optimizer step's gradient (SGD, no clipping, no decay) is that of mean CE per target token + coef x the mean
  aux loss over the step's micro-batches (the checkpoint's coefficient, or --moe.router_aux_loss_coef; with
  --moe.capacity_factor dropping assignments) and not that of the CE alone;
* resume after step 1 is bit-exact (final weights, step-2 loss and aux loss) for every family and method;
* LoRA on the experts merges (scripts/merge_lora.py) into a model with the LoRA model's outputs (1e-5), on every
  dispatch path; the router is never adapted;
* settings that cannot apply are refused in one line, before anything is written.
"""

import contextlib
import csv
import importlib.util
import io
import json
import shutil
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from words import GEN_PROMPT, MOE_FAMILIES, WORDS, make_word_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
COMMON = ["--train.global_batch_size", "8", "--train.micro_batch_size", "4", "--train.max_steps", str(STEPS),
          "--train.save_interval", "1", "--train.log_interval", "1", "--train.lr_warmup_steps", "1",
          "--data.shuffle", "false", "--eval.interval", "1000", "--eval.final_validation", "false",
          "--accelerator", "cpu", "--precision", "32-true"]
LORA_DENSE = ["--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lora_mlp", "true",
              "--train.learning_rate", "0.02"]
METHODS = {
    "lora": ([*LORA_DENSE, "--lora_experts", "true"], "lit_model.lora.safetensors"),
    "adapter": (["--adapter_start_layer", "0", "--train.learning_rate", "0.05"], "lit_model.adapter.safetensors"),
    "adapter_v2": (["--adapter_start_layer", "0", "--train.learning_rate", "0.02"], "lit_model.adapter_v2.safetensors"),
    "full": (["--train.learning_rate", "0.002"], "lit_model.safetensors"),
}
MATRIX = [(f, m) for f in MOE_FAMILIES for m in METHODS]
INPUT_WORDS = [1, 6, 3, 9, 2, 7, 4, 10]  # 8 rows of different lengths: every micro-batch of 4 is padded


def rows() -> List[dict]:
    return [{"instruction": GEN_PROMPT, "input": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n)),
             "output": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))} for i, n in enumerate(INPUT_WORDS)]


def _load(script: str):
    spec = importlib.util.spec_from_file_location("moe_" + script.replace("/", "_")[:-3], ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe(method: str, args: List[str]) -> str:
    from jsonargparse import CLI

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        CLI(_load(f"finetune/{method}.py").setup, args=args)
    return out.getvalue()


def _args(ckpt: Path, family: str, method: str, out_dir: Path, *extra: str) -> List[str]:
    return ["--checkpoint_dir", str(ckpt / family), "--data.data_dir", str(ckpt / "data"), "--out_dir", str(out_dir),
            *COMMON, *METHODS[method][0], *extra]


def _log_rows(out_dir: Path) -> Dict[int, dict]:
    """step -> the logged training row (the last version's row wins)."""
    found = {}
    for path in sorted((out_dir / "logs" / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("loss"):
                    found[int(float(row["step"]))] = row
    return found


def _load_csv(out_dir: Path) -> List[dict]:
    files = sorted((out_dir / "logs" / "csv").glob("version_*/expert_load.csv"))
    return [row for path in files for row in csv.DictReader(open(path))]


def _base_model(ckpt_dir: Path, **overrides):
    from lit_gpt import GPT, Config
    from lit_gpt.weights import load_weights

    model = GPT(Config.from_checkpoint(ckpt_dir, **overrides))
    model.load_state_dict(load_weights(ckpt_dir / "lit_model.safetensors"))
    return model


def _micro_batches(ckpt: Path, rows_per_batch: int = 4) -> List[dict]:
    """The loop's micro-batches of step 1 (file order, padded to each micro-batch's longest row)."""
    from lit_gpt.batches import collate

    train = torch.load(ckpt / "data" / "train.pt", weights_only=True)
    longest = max(s["input_ids"].numel() for s in train) - 1
    batches = [collate(train[i: i + rows_per_batch], longest) for i in range(0, 8, rows_per_batch)]
    for i, batch in enumerate(batches):  # each row's input length, from the samples themselves
        samples = train[i * rows_per_batch: (i + 1) * rows_per_batch]
        batch["lengths"] = torch.tensor([s["input_ids"].numel() - 1 for s in samples])
    return batches


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_training")
    for family in MOE_FAMILIES:
        make_word_checkpoint(root / family, family=family)
    make_word_checkpoint(root / "dense")  # the tiny Llama-style model, the same word tokenizer
    (root / "rows.json").write_text(json.dumps(rows()))
    with contextlib.redirect_stdout(io.StringIO()):
        _load("scripts/prepare_alpaca.py").prepare(checkpoint_dir=root / "dense", data_file=root / "rows.json",
                                                   destination_path=root / "data", val_split_fraction=0.0)
    return root


@pytest.fixture(scope="module")
def runs(ckpt):
    """Every family x method, then the same run stopped after step 1 (its step folder copied into a new out_dir, as
    a preempted run leaves it) and resumed with --resume auto; and one dense LoRA run."""
    root = ckpt / "runs"
    for family, method in MATRIX:
        full, resumed = root / f"{family}_{method}", root / f"{family}_{method}_resumed"
        _recipe(method, _args(ckpt, family, method, full))
        shutil.copytree(full / "step-000001", resumed / "step-000001")
        _recipe(method, _args(ckpt, family, method, resumed, "--resume", "auto"))
    _recipe("lora", ["--checkpoint_dir", str(ckpt / "dense"), "--data.data_dir", str(ckpt / "data"), "--out_dir",
                     str(root / "dense_lora"), *COMMON, *LORA_DENSE])
    return root


def _transformers_aux(model, batches: List[dict]) -> float:
    """transformers' `load_balancing_loss_func` on `model`'s router logits for each micro-batch (the attention
    mask: each row's real tokens, from the samples' lengths), averaged over the micro-batches."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from lit_gpt.moe import moe_layers

    logits: List[torch.Tensor] = []
    hooks = [m.router.register_forward_hook(lambda mod, inp, out: logits.append(out.detach()))
             for m in moe_layers(model)]
    values = []
    try:
        model.train()
        for batch in batches:
            logits.clear()
            with torch.no_grad():
                model(batch["input_ids"])
            mask = torch.arange(batch["input_ids"].size(1)) < batch["lengths"].unsqueeze(1)
            values.append(float(load_balancing_loss_func(tuple(logits), model.config.n_expert,
                                                         model.config.n_expert_per_token, attention_mask=mask)))
    finally:
        for h in hooks:
            h.remove()
    return sum(values) / len(values)


def _real_tokens(ckpt: Path) -> int:
    train = torch.load(ckpt / "data" / "train.pt", weights_only=True)
    return sum(s["input_ids"].numel() - 1 for s in train)


@pytest.mark.parametrize("family,method", MATRIX)
def test_each_method_trains_each_family_and_logs_the_router(ckpt, runs, family, method):
    from lit_gpt import Config

    out = runs / f"{family}_{method}"
    assert (out / "final" / METHODS[method][1]).is_file()
    logged = _log_rows(out)
    assert sorted(logged) == [1, 2]
    loss = {s: float(r["loss"]) for s, r in logged.items()}
    assert all(torch.isfinite(torch.tensor(v)) for v in loss.values()), loss
    assert loss[2] < loss[1], loss  # both steps train on the same 8 rows
    config = Config.from_checkpoint(ckpt / family)
    E, k = config.n_expert, config.n_expert_per_token
    for step, row in logged.items():
        aux = float(row["aux_loss"])
        assert 0.5 * k < aux <= E * k, (step, aux)  # about k when balanced; E * k if one expert took everything
        assert float(row["expert_dropped"]) == 0.0  # capacity factor 2 of 4 experts x 2: no expert can overflow
        assert 0.0 <= float(row["expert_load_min"]) <= 1.0 <= float(row["expert_load_max"]) <= E
    # the per-expert counts beside the metrics: every MoE layer (block index), every expert, each logged step;
    # k assignments per real token of the step (padding not counted)
    load = _load_csv(out)
    layers = [i for i in range(config.n_layer) if config.is_moe_layer(i)]
    assert list(load[0]) == ["step", "layer", "expert", "assigned", "dropped", "load"]
    assert [(int(r["step"]), int(r["layer"]), int(r["expert"])) for r in load] == [
        (s, layer, e) for s in (1, 2) for layer in layers for e in range(E)]
    for step in (1, 2):
        for layer in layers:
            cells = [r for r in load if int(r["step"]) == step and int(r["layer"]) == layer]
            assert sum(int(r["assigned"]) for r in cells) == k * _real_tokens(ckpt)
            assert all(int(r["dropped"]) == 0 for r in cells)
        shares = [float(r["load"]) for r in load if int(r["step"]) == step]
        assert max(shares) == pytest.approx(float(logged[step]["expert_load_max"]), rel=1e-5)
        assert min(shares) == pytest.approx(float(logged[step]["expert_load_min"]), rel=1e-5)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_logged_aux_loss_is_transformers_load_balancing_loss(ckpt, runs, family):
    """Step 1 starts from the base weights for every method: its logged aux_loss is transformers' function on the
    base model's router logits and the micro-batches' real tokens, and the same for every method."""
    expected = _transformers_aux(_base_model(ckpt / family), _micro_batches(ckpt))
    for method in METHODS:
        got = float(_log_rows(runs / f"{family}_{method}")[1]["aux_loss"])
        assert got == pytest.approx(expected, rel=1e-5), (method, got, expected)
    # padding matters here: the same function without the mask gives another value
    unmasked = _transformers_aux(_base_model(ckpt / family), [dict(b, lengths=torch.full_like(b["lengths"], 10**6))
                                                             for b in _micro_batches(ckpt)])
    assert abs(unmasked - expected) > 1e-4


@pytest.mark.parametrize("family,method", MATRIX)
def test_resume_after_step_1_is_bit_exact(runs, family, method):
    from lit_gpt.weights import load_weights

    full, resumed = runs / f"{family}_{method}", runs / f"{family}_{method}_resumed"
    ref, got = load_weights(full / "final" / METHODS[method][1]), load_weights(resumed / "final" / METHODS[method][1])
    assert ref.keys() == got.keys() and ref
    for name in ref:
        assert torch.equal(ref[name], got[name]), (name, (ref[name] - got[name]).abs().max())
    a, b = _log_rows(full), _log_rows(resumed)
    assert sorted(b) == [STEPS]  # the resumed run logged step 2 only
    for key in ("loss", "aux_loss", "expert_load_max", "expert_load_min", "expert_dropped"):
        assert a[STEPS][key] == b[STEPS][key], key
    assert [r for r in _load_csv(full) if r["step"] == str(STEPS)] == _load_csv(resumed)


def test_dense_model_logs_no_router_metrics(runs):
    logged = _log_rows(runs / "dense_lora")
    assert sorted(logged) == [1, 2]
    assert not any(k.startswith(("aux_loss", "expert_")) and v for row in logged.values() for k, v in row.items())
    assert not list((runs / "dense_lora").rglob("expert_load.csv"))


def test_token_mask_marks_the_real_tokens_of_a_padded_batch(ckpt):
    from lit_gpt.losses import token_mask

    for batch in _micro_batches(ckpt):
        assert len(set(batch["lengths"].tolist())) == 4  # padded rows
        expected = torch.arange(batch["input_ids"].size(1)) < batch["lengths"].unsqueeze(1)
        assert torch.equal(token_mask(batch["labels"]), expected)


# (family, extra flags, the coefficient in effect, the capacity factor in effect)
STEP_CASES = [
    ("mixtral", [], 0.02, 2.0),  # the checkpoint's coefficient
    ("qwen3_moe", ["--moe.router_aux_loss_coef", "0.5"], 0.5, 2.0),
    # capacity buffers on the CPU too (by default the CPU groups the rows by expert and drops nothing)
    ("gpt_oss", ["--moe.capacity_factor", "0.5", "--moe.dispatch", "capacity"], 0.9, 0.5),  # drops assignments
    ("gpt_oss", ["--moe.router_aux_loss_coef", "0", "--moe.capacity_factor", "none"], 0.0, None),
]


@pytest.mark.parametrize("family,extra,coef,factor", STEP_CASES)
def test_one_step_descends_mean_ce_plus_coef_times_mean_aux(ckpt, tmp_path, family, extra, coef, factor):
    """One SGD step (lr 1, no momentum history, decay or clipping) of full finetuning moves every weight by minus the
    gradient of  sum(CE) / target tokens + coef / micro-batches x sum(transformers' aux loss of each micro-batch),
    computed here from the same two padded micro-batches; the CE alone gives another gradient (unless coef is 0)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from lit_gpt.losses import cross_entropy_sum
    from lit_gpt.moe import moe_layers
    from lit_gpt.weights import load_weights

    out = tmp_path / "out"
    _recipe("full", ["--checkpoint_dir", str(ckpt / family), "--data.data_dir", str(ckpt / "data"), "--out_dir",
                     str(out), *COMMON, "--train.max_steps", "1", "--optimizer", "sgd", "--train.learning_rate", "1",
                     "--train.lr_warmup_steps", "0", "--train.weight_decay", "0", "--train.max_norm", "null", *extra])
    logged = _log_rows(out)[1]
    assert (float(logged["expert_dropped"]) > 0) == (factor == 0.5), logged
    stepped = load_weights(out / "final" / "lit_model.safetensors")

    dispatch = "capacity" if "--moe.dispatch" in extra else "auto"
    model = _base_model(ckpt / family, moe_capacity_factor=factor, moe_dispatch=dispatch)
    recorded = json.loads((out / "step-000001" / "finetune.json").read_text())["moe"]  # a resume must match it
    assert recorded == {"capacity_factor": factor, "dispatch": dispatch, "router_aux_loss_coef": coef}
    model.train()
    logits: List[torch.Tensor] = []
    for m in moe_layers(model):
        m.router.register_forward_hook(lambda mod, inp, o: logits.append(o))
    batches = _micro_batches(ckpt)
    targets = sum(int((b["labels"] != -100).sum()) for b in batches)
    ce, aux = 0.0, 0.0
    for b in batches:
        logits.clear()
        ce = ce + cross_entropy_sum(model(b["input_ids"]), b["labels"]) / targets
        mask = torch.arange(b["input_ids"].size(1)) < b["lengths"].unsqueeze(1)
        aux = aux + load_balancing_loss_func(tuple(logits), model.config.n_expert, model.config.n_expert_per_token,
                                             attention_mask=mask) / len(batches)
    params = dict(model.named_parameters())
    g_all = torch.autograd.grad(ce + coef * aux, list(params.values()), retain_graph=True, allow_unused=True)
    g_ce = torch.autograd.grad(ce, list(params.values()), allow_unused=True)
    worst = differs = 0.0
    for (name, p), g, gc in zip(params.items(), g_all, g_ce):
        g = torch.zeros_like(p) if g is None else g
        gc = torch.zeros_like(p) if gc is None else gc
        moved = p.detach() - stepped[name]  # lr 1: the step is the gradient
        worst = max(worst, (moved - g).abs().max().item())
        differs = max(differs, (g - gc).abs().max().item())
    assert worst < 2e-6, worst
    assert float(logged["loss"]) == pytest.approx(ce.item(), rel=1e-5)  # the logged loss is the CE alone
    assert float(logged["aux_loss"]) == pytest.approx(aux.item(), rel=1e-5)
    assert (differs > 100 * 2e-6) == (coef > 0), differs


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_lora_on_experts_merges_into_the_same_outputs_on_every_dispatch(ckpt, family):
    """LoRA on the experts (and the dense MLP): the batched (capacity, dense), the sorted (grouped: torch._grouped_mm;
    loop; dropless tiles) and the per-row (gather) expert paths give the same outputs, and merging the updates into the weights keeps them (1e-5); the router is never adapted."""
    import torch.nn as nn

    from lit_gpt import lora
    from lit_gpt.moe import moe_layers
    from lit_gpt.weights import load_weights

    config = lora.Config.from_checkpoint(ckpt / family, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_experts=True,
                                         lora_mlp=True)
    model = lora.GPT(config)
    model.load_state_dict(load_weights(ckpt / family / "lit_model.safetensors"), strict=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    moes = moe_layers(model)
    assert moes and all(type(m.router) is nn.Linear for m in moes)
    assert not any("router" in n and "lora" in n for n, _ in model.named_parameters())
    assert all(isinstance(getattr(m.experts, n), lora.LoRAExpertLinear) for m in moes for n in ("fc_1", "fc_2", "proj"))
    if family == "qwen3_moe":  # its dense first layer's MLP gets lora_mlp's updates
        assert isinstance(model.transformer.h[0].mlp.fc_1, lora.LoRALinear)
    model.eval()
    x = torch.randint(0, config.vocab_size, (2, 9))

    def outputs():
        found = {}
        for dispatch in ("grouped", "loop", "gather", "capacity", "dropless", "dense"):
            for m in moes:
                m.dispatch = dispatch
            with torch.no_grad():
                found[dispatch] = model(x)
        return found

    before = outputs()
    with torch.no_grad():
        plain = _base_model(ckpt / family).eval()(x)
    assert (before["dense"] - plain).abs().max() > 1e-2  # the expert updates change the outputs
    for dispatch, y in before.items():
        torch.testing.assert_close(y, before["dense"], atol=1e-5, rtol=0, msg=dispatch)
    lora.merge_lora_weights(model)
    for dispatch, y in outputs().items():
        torch.testing.assert_close(y, before[dispatch], atol=1e-5, rtol=0, msg=dispatch)
    lora.unmerge_lora_weights(model)
    torch.testing.assert_close(outputs()["capacity"], before["capacity"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_merge_lora_script_merges_trained_expert_updates(ckpt, runs, family, tmp_path):
    from lit_gpt import lora
    from lit_gpt.peft import load_variant_model
    from lit_gpt.weights import load_weights

    lora_path = runs / f"{family}_lora" / "final" / METHODS["lora"][1]
    trained = load_weights(lora_path)
    assert any(".experts." in k and k.endswith("lora_B") and v.abs().max() > 0 for k, v in trained.items())
    assert not any("router" in k for k in trained)
    with contextlib.redirect_stderr(io.StringIO()):
        _load("scripts/merge_lora.py").setup(ckpt / family, lora_path, tmp_path / "merged")
    merged = _base_model(tmp_path / "merged").eval()
    reference = load_variant_model(lora.GPT, lora.Config, ckpt / family, lora_path).eval()
    assert reference.config.lora_experts
    x = torch.randint(0, merged.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(x), reference(x), atol=1e-5, rtol=0)


REFUSED = [
    # (checkpoint, recipe, flags, the line)
    ("dense", "full", ["--moe.router_aux_loss_coef", "0.1"], "apply to mixture-of-experts models; 'tiny-words' is"
                                                             " dense: leave them out"),
    ("dense", "adapter", ["--adapter_start_layer", "0", "--moe.capacity_factor", "none"],
     "apply to mixture-of-experts models"),
    ("mixtral", "full", ["--moe.capacity_factor", "-1"], '--moe.capacity_factor must be > 0, "none" or "config"'),
    ("mixtral", "full", ["--moe.router_aux_loss_coef", "-0.5"], "--moe.router_aux_loss_coef must be >= 0"),
    ("dense", "lora", ["--lora_experts", "true"], "lora_experts needs a mixture-of-experts model (this one is dense)"),
]


@pytest.mark.parametrize("checkpoint,method,flags,line", REFUSED)
def test_settings_that_cannot_apply_are_refused_in_one_line(ckpt, tmp_path, capsys, checkpoint, method, flags, line):
    from lit_gpt.utils import run_cli

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        run_cli(_load(f"finetune/{method}.py").setup,
                args=["--checkpoint_dir", str(ckpt / checkpoint), "--data.data_dir", str(ckpt / "data"), "--out_dir",
                      str(out), *COMMON, *flags])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and line in err, err
    assert not out.exists()  # refused before anything was written


def test_resume_with_other_moe_settings_is_refused(ckpt, runs, tmp_path, capsys):
    from lit_gpt.utils import run_cli

    out = tmp_path / "out"
    shutil.copytree(runs / "mixtral_full" / "step-000001", out / "step-000001")
    with pytest.raises(SystemExit) as exc:
        run_cli(_load("finetune/full.py").setup,
                args=[*_args(ckpt, "mixtral", "full", out), "--resume", "auto", "--moe.router_aux_loss_coef", "0.5"])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "belongs to a run with other arguments (moe.router_aux_loss_coef: 0.02 -> 0.5)" in err
    assert sorted(p.name for p in out.iterdir() if p.name != "logs") == ["step-000001"]


@pytest.mark.slow
def test_two_ddp_processes_match_one(ckpt, runs, tmp_path):
    """2 CPU processes (DDP over gloo), each with one micro-batch of 4 rows per step, against 1 process with two
    micro-batches of the same 4 + 4 rows: the same aux loss per micro-batch, so the same objective, logged losses,
    expert load (counts summed over the processes) and final weights (gpt-oss: coefficient 0.9)."""
    import os
    import subprocess
    import sys

    from lit_gpt.weights import load_weights

    two = tmp_path / "two"
    cmd = [sys.executable, str(ROOT / "finetune" / "full.py"), "--devices", "2", "--strategy", "ddp",
           *_args(ckpt, "gpt_oss", "full", two)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    one = runs / "gpt_oss_full"
    a, b = _log_rows(one), _log_rows(two)
    assert sorted(b) == [1, 2]
    for step in (1, 2):
        for key in ("loss", "aux_loss", "expert_load_max", "expert_load_min", "expert_dropped"):
            assert float(b[step][key]) == pytest.approx(float(a[step][key]), rel=1e-5, abs=1e-7), (step, key)
    assert [(r["step"], r["layer"], r["expert"], r["assigned"]) for r in _load_csv(two)] == [
        (r["step"], r["layer"], r["expert"], r["assigned"]) for r in _load_csv(one)]
    wa, wb = load_weights(one / "final" / METHODS["full"][1]), load_weights(two / "final" / METHODS["full"][1])
    assert wa.keys() == wb.keys()
    for name in wa:
        assert (wa[name] - wb[name]).abs().max() < 1e-5, name
