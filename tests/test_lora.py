"""LoRA (`lit_gpt.lora`): equal to the base model at init for every family, with and without a KV cache; merging
gives the LoRA model's outputs; only the enabled q/k/v parts get an update; the right weights train and save."""

import pytest
import torch
from tolerance import logits_tolerance
from variants import (
    FAMILIES,
    base_and_variant,
    cached_logits,
    finetuned_on,
    greedy_text,
    randomize_own_,
    run_recipe,
    tokens,
    write_base_checkpoint,
)

from lit_gpt import GPT, lora
from lit_gpt.peft import base_config, load_variant_model, save_finetuned
from lit_gpt.utils import num_parameters
from lit_gpt.weights import load_weights, read_finetuned_metadata

ALL_ON = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_key=True, lora_value=True,
              lora_projection=True, lora_mlp=True, lora_head=True)


def merged_base_model(model: lora.GPT) -> GPT:
    """A plain GPT holding the merged weights (what scripts/merge_lora.py writes)."""
    lora.merge_lora_weights(model)
    state = {k: v for k, v in model.state_dict().items() if not lora.lora_filter(k)}
    plain = GPT(base_config(model.config))
    plain.load_state_dict(state)
    return plain.eval()


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_lora_equals_base_at_init_and_merges_exactly(name):
    base, model = base_and_variant(name, lora, **ALL_ON)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())  # every projection got LoRA
    idx = tokens()
    expected = base(idx)
    torch.testing.assert_close(model(idx), expected, atol=1e-6, rtol=0)
    # the cache's prefill-then-steps sums in another order: float32's bound (tests/tolerance.py), not a tuned 1e-5
    torch.testing.assert_close(cached_logits(model, idx), expected, atol=logits_tolerance(model.config, expected),
                               rtol=0)

    randomize_own_(model)
    full = model(idx)
    assert (full - expected).abs().max() > 1e-2
    torch.testing.assert_close(cached_logits(model, idx), full, atol=logits_tolerance(model.config, full), rtol=0)
    # merged into plain weights: same outputs (a tied head gets untied, the embeddings stay the base ones)
    plain = merged_base_model(model)
    assert not plain.config.tie_embeddings
    torch.testing.assert_close(plain(idx), full, atol=1e-4, rtol=0)
    torch.testing.assert_close(plain.transformer.wte.weight, base.transformer.wte.weight, atol=0, rtol=0)
    torch.testing.assert_close(model(idx), full, atol=1e-4, rtol=0)  # merged LoRA model skips the LoRA matmuls


QKV_CASES = [(True, False, True), (False, True, False), (True, True, True), (False, False, True)]


