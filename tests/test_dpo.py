"""DPO as an objective of the one training loop, on the CPU (finetune/dpo.py; XLA: tests/xla/test_xla_dpo.py; the
loss and gradients against TRL: tests/test_dpo_parity.py).

* a LoRA run with dropout, epoch-driven, from pairs prepared by scripts/prepare_preferences.py: the rewards and the
  reward accuracy are logged (train and validation), the preference margin grows, the LoRA file generates;
* exact resume after a kill (LoRA with dropout; full finetuning with the reference read back from its file);
* the LoRA reference (adapters switched off) equals reference log-probabilities computed beforehand;
* 2 processes (DDP) equal 1 (the step's loss is the mean over the pairs of all processes);
* bad settings and instruction data are one line each, nothing written;
* the real SmolLM2: a short DPO run raises the reward accuracy on held-out pairs above chance.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from lit_gpt.args import DataArgs, DPOArgs, EvalArgs, TrainArgs
from lit_gpt.utils import LitError
from test_finetune import final_weights, load_recipe, load_script, read_metrics
from words import WORDS, make_word_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LORA_FILE = "lit_model.lora.safetensors"


def preference_rows(n: int = 30):
    """Prompts that ask to repeat words; the chosen reply repeats them, the rejected one reverses them."""
    rows = []
    for i in range(n):
        ws = [WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 4)]
        rows.append({"prompt": "Repeat the words: " + " ".join(ws), "chosen": " ".join(ws),
                     "rejected": " ".join(reversed(ws)) + " " + WORDS[i % len(WORDS)]})
    return rows


def prepare_pairs(checkpoint_dir: Path, rows, destination: Path, **kwargs) -> Path:
    """`rows` through scripts/prepare_preferences.py, as a user prepares them."""
    src = destination.parent / f"{destination.name}.json"
    src.write_text(json.dumps(rows))
    with contextlib.redirect_stdout(io.StringIO()):
        load_script("scripts", "prepare_preferences").prepare(
            data_file=src, destination_path=destination, checkpoint_dir=checkpoint_dir, **kwargs)
    return destination


@pytest.fixture(scope="module")
def words_dir(tmp_path_factory) -> Path:
    return make_word_checkpoint(tmp_path_factory.mktemp("dpo") / "words")


@pytest.fixture(scope="module")
def pairs_dir(words_dir, tmp_path_factory) -> Path:
    return prepare_pairs(words_dir, preference_rows(), tmp_path_factory.mktemp("pairs") / "prepared",
                         val_split_fraction=0.2, prompt_style="alpaca")


def dpo_args(checkpoint_dir: Path, data_dir: Path, out_dir: Path, method: str = "lora", steps=None, epochs: int = 2,
             reference: str = "auto", lr: float = 2e-2, dropout: float = 0.1, save_interval=3, micro: int = 2,
             **overrides):
    args = dict(
        checkpoint_dir=checkpoint_dir, out_dir=out_dir, precision="32-true", accelerator="cpu", method=method,
        data=DataArgs(data_dir=data_dir),
        train=TrainArgs(global_batch_size=4, micro_batch_size=micro, max_steps=steps, epochs=epochs, learning_rate=lr,
                        min_lr=lr / 10, lr_warmup_steps=1, save_interval=save_interval, log_interval=1, seed=3),
        eval=EvalArgs(interval=3, max_iters=3, max_new_tokens=3),
        dpo=DPOArgs(beta=0.5, reference=reference),
    )
    if method == "lora":
        args.update(lora_r=4, lora_alpha=8, lora_dropout=dropout, lora_mlp=True)
    args.update(overrides)
    return args


@pytest.fixture(scope="module")
def lora_run(words_dir, pairs_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_lora")
    summary = load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, out))
    return out, summary


def test_lora_dpo_logs_rewards_and_exports_loadable_weights(lora_run, words_dir, pairs_dir, capsys):
    out, summary = lora_run
    meta = json.loads((pairs_dir / "meta.json").read_text())
    steps = 2 * (meta["train_samples"] if "train_samples" in meta else 24) // 4
    loss = read_metrics(out)
    assert sorted(loss) == list(range(1, steps + 1))  # epoch-driven: 2 epochs of 24 pairs, 4 per step
    assert loss[1] == pytest.approx(0.6931, abs=2e-3)  # step 1: the policy is the reference, -log sigmoid(0)
    margin = read_metrics(out, "reward_margin")
    assert margin[steps] > margin[1] + 0.1 and loss[steps] < loss[1] - 0.05, (loss, margin)
    for key in ("rewards_chosen", "rewards_rejected", "reward_accuracy", "val_loss", "val_reward_accuracy",
                "val_reward_margin", "val_rewards_chosen", "val_rewards_rejected"):
        assert read_metrics(out, key), key
    assert read_metrics(out, "val_reward_accuracy")[steps] > 0.5
    assert summary["reward_accuracy"] == pytest.approx(read_metrics(out, "reward_accuracy")[steps])
    saved = json.loads((out / f"step-{steps:06d}" / "finetune.json").read_text())
    assert saved["dpo"] == {"beta": 0.5, "loss": "sigmoid", "label_smoothing": 0.0, "reference": "adapters_off"}
    assert saved["method"] == "lora"
    capsys.readouterr()
    load_script("generate", "lora").setup(prompt="Repeat the words: red green", checkpoint_dir=words_dir,
                                          lora_path=out / "final" / LORA_FILE, max_new_tokens=4, temperature=0.0,
                                          prompt_style="alpaca", accelerator="cpu")
    assert capsys.readouterr().out.strip()


def _kill_after(monkeypatch, step_name: str):
    from lit_gpt.runtime import Runtime

    class Killed(Exception):
        pass

    original = Runtime.save_step

    def save_then_die(self, directory, *a, **kw):
        result = original(self, directory, *a, **kw)
        if Path(directory).name == step_name:
            raise Killed
        return result

    monkeypatch.setattr(Runtime, "save_step", save_then_die)
    return Killed, lambda: monkeypatch.setattr(Runtime, "save_step", original)


def test_lora_resume_after_kill_equals_uninterrupted(lora_run, words_dir, pairs_dir, tmp_path, monkeypatch):
    """Killed after the step-3 checkpoint (dropout on: the RNG state matters), resumed with --resume auto."""
    straight, _ = lora_run
    resumed = tmp_path / "resumed"
    Killed, restore = _kill_after(monkeypatch, "step-000003")
    with pytest.raises(Killed):
        load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, resumed))
    restore()
    load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, resumed, resume="auto"))
    for key in ("loss", "reward_accuracy", "reward_margin", "val_loss", "val_reward_margin"):
        assert read_metrics(straight, key) == read_metrics(resumed, key), key
    wa, wb = final_weights(straight / "final" / LORA_FILE), final_weights(resumed / "final" / LORA_FILE)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_full_dpo_precomputes_the_reference_once_and_resumes_exactly(words_dir, pairs_dir, tmp_path, monkeypatch,
                                                                     capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = dict(method="full", steps=6, lr=2e-3)
    load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, straight, **args))
    assert "Reference log-probabilities of 30 pairs saved" in capsys.readouterr().out
    assert (straight / "reference_logps.pt").is_file()
    config = json.loads((straight / "final" / "lit_config.json").read_text())
    assert not any(k.startswith("lora_") for k in config)  # a plain checkpoint, whatever the recipe's Config
    Killed, restore = _kill_after(monkeypatch, "step-000003")
    with pytest.raises(Killed):
        load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, resumed, **args))
    restore()
    capsys.readouterr()
    load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, resumed, resume="auto", **args))
    assert "Reference log-probabilities of 30 pairs read from" in capsys.readouterr().out
    assert read_metrics(straight) == read_metrics(resumed)
    assert read_metrics(straight, "val_reward_accuracy") == read_metrics(resumed, "val_reward_accuracy")
    name = "lit_model.safetensors"
    wa, wb = final_weights(straight / "final" / name), final_weights(resumed / "final" / name)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # another base (or length, dtype, data) is never served a stale reference: computed again
    stale = torch.load(straight / "reference_logps.pt", weights_only=True)
    stale["key"]["base"] = "another"
    torch.save(stale, resumed / "reference_logps.pt")
    capsys.readouterr()
    load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, tmp_path / "again", **args))
    assert "saved" in capsys.readouterr().out


def test_lora_reference_with_adapters_off_equals_precomputed(words_dir, pairs_dir, tmp_path):
    """The base model with its adapters switched off is the reference that precomputing gives: same run."""
    runs = {}
    for reference in ("adapters_off", "precomputed"):
        out = tmp_path / reference
        load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, out, steps=4, reference=reference, dropout=0.0))
        runs[reference] = out
    a, b = (read_metrics(runs[r]) for r in ("adapters_off", "precomputed"))
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a), (a, b)
    ma, mb = (read_metrics(runs[r], "reward_margin") for r in ("adapters_off", "precomputed"))
    assert all(mb[s] == pytest.approx(ma[s], rel=1e-4, abs=1e-6) for s in ma)


@pytest.mark.parametrize("overrides, message", [
    (dict(dpo=DPOArgs(loss="sigmoid", label_smoothing=0.1)), "--dpo.label_smoothing applies to --dpo.loss robust"),
    (dict(dpo=DPOArgs(beta=0.0)), "--dpo.beta must be > 0"),
    (dict(dpo=DPOArgs(loss="robust", label_smoothing=0.5)), "--dpo.label_smoothing must be in [0, 0.5)"),
    (dict(method="full", dpo=DPOArgs(reference="adapters_off")), "--dpo.reference adapters_off needs LoRA"),
    (dict(instruction_data=True), "holds instruction data, not preference pairs"),
])
def test_bad_settings_are_one_line_and_write_nothing(words_dir, pairs_dir, tmp_path, overrides, message):
    data_dir = pairs_dir
    if overrides.pop("instruction_data", False):
        from words import alpaca_rows

        src = tmp_path / "alpaca.json"
        src.write_text(json.dumps(alpaca_rows()))
        with contextlib.redirect_stdout(io.StringIO()):
            load_script("scripts", "prepare_alpaca").prepare(checkpoint_dir=words_dir, data_file=src,
                                                              destination_path=tmp_path / "sft")
        data_dir = tmp_path / "sft"
    out = tmp_path / "out"
    args = dpo_args(words_dir, data_dir, out, steps=2)
    args.update(overrides)
    with pytest.raises(LitError) as e:
        load_recipe("dpo").setup(**args)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() or not any(p.name.startswith(("step-", "final")) or p.suffix == ".pt"
                                       for p in out.iterdir())


def test_cli_error_is_one_line(words_dir, pairs_dir, tmp_path, forks):
    from fork_server import run_captured

    # `python finetune/dpo.py ...` as a process of its own, forked from the fork server (tests/conftest.py `forks`)
    proc = run_captured(
        forks, [str(ROOT / "finetune" / "dpo.py"), "--checkpoint_dir", str(words_dir), "--data.data_dir",
                str(pairs_dir), "--out_dir", str(tmp_path / "out"), "--dpo.loss", "ipo", "--dpo.label_smoothing",
                "0.1"], ROOT, os.environ, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: --dpo.label_smoothing applies to --dpo.loss robust (TRL's robust DPO), not 'ipo': set --dpo.loss"
        " robust, or leave label_smoothing at 0"]


@pytest.mark.slow  # two processes (DDP over gloo): multi-process runs are in the slow suite (tests/README.md)
def test_two_processes_ddp_match_one(words_dir, pairs_dir, tmp_path, forks):
    """2 CPU processes (DDP over gloo), each 1 pair per micro-batch, == 1 process with 2: the step's loss is the mean
    over the pairs of all processes. Full finetuning: the precomputed reference is split over the processes (each
    computes half of the pairs and gathers the rest) and equals the one-process values."""
    one = tmp_path / "one"  # micro-batches of 1 pair, like each process's: the same validation batches
    load_recipe("dpo").setup(**dpo_args(words_dir, pairs_dir, one, method="full", steps=4, lr=2e-3, micro=1))
    two = tmp_path / "two"
    cmd = [sys.executable, str(ROOT / "finetune" / "dpo.py"), "--devices", "2", "--precision", "32-true",
           "--accelerator", "cpu", "--method", "full", "--checkpoint_dir", str(words_dir), "--data.data_dir",
           str(pairs_dir), "--out_dir", str(two), "--train.max_steps", "4", "--train.micro_batch_size", "1",
           "--train.global_batch_size", "4", "--train.learning_rate", "2e-3", "--train.min_lr", "2e-4",
           "--train.lr_warmup_steps", "1", "--train.save_interval", "3", "--train.seed", "3", "--eval.interval", "3",
           "--eval.max_iters", "3", "--eval.max_new_tokens", "3", "--dpo.beta", "0.5"]
    # rank 0 forked from the fork server (tests/conftest.py `forks`: torch imported already); it starts rank 1 as
    # the recipe does everywhere (a `python` process of its own)
    from fork_server import run_captured

    proc = run_captured(forks, cmd[1:], cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each process ran 15 of the 30 pairs (1 pair per forward) through the model, not all 30
    for rank in (0, 1):
        assert f"Process {rank} of 2 computed the reference log-probabilities of 15 of 30 pairs" in proc.stdout, (
            proc.stdout[-3000:])
    ref_one = torch.load(one / "reference_logps.pt", weights_only=True)["logps"]
    ref_two = torch.load(two / "reference_logps.pt", weights_only=True)["logps"]
    assert ref_two.shape == ref_one.shape == (30, 2)
    torch.testing.assert_close(ref_two, ref_one, rtol=1e-6, atol=1e-6)  # the same forwards: fp32 rounding at most
    for key in ("loss", "reward_margin", "val_loss"):
        a, b = read_metrics(one, key), read_metrics(two, key)
        assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], abs=2e-4) for s in a), (key, a, b)


@pytest.mark.slow  # a real-model learning run (~16 s alone, ~65 s beside another worker), as finetuning's is
def test_dpo_on_real_smollm2_raises_held_out_reward_accuracy(smollm2_bf16_dir, tmp_path):
    """The real SmolLM2-135M-Instruct as the Hub serves it (bf16 safetensors, trained in fp32), with its chat template: pairs whose chosen reply answers and whose rejected
    reply refuses; after a short LoRA DPO run the held-out pairs (other questions) rank the answer above the
    refusal: reward accuracy above chance (it starts at 0: the policy is the reference)."""
    facts = [("the capital of France", "Paris"), ("the largest planet", "Jupiter"), ("the boiling point of water",
             "100 degrees Celsius"), ("the author of Hamlet", "William Shakespeare"), ("the chemical symbol of gold",
             "Au"), ("the closest star to Earth", "the Sun"), ("the longest river in Africa", "the Nile"),
             ("the square root of 81", "9"), ("the language spoken in Brazil", "Portuguese"),
             ("the fastest land animal", "the cheetah"), ("the currency of Japan", "the yen"),
             ("the tallest mountain on Earth", "Mount Everest"), ("the freezing point of water", "0 degrees Celsius"),
             ("the capital of Italy", "Rome"), ("the number of continents", "7"), ("the hardest natural material",
             "diamond"), ("the first man on the Moon", "Neil Armstrong"), ("the capital of Japan", "Tokyo"),
             ("the smallest prime number", "2"), ("the main gas in Earth's air", "nitrogen")]
    rows = [{"prompt": f"What is {q}?", "chosen": f"It is {a}.",
             "rejected": "I am not able to help with that question."} for q, a in facts]
    data_dir = prepare_pairs(smollm2_bf16_dir, rows, tmp_path / "prefs", val_split_fraction=0.2)
    out = tmp_path / "out"
    load_recipe("dpo").setup(
        checkpoint_dir=smollm2_bf16_dir, out_dir=out, precision="32-true", accelerator="cpu",
        data=DataArgs(data_dir=data_dir),
        train=TrainArgs(global_batch_size=4, micro_batch_size=4, max_steps=6, learning_rate=2e-3, min_lr=2e-4,
                        lr_warmup_steps=1, save_interval=None, seed=0),
        eval=EvalArgs(interval=6, max_iters=4, max_new_tokens=0, initial_validation=True),
        lora_r=8, lora_alpha=16, lora_dropout=0.05, dpo=DPOArgs(beta=0.1),
    )
    accuracy = read_metrics(out, "val_reward_accuracy")
    margin = read_metrics(out, "val_reward_margin")
    print("held-out reward accuracy", accuracy, "margin", margin)
    assert accuracy[0] == 0.0 and accuracy[6] >= 0.75, accuracy
    assert margin[6] > margin[0]
