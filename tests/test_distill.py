"""Logit distillation (lit_gpt.distill, finetune/distill.py; XLA: tests/xla/test_xla_distill.py).

* the divergence equals TRL's `GKDTrainer.generalized_jsd_loss` (trl 1.16, the real package) on a fixed batch with
  a mask, for beta 0 (forward KL), 0.5 and 1 at temperatures 1 and 2, values and gradients; and so does the
  objective's loss on tiny student and teacher models, on both code paths of the loop (the head on the labelled rows
  only, and on every position), mixed with the SFT cross-entropy by alpha;
* it learns: a tiny student distilled through the real recipe from a different, sharper tiny teacher moves toward
  the teacher's next-token distributions on held-out responses (KL(teacher || student) drops by half);
* bad settings, a missing teacher and a teacher with another tokenizer are one line each, nothing written.
"""

import contextlib
import io
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.batches import IGNORE_INDEX
from lit_gpt.distill import Distill, distill_sums
from lit_gpt.losses import labelled_rows
from lit_gpt.utils import LitError
from test_finetune import load_recipe, load_script, read_metrics
from tiny import random_model, tiny_llama_config
from words import alpaca_rows, make_word_checkpoint

CASES = [(beta, temperature) for beta in (0.0, 0.5, 1.0) for temperature in (1.0, 2.0)]


@pytest.fixture(scope="module")
def trl_jsd():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def fixed_batch():
    """(B, T, V) student and teacher logits of different sharpness and (B, T) labels with masked prompt positions
    and padding."""
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, 11, generator=g) * 2.0
    teacher = torch.randn(3, 7, 11, generator=g) * 3.0
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :2] = IGNORE_INDEX  # a prompt
    labels[1, 5:] = IGNORE_INDEX  # padding
    labels[2, :4] = IGNORE_INDEX
    return student, teacher, labels


@pytest.mark.parametrize("beta, temperature", CASES)
def test_divergence_equals_trl_generalized_jsd(trl_jsd, beta, temperature):
    student, teacher, labels = fixed_batch()
    ours_s = student.clone().requires_grad_(True)
    theirs_s = student.clone().requires_grad_(True)
    div, _ = distill_sums(ours_s.reshape(-1, 11), teacher.reshape(-1, 11), labels.reshape(-1), "jsd", beta,
                          temperature, chunk_rows=4)  # chunks that split rows of the batch
    ours = div / (labels != IGNORE_INDEX).sum()
    theirs = trl_jsd(theirs_s, teacher, labels=labels, beta=beta, temperature=temperature)
    ours.backward()
    theirs.backward()
    assert theirs > 0.05  # the case is not degenerate
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_s.grad, theirs_s.grad, rtol=1e-5, atol=1e-8)
    if beta == 0.0:  # --distill.loss forward_kl is TRL's beta 0 whatever beta says
        fkl, _ = distill_sums(student.reshape(-1, 11), teacher.reshape(-1, 11), labels.reshape(-1), "forward_kl", 0.7,
                              temperature)
        torch.testing.assert_close(fkl, div.detach())


@pytest.mark.parametrize("loss_type, beta, temperature, alpha", [
    ("forward_kl", 0.5, 1.0, 0.5), ("jsd", 0.5, 2.0, 0.7), ("jsd", 1.0, 1.0, 1.0), ("jsd", 0.1, 1.0, 0.0)])