@pytest.mark.parametrize("enabled", QKV_CASES)
@torch.no_grad()
def test_fused_qkv_updates_only_the_enabled_parts(enabled):
    q, k, v = enabled
    _, model = base_and_variant("TinyLlama-1.1B-Chat-v1.0", lora, lora_r=2, lora_query=q, lora_key=k, lora_value=v)
    qkv = model.transformer.h[0].attn.qkv
    assert qkv.splits == (4 * 16, 2 * 16, 2 * 16) and qkv.enabled == enabled
    assert qkv.lora_A.shape == (2 * sum(enabled), 64)
    assert qkv.lora_B.shape == (sum(s for s, e in zip(qkv.splits, enabled) if e), 2)
    randomize_own_(model)
    x = torch.randn(3, 5, 64)
    plain = torch.nn.functional.linear(x, qkv.weight, qkv.bias)
    changed = (qkv(x) - plain).abs().amax(dim=(0, 1)).split(qkv.splits)
    for part, on in zip(changed, enabled):
        assert (part.max() > 1e-3) if on else (part.max() == 0)
    delta = qkv.delta_weight().split(qkv.splits)
    for part, on in zip(delta, enabled):
        assert (part.abs().max() > 0) == on
    expected, weight = qkv(x), qkv.weight.clone()
    qkv.merge()
    assert qkv.merged and not torch.equal(qkv.weight, weight)
    torch.testing.assert_close(qkv(x), expected, atol=1e-5, rtol=0)
    qkv.unmerge()
    torch.testing.assert_close(qkv.weight, weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(qkv(x), expected, atol=1e-5, rtol=0)


def test_default_config_and_from_linear_reuses_the_weight():
    config = lora.Config(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    model = lora.GPT(config)
    attn = model.transformer.h[0].attn
    assert isinstance(attn.qkv, lora.LoRALinear) and attn.qkv.enabled == (True, False, True)
    assert type(attn.proj) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    assert attn.qkv.scaling == 16 / 8
    linear = torch.nn.Linear(4, 3)
    layer = lora.LoRALinear.from_linear(linear, r=2, alpha=2)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert layer.lora_B.abs().max() == 0 and layer.lora_A.abs().max() > 0
    with pytest.raises(ValueError, match="lora_r"):
        lora.Config(n_layer=1, n_head=2, n_embd=16, lora_r=0)


def test_dropout_only_in_training():
    _, model = base_and_variant("Llama-2-7b-hf", lora, lora_r=4, lora_dropout=0.5)
    randomize_own_(model)
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(model(idx), model(idx))
        model.train()
        assert not torch.equal(model(idx), model(idx))


@pytest.mark.parametrize("bias", ["none", "all", "lora_only"])
def test_trainable_weights_and_saved_file(bias, tmp_path):
    base, model = base_and_variant("pythia-70m", lora, lora_r=4, lora_value=False)
    lora.mark_only_lora_as_trainable(model, bias=bias)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora_names = {n for n in trainable if "lora_" in n}
    assert lora_names == {f"transformer.h.{i}.attn.qkv.lora_{m}" for i in range(2) for m in "AB"}
    biases = trainable - lora_names
    if bias == "none":
        assert not biases
    elif bias == "all":
        assert biases == {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    else:
        assert biases == {"transformer.h.0.attn.qkv.bias", "transformer.h.1.attn.qkv.bias"}
    n_trainable = sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    assert num_parameters(model, requires_grad=True) == n_trainable
    assert num_parameters(model) == num_parameters(base) + 2 * (4 * 64 + 64 * 4)  # A, B of q

    model.train()
    model(tokens()).sum().backward()
    assert all((p.grad is not None) == (n in trainable) for n, p in model.named_parameters())

    randomize_own_(model)
    path = save_finetuned(model, tmp_path / "out" / "lit_model.lora.safetensors")  # a folder, or the file in it
    assert path == tmp_path / "out" / "lit_model.lora.safetensors"
    meta = read_finetuned_metadata(path)
    assert meta["method"] == "lora" and set(load_weights(path)) == trainable
    assert meta["config"]["lora_r"] == 4 and meta["config"]["lora_value"] is False
    write_base_checkpoint(base, tmp_path / "base")
    loaded = load_variant_model(lora.GPT, lora.Config, tmp_path / "base", path).eval()
    assert loaded.config.lora_value is False
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()), model(tokens()), atol=0, rtol=0)


def test_generate_recipe_uses_the_lora_weights(tiny_dir, tmp_path, capsys):
    from lit_gpt.generate import load_model

    path = tmp_path / "lit_model.lora.safetensors"
    model = finetuned_on(tiny_dir, lora, path, lora_r=4, lora_mlp=True)
    prompt = "The capital of France is"
    run_recipe(
        "generate/lora.py", "--checkpoint_dir", str(tiny_dir), "--lora_path", str(path), "--prompt", prompt,
        "--max_new_tokens", "8", "--temperature", "0", "--prompt_style", "raw", "--accelerator", "cpu",
    )
    out = capsys.readouterr().out.strip()
    assert out == greedy_text(model, tiny_dir, prompt, 8)  # the recipe merges: same text as the unmerged model
    assert out != greedy_text(load_model(tiny_dir), tiny_dir, prompt, 8)


def test_generate_recipe_refuses_another_method_s_file(tiny_dir, tmp_path, capsys):
    from lit_gpt import adapter

    path = tmp_path / "lit_model.adapter.safetensors"
    finetuned_on(tiny_dir, adapter, path, adapter_start_layer=1)
    with pytest.raises(SystemExit) as exc:
        run_recipe("generate/lora.py", "--checkpoint_dir", str(tiny_dir), "--lora_path", str(path),
                   "--accelerator", "cpu", "--max_new_tokens", "2")
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "holds adapter weights, not lora: use generate/adapter.py" in err
