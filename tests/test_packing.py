"""Sequence packing (lit_gpt/packing.py, `--data.packing true`): rows of exactly max_seq_length positions, each
document attending to itself only at its own positions, so that a packed step gives the loss and the gradients of
the same samples unpacked (fp32, within 1e-5 relative) for every family and every method; deterministic rows; and
a recipe run that packs (epoch-driven, dropout on) counts rows in its batch sizes."""

import math
import random
import re
from typing import Dict, List

import pytest
import torch

import lit_gpt.adapter as adapter
import lit_gpt.adapter_v2 as adapter_v2
import lit_gpt.lora as lora
from lit_gpt import GPT
from lit_gpt.batches import IGNORE_INDEX, collate
from lit_gpt.losses import loss_sum
from lit_gpt.packing import collate_packed, document_mask, pack, rows_of, useful_fraction
from lit_gpt.utils import LitError
from variants import FAMILIES, VOCAB, base_and_variant, randomize_, tiny_config

REL = 1e-5


def samples_of(lengths: List[int], seed: int = 0, prompt: int = 2) -> List[Dict[str, torch.Tensor]]:
    """Samples of these token counts whose first `prompt` labels are masked (as the prepare scripts mask prompts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


# ---------------------------------------------------------------------------------------------------------------
# the rows
# ---------------------------------------------------------------------------------------------------------------
def test_pack_is_deterministic_complete_and_full():
    rng = random.Random(0)
    lengths = [max(4, min(2000, int(rng.lognormvariate(5.2, 0.7)))) for _ in range(3000)]
    samples = samples_of(lengths)
    rows = pack(samples, 1024)
    assert rows == pack(samples, 1024)
    assert sorted(i for row in rows for i in row) == list(range(len(samples)))  # every sample once
    assert all(row == sorted(row) for row in rows)
    assert all(sum(min(lengths[i] - 1, 1024) for i in row) <= 1024 for row in rows)
    batches = [collate_packed(rows_of(samples, rows[i:i + 8]), 1024) for i in range(0, len(rows), 8)]
    assert useful_fraction(batches) >= 0.99
    padded = [collate(samples[i:i + 8], 1024, pad_pow2=True) for i in range(0, len(samples), 8)]
    assert useful_fraction(padded) < 0.8


def test_collate_packed_shifts_each_document_and_restarts_its_positions():
    samples = samples_of([5, 3, 40])
    batch = collate_packed([samples[:2], samples[2:]], 16)
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0, :6].tolist() == samples[0]["input_ids"][:4].tolist() + samples[1]["input_ids"][:2].tolist()
    assert batch["labels"][0, :6].tolist() == samples[0]["labels"][1:].tolist() + samples[1]["labels"][1:].tolist()
    assert batch["positions"][0, :7].tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert batch["segments"][0, :7].tolist() == [1, 1, 1, 1, 2, 2, 0]
    assert (batch["labels"][0, 6:] == IGNORE_INDEX).all()
    # a sample longer than a row is cropped as `collate` crops it
    assert torch.equal(batch["labels"][1], collate(samples[2:], 16)["labels"][0])
    assert batch["n_tokens"] == 6 + 16


def test_document_mask_is_block_diagonal_causal_and_windowed():
    segments = torch.tensor([[1, 1, 1, 2, 2, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_mask(segments, positions)[0, 0]
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    windowed = document_mask(segments, positions, window=2)[0, 0]
    assert windowed[2].tolist() == [0, 1, 1, 0, 0, 0]


# ---------------------------------------------------------------------------------------------------------------
# packed == unpacked: loss and gradients
# ---------------------------------------------------------------------------------------------------------------
def loss_and_grads(model: torch.nn.Module, batch: Dict[str, torch.Tensor], packed: bool):
    model.zero_grad(set_to_none=True)
    extra = {k: batch[k] for k in ("positions", "segments")} if packed else {}
    loss = loss_sum(model, batch["input_ids"], batch["labels"], targets_only=False, **extra)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_packed_equals_unpacked(model: torch.nn.Module, row_length: int = 32):
    samples = samples_of([5, 9, 13, 3, 20, 7, 11, 6], seed=4)
    rows = pack(samples, row_length)
    assert len(rows) < len(samples)  # something was packed
    unpacked_loss, unpacked_grads = loss_and_grads(model, collate(samples, row_length), packed=False)
    packed_loss, packed_grads = loss_and_grads(model, collate_packed(rows_of(samples, rows), row_length), packed=True)
    assert math.isclose(packed_loss.item(), unpacked_loss.item(), rel_tol=REL)
    assert packed_grads.keys() == unpacked_grads.keys() and packed_grads
    for name, g in unpacked_grads.items():
        scale = g.abs().max().clamp_min(1e-12)
        assert (packed_grads[name] - g).abs().max() / scale < REL, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_step_equals_the_samples_unpacked_in_every_family(family):
    torch.manual_seed(0)
    model = GPT(tiny_config(family))
    randomize_(model)
    # LongRoPE picks its factors by sequence length: packed rows stay within the original context (16 here)
    length = 16 if (model.config.rope_scaling or {}).get("type") == "longrope" else 32
    assert_packed_equals_unpacked(model.float().train(), length)


@pytest.mark.parametrize("module,variant,trainable", [
    (lora, dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_projection=True, lora_mlp=True),
     lora.mark_only_lora_as_trainable),
    (adapter, dict(adapter_prompt_length=3, adapter_start_layer=0), adapter.mark_only_adapter_as_trainable),
    (adapter_v2, dict(adapter_prompt_length=3, adapter_start_layer=0), adapter_v2.mark_only_adapter_v2_as_trainable),
], ids=["lora", "adapter", "adapter_v2"])
@pytest.mark.parametrize("family", ["TinyLlama-1.1B-Chat-v1.0", "gemma-2-2b"])
def test_a_packed_step_equals_the_samples_unpacked_for_every_method(module, variant, trainable, family):
    _, model = base_and_variant(family, module, **variant)
    with torch.no_grad():  # the variant's own weights off their (zero) init, so that they matter
        for name, p in model.named_parameters():
            if model.peft_filter(name):
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    if module is lora:
        for m in model.modules():  # dropout off: its masks differ between layouts by construction
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    trainable(model)
    assert_packed_equals_unpacked(model)


def test_longrope_rows_beyond_the_original_context_are_refused():
    model = GPT(tiny_config("Phi-4-mini-instruct"))
    batch = collate_packed([samples_of([12, 12])], 32)
    with pytest.raises(LitError, match="--train.max_seq_length <= 16"):
        model(batch["input_ids"], positions=batch["positions"], segments=batch["segments"])


# ---------------------------------------------------------------------------------------------------------------
# the recipes
# ---------------------------------------------------------------------------------------------------------------
from test_finetune import data_dir, load_recipe, read_metrics, run_args  # noqa: E402,F401  (data_dir: a fixture)


def packed_run(method, tiny_dir, data_dir, out, **overrides):
    from dataclasses import replace

    args = run_args(method, tiny_dir, data_dir, out, steps=None, micro=1, global_batch=2, save_interval=3,
                    eval_interval=3, **overrides)
    args["data"] = replace(args["data"], packing=True)
    args["train"] = replace(args["train"], max_seq_length=160, epochs=1)
    return args


def test_a_packing_recipe_counts_rows_runs_epochs_and_resumes_exactly(tiny_dir, data_dir, tmp_path, monkeypatch, capsys):
    """finetune/lora.py --data.packing true, epoch-driven, LoRA dropout on: one epoch is the packed rows / 2 steps
    (every sample once), the note says how full the rows are, and a run killed after its first checkpoint and
    resumed logs the losses of the uninterrupted one (the rows are the same: packing is deterministic)."""
    from lit_gpt.data import load_prepared
    from lit_gpt.runtime import Runtime

    train = load_prepared(data_dir).train
    rows = pack(train, 160)
    assert len(rows) < len(train) / 2
    straight = tmp_path / "straight"
    load_recipe("lora").setup(**packed_run("lora", tiny_dir, data_dir, straight, lora_dropout=0.1))
    captured = capsys.readouterr()
    assert "training samples into %d rows of 160 positions" % len(rows) in captured.err
    # generation from the packed-trained weights (the validation sample) runs the unchanged KV-cache path
    assert re.search(r"val loss [\d.]+ \| sample: ", captured.out), captured.out[-2000:]
    losses = read_metrics(straight)
    assert sorted(losses) == list(range(1, len(rows) // 2 + 1))

    class Killed(Exception):
        pass

    original = Runtime.save_step

    def save_then_die(self, directory, *a, **kw):
        original(self, directory, *a, **kw)
        raise Killed

    resumed = tmp_path / "resumed"
    monkeypatch.setattr(Runtime, "save_step", save_then_die)
    with pytest.raises(Killed):
        load_recipe("lora").setup(**packed_run("lora", tiny_dir, data_dir, resumed, lora_dropout=0.1))
    monkeypatch.setattr(Runtime, "save_step", original)
    load_recipe("lora").setup(**packed_run("lora", tiny_dir, data_dir, resumed, lora_dropout=0.1, resume="auto"))
    assert read_metrics(resumed) == losses
    assert read_metrics(resumed, "val_loss") == read_metrics(straight, "val_loss")


def test_dpo_refuses_packing():
    from lit_gpt.packing import pack_for_training

    with pytest.raises(LitError, match="DPO trains on pairs, which are not packed"):
        pack_for_training("dpo", samples_of([4]), [], 16)


def test_a_segment_id_kernel_replaces_the_dense_mask_where_installed():
    """The TPU path (lit_gpt.xla.flash, torch_xla's flash attention with segment ids) cannot run here; its plumbing
    can: a kernel of the same signature, computed densely, installed as `segment_attention`, gives the unpacked
    step's loss and gradients, receives the segment ids (causal, GQA repeated to equal heads), and layers the
    kernel cannot do (sliding windows) go to the blockwise path (lit_gpt.xla.flash.blockwise_segment_attention).
    Without a kernel (the eager CPU) the tests above run `GPT.packed_attention = "documents"`, one document at a
    time (tests/test_packed_attention.py compares it with the old dense mask)."""
    import torch.nn.functional as F

    from lit_gpt.xla.flash import segment_attention

    calls = []

    def kernel(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, partition_spec, mesh):
        calls.append((q.shape, k.shape, causal))
        mask = document_mask(q_segment_ids, None)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)

    torch.manual_seed(0)
    model = GPT(tiny_config("TinyLlama-1.1B-Chat-v1.0"))  # GQA: 4 heads, 2 groups
    randomize_(model)
    model.segment_attention = segment_attention(kernel)
    assert_packed_equals_unpacked(model.train())
    assert calls and all(q == k and causal for q, k, causal in calls)
    calls.clear()
    windowed = GPT(tiny_config("Mistral-7B-v0.1"))
    randomize_(windowed)
    windowed.segment_attention = segment_attention(kernel)
    assert_packed_equals_unpacked(windowed.train())
    assert not calls


def test_a_checkpoint_resumes_only_with_the_packing_it_was_trained_with():
    """A step checkpoint's data position counts rows or samples: resuming with the other setting is refused."""
    from lit_gpt.batches import TrainBatches

    samples = samples_of([5, 6, 7, 8])
    packed = TrainBatches(rows_of(samples, pack(samples, 16)), 1, 16, packed=True, collate_fn=collate_packed)
    next(packed)
    with pytest.raises(LitError, match="trained with --data.packing true: resume with the same setting"):
        TrainBatches(samples, 1, 16).load_state_dict(packed.state_dict())
    with pytest.raises(LitError, match="trained with --data.packing false"):
        TrainBatches(rows_of(samples, [[0, 1]]), 1, 16, packed=True).load_state_dict(TrainBatches(samples, 1, 16).state_dict())
    resumed = TrainBatches(rows_of(samples, pack(samples, 16)), 1, 16, packed=True, collate_fn=collate_packed)
    resumed.load_state_dict(packed.state_dict())
    assert resumed.index == 1
