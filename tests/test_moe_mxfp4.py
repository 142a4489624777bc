"""gpt-oss's experts kept in MXFP4 in memory (lit_gpt.mxfp4.pack_experts_mxfp4): a tiny gpt-oss whose expert
weights are MXFP4 values (as a converted Hub checkpoint's are) gives bit-equal bf16 logits and the same greedy tokens
packed, on every dispatch path, with 4.25 bits per expert weight; weights that are not MXFP4 values are refused;
LoRA on the attention trains with the packed experts frozen."""

import pytest
import torch

from lit_gpt import GPT, lora
from lit_gpt.generate import generate
from lit_gpt.moe import ExpertLinear, moe_layers
from lit_gpt.mxfp4 import MXFP4ExpertLinear, dequantize_mxfp4, pack_experts_mxfp4, packed_bytes, quantize_mxfp4
from words import MOE_FAMILIES, TINY_SHAPE, family_config

VOCAB = 64


def _mxfp4_valued(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if type(m) is ExpertLinear:
                m.weight.copy_(dequantize_mxfp4(*quantize_mxfp4(m.weight), torch.float32))
    return model


def tiny_gpt_oss(config=None) -> GPT:
    torch.manual_seed(0)
    config = config or family_config("gpt_oss", VOCAB)
    model = (lora.GPT if isinstance(config, lora.Config) else GPT)(config)
    model.apply(model._init_weights)
    return _mxfp4_valued(model).to(torch.bfloat16).eval()


@torch.no_grad()
def test_packed_experts_give_the_bf16_logits_and_greedy_tokens_in_a_quarter_of_the_memory():
    bf16 = tiny_gpt_oss()
    packed = tiny_gpt_oss()
    expert_bytes = sum(m.weight.numel() * 2 for m in packed.modules() if type(m) is ExpertLinear)
    freed = pack_experts_mxfp4(packed)
    assert all(isinstance(m.experts.fc_1, MXFP4ExpertLinear) for m in moe_layers(packed))
    assert not any(".experts." in n and n.endswith("weight") for n, _ in packed.named_parameters())
    assert packed_bytes(packed) / expert_bytes == pytest.approx(4.25 / 16)
    assert freed == expert_bytes - packed_bytes(packed)
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for dispatch in ("loop", "gather", "capacity", "dropless"):
        for model in (bf16, packed):
            for m in moe_layers(model):
                m.dispatch = dispatch
        assert torch.equal(packed(idx), bf16(idx)), dispatch
    prompt = idx[0, :6]
    tokens = generate(packed, prompt, 6, temperature=0.0)
    assert torch.equal(tokens, generate(bf16, prompt, 6, temperature=0.0))


def test_weights_that_are_not_mxfp4_values_are_refused_and_left_alone():
    torch.manual_seed(0)
    model = GPT(family_config("gpt_oss", VOCAB))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="not MXFP4 values"):
        pack_experts_mxfp4(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_lora_trains_with_the_experts_frozen_in_mxfp4():
    name, overrides = MOE_FAMILIES["gpt_oss"]
    config = lora.Config.from_name(name, vocab_size=VOCAB, **TINY_SHAPE, **overrides, lora_r=4, lora_alpha=8,
                                   lora_query=True, lora_value=True)
    model = tiny_gpt_oss(config).float()
    pack_experts_mxfp4(model)
    lora.mark_only_lora_as_trainable(model)
    model.train()
    blocks = {n: b.clone() for n, b in model.named_buffers() if n.endswith("blocks")}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5)
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(3):
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in blocks.items())  # the experts: frozen


def _run_recipe(capsys, monkeypatch, script, *args):
    """A recipe's `__main__` block in this process (a subprocess costs seconds of imports): (exit code, out, err)."""
    import runpy
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(sys, "argv", [str(root / script), *args])
    code = 0
    try:
        runpy.run_path(str(root / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_quantize_mxfp4_packs_the_experts_and_gives_the_bf16_tokens(tmp_path, capsys, monkeypatch):
    """`generate/base.py --quantize mxfp4` on a gpt-oss checkpoint whose experts are MXFP4 values (what converting the
    Hub's checkpoint gives): the experts are packed at load and the greedy tokens are the unquantized run's."""
    from lit_gpt.loading import load_model
    from lit_gpt.weights import save_weights
    from words import GEN_PROMPT, make_word_checkpoint

    ckpt = make_word_checkpoint(tmp_path / "gpt_oss", family="gpt_oss")
    save_weights(_mxfp4_valued(load_model(ckpt)).state_dict(), ckpt)
    common = ["--checkpoint_dir", str(ckpt), "--prompt", GEN_PROMPT, "--prompt_style", "raw", "--temperature", "0",
              "--max_new_tokens", "8", "--accelerator", "cpu", "--precision", "bf16-true"]
    code, plain, err = _run_recipe(capsys, monkeypatch, "generate/base.py", *common)
    assert code == 0, err
    code, packed, err = _run_recipe(capsys, monkeypatch, "generate/base.py", *common, "--quantize", "mxfp4")
    assert code == 0, err
    n = 3 * sum(map(load_model(ckpt).config.is_moe_layer, range(load_model(ckpt).config.n_layer)))
    assert f"Packed {n} expert projections as MXFP4" in err
    assert packed == plain and packed.strip()


def test_quantize_mxfp4_refuses_a_model_without_mxfp4_experts_in_one_line(tiny_dir, capsys, monkeypatch):
    code, _, err = _run_recipe(capsys, monkeypatch, "generate/base.py", "--checkpoint_dir", str(tiny_dir),
                               "--prompt", "hi", "--quantize", "mxfp4", "--accelerator", "cpu")
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("error:") and "--quantize mxfp4" in lines[-1] and "has none" in lines[-1], err
