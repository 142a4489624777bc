"""Adapter v2 (`lit_gpt.adapter_v2`): equal to the base model at init for every family, with and without a KV cache;
trained scales/biases and prefix give the same logits with and without a cache; the right weights train and save."""

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

from lit_gpt import adapter, adapter_v2
from lit_gpt.peft import load_variant_model, save_finetuned
from lit_gpt.utils import num_parameters
from lit_gpt.weights import load_weights, read_finetuned_metadata


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_adapter_v2_equals_base_at_init_and_caches_correctly(name):
    base, model = base_and_variant(name, adapter_v2, adapter_start_layer=1, adapter_prompt_length=3)
    # every linear layer is converted, the tied head keeps sharing the embedding matrix
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    if model.config.tie_embeddings:
        assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h[1].attn, adapter.CausalSelfAttention)
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


@torch.no_grad()
def test_linear_is_scale_times_base_plus_bias():
    linear = torch.nn.Linear(8, 6)
    layer = adapter_v2.AdapterV2Linear.from_linear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias  # reused, not copied
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), linear(x), atol=0, rtol=0)
    layer.adapter_scale.copy_(torch.arange(6.0))
    layer.adapter_bias.fill_(2.0)
    torch.testing.assert_close(layer(x), torch.arange(6.0) * linear(x) + 2.0)


def test_trainable_and_saved_weights(tmp_path):
    base, model = base_and_variant("pythia-70m", adapter_v2, adapter_start_layer=1)
    adapter_v2.mark_only_adapter_v2_as_trainable(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "transformer.h.1.attn.adapter_wte.weight" in trainable
    assert "transformer.h.0.attn.qkv.adapter_scale" in trainable and "transformer.h.0.attn.qkv.weight" not in trainable
    assert {"transformer.h.0.norm_1.weight", "transformer.h.1.norm_2.bias", "transformer.ln_f.weight"} <= trainable
    for n in trainable:  # nothing else: no linear or embedding weight of the base model
        assert n.endswith(("adapter_scale", "adapter_bias", "gating_factor", "adapter_wte.weight")) or (
            ".norm_" in n or ".ln_f." in n
        ), n
    n_linear = sum(isinstance(m, adapter_v2.AdapterV2Linear) for m in model.modules())
    assert n_linear == 2 * 4 + 1  # qkv, proj, fc, proj per layer + the head
    assert num_parameters(model) > num_parameters(base)

    model.train()
    model(tokens()).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable and "adapter_wte" not in n)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)

    randomize_own_(model)
    write_base_checkpoint(base, tmp_path / "base")
    path = save_finetuned(model, tmp_path / "v2")
    assert path.name == "lit_model.adapter_v2.safetensors" and (tmp_path / "v2" / "lit_model.adapter_v2.json").is_file()
    assert read_finetuned_metadata(path)["method"] == "adapter_v2" and set(load_weights(path)) == trainable
    loaded = load_variant_model(adapter_v2.GPT, adapter_v2.Config, tmp_path / "base", path)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()), model(tokens()), atol=0, rtol=0)


def test_generate_recipe_uses_the_adapter_v2(tiny_dir, tmp_path, capsys):
    from lit_gpt.generate import load_model

    path = tmp_path / "lit_model.adapter_v2.safetensors"
    model = finetuned_on(tiny_dir, adapter_v2, path, adapter_start_layer=1)
    prompt = "The capital of France is"
    run_recipe(
        "generate/adapter_v2.py", "--checkpoint_dir", str(tiny_dir), "--adapter_path", str(path), "--prompt", prompt,
        "--max_new_tokens", "8", "--temperature", "0", "--prompt_style", "raw", "--accelerator", "cpu",
    )
    out = capsys.readouterr().out.strip()
    assert out == greedy_text(model, tiny_dir, prompt, 8)
    assert out != greedy_text(load_model(tiny_dir), tiny_dir, prompt, 8)


def test_newer_block_norms_train_too():
    """Adapter v2 trains every norm of a block: OLMo 2 has only post norms and q/k norms, Gemma 3 four norms too."""
    for name in ("OLMo-2-1124-7B", "gemma-3-4b-it"):
        _, model = base_and_variant(name, adapter_v2, adapter_start_layer=1)
        adapter_v2.mark_only_adapter_v2_as_trainable(model)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        expected = {"transformer.h.1.post_attention_norm.weight", "transformer.h.1.post_mlp_norm.weight",
                    "transformer.h.1.attn.norm_q.weight", "transformer.h.1.attn.norm_k.weight"}
        assert expected <= trainable, (name, expected - trainable)
