"""Distillation on XLA:CPU (xla/finetune/distill.py), 1 device: the same objective and loop as finetune/distill.py
with XLA's runtime. The teacher is staged onto the device beside the student; its forward runs inside the train step
(one graph with the student's forward and backward). The rows are of one power-of-two bucket, so after the warm-up
steps (the first builds the step's graph, the second the optimizer's) no step compiles anything, counted with
torch_xla's metrics per step (the loop logs `compiles`), also with validations in between. The values themselves
are the CPU recipe's objective (tests/test_distill.py checks it against TRL).
"""

import contextlib
import io
import json
from pathlib import Path

import pytest
from fork_server import run_captured
from test_finetune import read_metrics as metrics  # {step: value} from the run's CSV logs

from words import GEN_PROMPT, WORDS, make_word_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # an XLA:CPU process that compiles the train step with the teacher inside (~30 s on 2 cores)
def test_xla_distill_compiles_nothing_after_warm_up(tmp_path, xla_env, xla_forks):
    import importlib.util

    from lit_gpt.weights import load_weights, save_weights

    student = make_word_checkpoint(tmp_path / "student", seed=0)
    teacher = make_word_checkpoint(tmp_path / "teacher", seed=1)
    state = load_weights(teacher / "lit_model.safetensors")
    state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"] * 8.0  # sharper than the student
    save_weights(state, teacher)
    # 16 rows of 6 words: every row pads to the same power-of-two bucket (one train-step shape)
    rows = [{"instruction": GEN_PROMPT, "input": ws, "output": ws}
            for ws in (" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6)) for i in range(16))]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    spec = importlib.util.spec_from_file_location("prepare_alpaca_distill", REPO / "scripts" / "prepare_alpaca.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    with contextlib.redirect_stdout(io.StringIO()):
        prepare.prepare(checkpoint_dir=student, data_file=tmp_path / "rows.json", destination_path=tmp_path / "data",
                        val_split_fraction=0.25)
    out = tmp_path / "out"
    # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
    proc = run_captured(
        xla_forks, [str(REPO / "xla/finetune/distill.py"), "--checkpoint_dir", str(student), "--teacher_dir",
         str(teacher), "--data.data_dir", str(tmp_path / "data"), "--out_dir", str(out), "--precision", "32-true",
         "--accelerator", "cpu", "--train.max_steps", "5", "--train.global_batch_size", "2",
         "--train.micro_batch_size", "1", "--train.learning_rate", "3e-2", "--train.log_interval", "1",
         "--train.save_interval", "5", "--eval.interval", "2", "--eval.max_iters", "2", "--eval.max_new_tokens", "0",
         "--distill.loss", "jsd", "--distill.beta", "0.5", "--distill.temperature", "2.0", "--distill.alpha", "0.8",
         "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lora_head", "true"],
        REPO, xla_env(1), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    compiles = metrics(out, "compiles")
    assert sorted(compiles) == [1, 2, 3, 4, 5], compiles
    assert compiles[1] > 0 and all(compiles[s] == 0 for s in (3, 4, 5)), compiles
    for key in ("loss", "distill_loss", "sft_loss"):
        assert sorted(metrics(out, key)) == [1, 2, 3, 4, 5], key
    assert sorted(metrics(out, "val_distill_loss")) == [2, 4, 5]  # and the final validation
    assert metrics(out, "distill_loss")[1] > 0
    assert "Teacher:" in proc.stdout and "1 padded length(s)" in proc.stdout, proc.stdout[-2000:]
    assert (out / "final" / "lit_model.lora.safetensors").is_file()
    recorded = json.loads((out / "step-000005" / "finetune.json").read_text())["distill"]
    assert recorded["loss"] == "jsd" and recorded["beta"] == 0.5 and recorded["alpha"] == 0.8
