"""GRPO on XLA:CPU (xla/finetune/grpo.py), 1 device: the same objective and loop as finetune/grpo.py with XLA's
runtime. Every step samples (prefill per prompt bucket, one decode graph over a fixed KV cache), scores, computes
the reference with the adapters off (beta > 0) and trains on rows of one fixed length; after the warm-up steps
(the first builds the graphs, the second the optimizer's) no step compiles anything, counted with torch_xla's
metrics per step (the loop logs `compiles`), also with validations (greedy, their own graphs) in between.

The completions are sampled with XLA's generator, so the run is not compared with the CPU's token for token (the
loss and gradients are compared with TRL's on fixed completions in tests/test_grpo_parity.py).
"""

import json
from pathlib import Path

import pytest
from fork_server import run_captured
from test_finetune import read_metrics as metrics  # {step: value} from the run's CSV logs

from test_grpo import ROWS, prepare_prompts

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # an XLA:CPU process that compiles generation, reference and train graphs (~1-2 minutes)
def test_xla_grpo_compiles_nothing_after_warm_up(tiny_dir, tmp_path, xla_env, xla_forks):
    data = prepare_prompts(tiny_dir, ROWS, tmp_path / "prompts", val_split_fraction=0.25)
    (tmp_path / "rewards.py").write_text(
        "def short(prompts, completions, completion_ids, **kw):\n"
        "    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]\n")
    out = tmp_path / "out"
    # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
    proc = run_captured(
        xla_forks, [str(REPO / "xla/finetune/grpo.py"), "--checkpoint_dir", str(tiny_dir), "--data.data_dir",
         str(data), "--out_dir", str(out), "--precision", "32-true", "--accelerator", "cpu",
         "--train.max_steps", "5", "--train.global_batch_size", "2", "--train.micro_batch_size", "1",
         "--train.learning_rate", "1e-3", "--train.log_interval", "1", "--train.save_interval", "5",
         "--eval.interval", "2", "--eval.max_iters", "2", "--eval.max_new_tokens", "0",
         "--grpo.group_size", "4", "--grpo.max_new_tokens", "8", "--grpo.beta", "0.04", "--grpo.loss", "grpo",
         "--reward", "answer_match", "--reward+", f"{tmp_path / 'rewards.py'}:short=0.5"],
        REPO, xla_env(1), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    compiles = metrics(out, "compiles")
    assert sorted(compiles) == [1, 2, 3, 4, 5], compiles
    assert compiles[1] > 0 and all(compiles[s] == 0 for s in (3, 4, 5)), compiles
    for key in ("loss", "kl", "clip_fraction", "reward", "reward_short", "completion_length", "time_generation"):
        assert sorted(metrics(out, key)) == [1, 2, 3, 4, 5], key
    assert sorted(metrics(out, "val_reward")) == [2, 4, 5]  # and the final validation
    assert metrics(out, "reward_short")[1] > 0
    assert "train step" in proc.stdout and "1 padded length(s)" in proc.stdout, proc.stdout[-2000:]
    assert (out / "final" / "lit_model.lora.safetensors").is_file()
    assert json.loads((out / "step-000005" / "finetune.json").read_text())["grpo"]["beta"] == 0.04
