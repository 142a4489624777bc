"""DPO on XLA:CPU (xla/finetune/dpo.py) against the CPU recipe (finetune/dpo.py): the same objective in the same loop.

Epoch-driven runs on the word checkpoint (tests/words.py) with pairs prepared by scripts/prepare_preferences.py (the
chosen reply repeats the prompt's words, the rejected one reverses them), fp32, dropout 0, the same seed and settings:
* the same steps and the same logged loss, rewards, reward accuracy and margin step by step (relative 1e-4), and
  validation values, on 1 device and on 8 (FSDP over SPMD), LoRA (reference: adapters off) and full finetuning
  (reference log-probabilities computed on the XLA device before training);
* final weights equal to the CPU's within 1e-5;
* the train step compiles in the first two steps of each padded length only (pairs are padded to powers of two).
By default: LoRA on 1 device, full on 8; the other two combinations are marked slow.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from fork_server import run_captured
from test_finetune import read_metrics as metrics  # {step: value} from the run's CSV logs

from test_dpo import preference_rows
from words import make_word_checkpoint

REPO = Path(__file__).resolve().parents[2]

COMMON = ["--train.global_batch_size", "8", "--train.micro_batch_size", "1", "--train.epochs", "2",
          "--train.save_interval", "3", "--train.log_interval", "1", "--train.lr_warmup_steps", "1",
          "--data.shuffle", "false", "--eval.interval", "3", "--eval.max_iters", "10", "--eval.max_new_tokens", "0",
          "--dpo.beta", "0.5", "--precision", "32-true", "--accelerator", "cpu"]
METHODS = {
    "lora": ["--method", "lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_mlp", "true", "--lora_dropout", "0",
             "--train.learning_rate", "0.02", "--train.min_lr", "0.002"],
    "full": ["--method", "full", "--train.learning_rate", "0.002", "--train.min_lr", "0.0002"],
}
WEIGHTS = {"lora": "lit_model.lora.safetensors", "full": "lit_model.safetensors"}
CASES = [pytest.param("lora", 1, id="lora-1"), pytest.param("full", 8, id="full-8"),
         pytest.param("lora", 8, id="lora-8", marks=pytest.mark.slow),
         pytest.param("full", 1, id="full-1", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, xla_env, forks):
    from fork_server import run_captured

    tmp = tmp_path_factory.mktemp("xla_dpo")
    words = make_word_checkpoint(tmp / "words")
    (tmp / "pairs.json").write_text(json.dumps(preference_rows(36)))
    data = tmp / "pairs"
    # a CPU script, forked from the fork server (tests/conftest.py `forks`): no fresh interpreter's imports
    prep = run_captured(
        forks, [str(REPO / "scripts/prepare_preferences.py"), "--checkpoint_dir", str(words),
                "--data_file", str(tmp / "pairs.json"), "--destination_path", str(data), "--prompt_style", "alpaca",
                "--val_split_fraction", str(4 / 36)], REPO, xla_env(1), timeout=600)
    assert prep.returncode == 0, prep.stderr
    return tmp, words, data


@pytest.fixture(scope="module")
def cpu_runs(setup):
    """The CPU references, in this process (through jsonargparse, like the command line)."""
    from jsonargparse import CLI

    tmp, words, data = setup
    spec = importlib.util.spec_from_file_location("cpu_dpo", REPO / "finetune" / "dpo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    outs = {}
    for method in METHODS:
        out = tmp / f"cpu_{method}"
        CLI(recipe.setup, args=["--checkpoint_dir", str(words), "--data.data_dir", str(data), "--out_dir", str(out),
                                *COMMON, *METHODS[method]])
        outs[method] = out
    return outs


@pytest.mark.parametrize("method, devices", CASES)
def test_xla_dpo_equals_the_cpu_run(setup, cpu_runs, xla_env, xla_forks, method, devices):
    tmp, words, data = setup
    out = tmp / f"xla_{method}{devices}"
    # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
    proc = run_captured(
        xla_forks, [str(REPO / "xla/finetune/dpo.py"), "--checkpoint_dir", str(words), "--data.data_dir", str(data),
                    "--out_dir", str(out), *COMMON, *METHODS[method]], REPO, xla_env(devices), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    cpu = cpu_runs[method]
    steps = 2 * 32 // 8
    for key in ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "val_loss",
                "val_reward_margin", "val_reward_accuracy"):
        a, b = metrics(cpu, key), metrics(out, key)
        assert a.keys() == b.keys(), (key, a, b)
        if key == "reward_accuracy":
            # step 1: the policy is the reference, so chosen and rejected rewards are both 0 up to float rounding
            # (~1e-7, from a precomputed reference whose batches differ from the step's) and their strict order is
            # noise on every backend; the margin is compared instead (to 1e-5)
            a.pop(1), b.pop(1)
        assert all(b[s] == pytest.approx(a[s], rel=1e-4, abs=1e-5) for s in a), (key, a, b)
    assert sorted(metrics(out, "loss")) == list(range(1, steps + 1))
    assert metrics(out, "reward_margin")[steps] > 0.05  # it learned the preference
    if method == "full":
        assert "Reference log-probabilities of 36 pairs saved" in proc.stdout
    from lit_gpt.weights import load_weights

    wa, wb = load_weights(cpu / "final" / WEIGHTS[method]), load_weights(out / "final" / WEIGHTS[method])
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k].float(), wb[k].float(), atol=1e-5, rtol=1e-4), k
    # the graphs of a padded length compile in the first two steps (the second one's optimizer step finds its state
    # created), as for SFT; every later step runs compiled graphs only
    found = re.search(r"XLA compilations: train step (\d+) for (\d+) padded length", proc.stdout)
    assert found, proc.stdout[-2000:]
    compiles, lengths = int(found.group(1)), int(found.group(2))
    assert compiles <= 4 * lengths, proc.stdout[-2000:]
    steady = re.search(r"over (\d+) steady step\(s\); (\d+) first or compiling step", proc.stdout)
    assert steady and int(steady.group(2)) <= 2 * lengths and int(steady.group(1)) >= steps - 2 * lengths, \
        proc.stdout[-2000:]