def test_objective_loss_equals_trl_plus_sft(trl_jsd, loss_type, beta, temperature, alpha):
    """`Distill.loss` with tiny models, as the loop calls it (eager: the labelled rows; tracing: every position),
    divided by the response tokens: alpha x TRL's divergence + (1 - alpha) x the mean cross-entropy."""
    config = tiny_llama_config(vocab_size=64, block_size=16)
    student, teacher = random_model(config, seed=0), random_model(config, seed=1)
    with torch.no_grad():
        teacher.transformer.ln_f.weight.mul_(8.0)  # a sharper teacher: the divergence is far from 0
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 10), generator=g)
    labels = torch.randint(0, 64, (2, 10), generator=g)
    labels[0, :3] = IGNORE_INDEX
    labels[1, 7:] = IGNORE_INDEX
    n = (labels != IGNORE_INDEX).sum()
    objective = Distill(loss_type=loss_type, beta=beta, temperature=temperature, alpha=alpha, teacher=teacher)
    with torch.no_grad():
        s_logits, t_logits = student(input_ids), teacher(input_ids)
    trl_beta = 0.0 if loss_type == "forward_kl" else beta
    div = trl_jsd(s_logits, t_logits, labels=labels, beta=trl_beta, temperature=temperature)
    ce = torch.nn.functional.cross_entropy(s_logits.reshape(-1, 64), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    expected = alpha * div + (1 - alpha) * ce
    for rows in (labelled_rows(labels), None):
        loss, stats = objective.loss(student, (input_ids, labels), rows)
        torch.testing.assert_close(loss / n, expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(stats / n, torch.stack([div, ce]), rtol=1e-5, atol=1e-7)
    eval_loss, _ = objective.eval_loss(student, (input_ids, labels))
    torch.testing.assert_close(eval_loss / n, expected, rtol=1e-5, atol=1e-7)


def test_heads_of_other_widths_compare_their_common_columns(trl_jsd):
    """A teacher whose head is padded wider (one tokenizer, Qwen2.5's sizes): the divergence over the student's
    columns, TRL's on the teacher's logits cut to them."""
    student = random_model(tiny_llama_config(vocab_size=64, block_size=16), seed=0)
    teacher = random_model(tiny_llama_config(vocab_size=80, block_size=16), seed=1)
    input_ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    labels = input_ids.roll(-1, dims=1)
    labels[:, :2] = IGNORE_INDEX
    objective = Distill(loss_type="jsd", beta=0.5, alpha=1.0, teacher=teacher, vocab_size=64)
    with torch.no_grad():
        expected = trl_jsd(student(input_ids), teacher(input_ids)[..., :64], labels=labels, beta=0.5)
        loss, _ = objective.loss(student, (input_ids, labels), labelled_rows(labels))
    torch.testing.assert_close(loss / (labels != IGNORE_INDEX).sum(), expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------------
# the recipe
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """A student (word checkpoint, seed 0), a different teacher (seed 1, its final norm x 8: sharper next-token
    distributions than a random model's near-uniform ones) with the same tokenizer, and the words' Alpaca rows
    prepared with 20% held out."""
    from lit_gpt.weights import load_weights, save_weights

    root = tmp_path_factory.mktemp("distill")
    student = make_word_checkpoint(root / "student", seed=0)
    teacher = make_word_checkpoint(root / "teacher", seed=1)
    state = load_weights(teacher / "lit_model.safetensors")
    state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"] * 8.0
    save_weights(state, teacher)
    (root / "rows.json").write_text(json.dumps(alpaca_rows()))
    with contextlib.redirect_stdout(io.StringIO()):
        load_script("scripts", "prepare_alpaca").prepare(checkpoint_dir=student, data_file=root / "rows.json",
                                                         destination_path=root / "data", val_split_fraction=0.2)
    return student, teacher, root / "data"


def distill_args(student: Path, teacher: Path, data: Path, out: Path, **overrides):
    args = dict(checkpoint_dir=student, teacher_dir=teacher, out_dir=out, precision="32-true", accelerator="cpu",
                data=DataArgs(data_dir=data),
                train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=12, learning_rate=3e-2,
                                min_lr=3e-3, lr_warmup_steps=1, save_interval=100, log_interval=1, seed=3),
                eval=EvalArgs(interval=12, max_iters=20, max_new_tokens=0, initial_validation=True),
                lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_mlp=True, lora_head=True)
    args.update(overrides)
    return args


def test_student_moves_toward_the_teacher_on_held_out_responses(words, tmp_path):
    """LoRA (the default) with forward KL at temperature 1 and alpha 1: the logged held-out `val_distill_loss` is
    KL(teacher || student) per response token (the objective's equality with TRL above); 12 steps halve it."""
    student, teacher, data = words
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        from lit_gpt.recipes.distill import DistillArgs

        load_recipe("distill").setup(**distill_args(student, teacher, data, out,
                                                    distill=DistillArgs(loss="forward_kl", alpha=1.0)))
    kl = read_metrics(out, "val_distill_loss")
    before, after = kl[0], kl[12]
    print(f"held-out KL(teacher || student) per response token: {before:.4f} before, {after:.4f} after 12 steps")
    assert before > 0.5, kl  # the teacher is far from the student to start with
    assert after < 0.5 * before, kl
    assert read_metrics(out, "val_loss")[12] == pytest.approx(after)  # alpha 1: the loss is the divergence
    assert (out / "final" / "lit_model.lora.safetensors").is_file()
    recorded = json.loads((out / "final" / "finetune.json").read_text())["distill"]
    assert recorded["loss"] == "forward_kl" and recorded["alpha"] == 1.0 and recorded["teacher"].startswith("sha256:")


def test_a_teacher_with_a_wider_head_trains(words, tmp_path):
    """One tokenizer, the teacher's head padded 16 rows wider: accepted, and the divergence is computed."""
    from lit_gpt.config import load_config
    from tiny import write_checkpoint

    student, _, data = words
    vocab = load_config(student).vocab_size
    wide = write_checkpoint(random_model(tiny_llama_config(vocab_size=vocab + 16, block_size=128), seed=2),
                            tmp_path / "wide")
    (wide / "tokenizer.json").write_bytes((student / "tokenizer.json").read_bytes())
    args = distill_args(student, wide, data, tmp_path / "out")
    args["train"] = replace(args["train"], max_steps=2)
    with contextlib.redirect_stdout(io.StringIO()):
        load_recipe("distill").setup(**args)
    assert sorted(read_metrics(tmp_path / "out", "distill_loss")) == [1, 2]


def test_full_student_with_alpha_0_is_sft(words, tmp_path):
    """--method full --distill.alpha 0: the loss is SFT's cross-entropy alone, so the run's logged losses are
    finetune/full.py's on the same data and settings (the teacher is computed, and weighs nothing)."""
    from lit_gpt.recipes.distill import DistillArgs

    student, teacher, data = words
    args = distill_args(student, teacher, data, tmp_path / "distill", method="full", distill=DistillArgs(alpha=0.0))
    args["train"] = replace(args["train"], max_steps=3, learning_rate=1e-3, min_lr=1e-4)
    sft = {k: v for k, v in args.items() if k not in ("teacher_dir", "method", "distill") and not k.startswith("lora")}
    sft.update(out_dir=tmp_path / "full", train=replace(args["train"]))
    with contextlib.redirect_stdout(io.StringIO()):
        load_recipe("distill").setup(**args)
        load_recipe("full").setup(**sft)
    ours, theirs = read_metrics(tmp_path / "distill"), read_metrics(tmp_path / "full")
    assert sorted(ours) == [1, 2, 3] and ours == pytest.approx(theirs, rel=1e-6)
    assert read_metrics(tmp_path / "distill", "sft_loss") == pytest.approx(theirs, rel=1e-6)
    assert read_metrics(tmp_path / "distill", "distill_loss")[1] > 0.5  # computed, though it weighs nothing


@pytest.mark.parametrize("change, message", [
    ("no_teacher", "--teacher_dir is required"),
    ("other_tokenizer", "has another tokenizer than the student"),
    ("short_teacher", "the teacher's context"),
    ("narrow_head", "rows and the student's"),
    ("beta", "--distill.beta must be in"),
    ("alpha", "--distill.alpha must be in"),
])
def test_bad_settings_are_one_line_and_write_nothing(words, tmp_path, change, message):
    from lit_gpt.config import load_config
    from lit_gpt.recipes.distill import DistillArgs
    from tiny import write_checkpoint

    student, teacher, data = words
    out = tmp_path / "out"
    args = distill_args(student, teacher, data, out)
    vocab = load_config(student).vocab_size
    if change == "no_teacher":
        args["teacher_dir"] = None
    elif change == "other_tokenizer":  # the same vocabulary size, another token at one id
        other = write_checkpoint(random_model(tiny_llama_config(vocab_size=vocab, block_size=128)), tmp_path / "other")
        (other / "tokenizer.json").write_text((student / "tokenizer.json").read_text().replace('"red"', '"rouge"'))
        args["teacher_dir"] = other
    elif change == "short_teacher":
        short = write_checkpoint(random_model(tiny_llama_config(vocab_size=vocab, block_size=32)), tmp_path / "short")
        (short / "tokenizer.json").write_bytes((student / "tokenizer.json").read_bytes())
        args["teacher_dir"] = short
    elif change == "narrow_head":  # the same tokenizer, a head without its last 8 tokens
        narrow = write_checkpoint(random_model(tiny_llama_config(vocab_size=vocab - 8, block_size=128)),
                                  tmp_path / "narrow")
        (narrow / "tokenizer.json").write_bytes((student / "tokenizer.json").read_bytes())
        args["teacher_dir"] = narrow
    elif change == "beta":
        args["distill"] = DistillArgs(loss="jsd", beta=1.5)
    else:
        args["distill"] = DistillArgs(alpha=-0.1)
    with pytest.raises(LitError, match=message) as e:
        load_recipe("distill").setup(**args)
    assert "\n" not in str(e.value)
    assert not out.exists()
