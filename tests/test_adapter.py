"""LLaMA-Adapter (`lit_gpt.adapter`): equal to the base model at init for every family, with and without a KV cache;
a trained prefix gives the same logits with and without a cache; only the adapter weights train and get saved.
"""

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
    tiny_config,
    tokens,
    write_base_checkpoint,
)

from lit_gpt import GPT, adapter
from lit_gpt.peft import finetuned_state_dict, load_variant_model, save_finetuned
from lit_gpt.utils import LitError, num_parameters
from lit_gpt.weights import load_weights, read_finetuned_metadata, save_weights


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_adapter_equals_base_at_init_and_caches_correctly(name):
    base, model = base_and_variant(name, adapter, adapter_start_layer=1, adapter_prompt_length=3)
    assert isinstance(model.transformer.h[1].attn, adapter.CausalSelfAttention)
    assert not isinstance(model.transformer.h[0].attn, adapter.CausalSelfAttention)
    idx = tokens()
    expected = base(idx)
    assert expected.std() > 0.3
    torch.testing.assert_close(model(idx), expected, atol=1e-6, rtol=0)
    # the cache's prefill-then-steps sums in another order: float32's bound (tests/tolerance.py), not a tuned 1e-5
    torch.testing.assert_close(cached_logits(model, idx), expected, atol=logits_tolerance(model.config, expected),
                               rtol=0)

    # a trained prefix changes the output, and the cached path still equals the full forward
    randomize_own_(model)
    full = model(idx)
    assert (full - expected).abs().max() > 1e-2
    torch.testing.assert_close(cached_logits(model, idx), full, atol=logits_tolerance(model.config, full), rtol=0)


@torch.no_grad()
def test_gate_zero_hides_the_prefix():
    """With the gate at zero no prompt vector matters; with a nonzero gate they do (the prefix is wired in)."""
    _, model = base_and_variant("TinyLlama-1.1B-Chat-v1.0", adapter, adapter_start_layer=0)
    idx = tokens()
    before = model(idx)
    attn = model.transformer.h[0].attn
    attn.adapter_wte.weight.normal_()
    torch.testing.assert_close(model(idx), before, atol=0, rtol=0)
    attn.gating_factor.fill_(1.0)
    assert (model(idx) - before).abs().max() > 1e-2


def test_only_adapter_weights_train_and_are_saved(tmp_path):
    base, model = base_and_variant("Llama-3.2-1B", adapter, adapter_start_layer=1)
    adapter.mark_only_adapter_as_trainable(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"transformer.h.1.attn.adapter_wte.weight", "transformer.h.1.attn.gating_factor"}
    assert num_parameters(model, requires_grad=True) == 10 * 64 + 4
    assert num_parameters(model) == num_parameters(base) + 10 * 64 + 4

    # gradients reach the gate and the prompt (the prompt's only through a nonzero gate)
    model.train()
    model.transformer.h[1].attn.gating_factor.data.fill_(0.1)
    model(tokens()).sum().backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in trainable), n

    assert set(finetuned_state_dict(model)) == trainable
    path = save_finetuned(model, tmp_path / "out")
    assert path == tmp_path / "out" / "lit_model.adapter.safetensors"
    meta = read_finetuned_metadata(path)  # lit_model.adapter.json beside it
    assert (meta["format"], meta["version"], meta["method"]) == ("lit_gpt.finetuned", 1, "adapter")
    assert meta["config"] == {"adapter_prompt_length": 10, "adapter_start_layer": 1}
    saved = load_weights(path)
    assert set(saved) == trainable
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters() if n in trainable)  # bit-identical


@torch.no_grad()
def test_load_from_base_and_finetuned_files_on_meta(tmp_path):
    base, model = base_and_variant("Qwen2.5-0.5B", adapter, adapter_start_layer=1, adapter_prompt_length=4)
    randomize_own_(model)
    write_base_checkpoint(base, tmp_path / "base")
    adapter.mark_only_adapter_as_trainable(model)
    path = save_finetuned(model, tmp_path)

    loaded = load_variant_model(adapter.GPT, adapter.Config, tmp_path / "base", path)
    assert loaded.config.adapter_prompt_length == 4 and loaded.config.adapter_start_layer == 1
    assert not any(p.is_meta for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied after assign=True
    idx = tokens()
    torch.testing.assert_close(loaded(idx), model(idx), atol=0, rtol=0)


def test_loading_the_wrong_kind_of_file_is_a_clear_error(tmp_path):
    base, model = base_and_variant("Llama-2-7b-hf", adapter, adapter_start_layer=1)
    write_base_checkpoint(base, tmp_path / "base")
    path = save_finetuned(model, tmp_path / "run")
    from lit_gpt import adapter_v2, lora

    with pytest.raises(LitError, match="holds adapter weights, not lora: use generate/adapter.py") as e:
        load_variant_model(lora.GPT, lora.Config, tmp_path / "base", path)
    assert "\n" not in str(e.value)
    # a whole model, in either format, is not a finetuned-weights file
    save_weights(base.state_dict(), tmp_path / "base_new")
    (tmp_path / "base_old").mkdir()
    torch.save(base.state_dict(), tmp_path / "base_old" / "lit_model.pth")  # an earlier version's format
    for whole in (tmp_path / "base_old" / "lit_model.pth", tmp_path / "base_new" / "lit_model.safetensors"):
        with pytest.raises(LitError, match="not a finetuned-weights file"):
            load_variant_model(adapter_v2.GPT, adapter_v2.Config, tmp_path / "base", whole)
    for missing in (tmp_path / "missing.pth", tmp_path / "missing" / "lit_model.adapter.safetensors"):
        with pytest.raises(LitError, match="not found"):
            load_variant_model(adapter.GPT, adapter.Config, tmp_path / "base", missing)
    # the weights without their JSON (the method and its settings): one line naming the recipe
    alone = tmp_path / "alone" / "lit_model.adapter.safetensors"
    alone.parent.mkdir()
    alone.write_bytes(path.read_bytes())
    with pytest.raises(LitError, match=r"has no lit_model\.adapter\.json beside it.*generate/adapter\.py") as e:
        load_variant_model(adapter.GPT, adapter.Config, tmp_path / "base", alone)
    assert "\n" not in str(e.value)
    # a file trained with another base model
    other = GPT(tiny_config("Llama-2-7b-hf", n_embd=32, head_size=8))
    write_base_checkpoint(other, tmp_path / "other")
    with pytest.raises(LitError, match="does not match"):
        load_variant_model(adapter.GPT, adapter.Config, tmp_path / "other", path)


@torch.no_grad()
def test_legacy_pth_adapter_file_still_loads(tmp_path):
    """Earlier versions wrote `lit_model.pth.adapter` (a torch.save pickle of method, config and weights)."""
    base, model = base_and_variant("Qwen2.5-0.5B", adapter, adapter_start_layer=1, adapter_prompt_length=4)
    randomize_own_(model)
    write_base_checkpoint(base, tmp_path / "base")
    adapter.mark_only_adapter_as_trainable(model)
    legacy = tmp_path / "lit_model.pth.adapter"
    torch.save({"method": "adapter", "config": {"adapter_prompt_length": 4, "adapter_start_layer": 1},
                "model": finetuned_state_dict(model)}, legacy)
    loaded = load_variant_model(adapter.GPT, adapter.Config, tmp_path / "base", legacy)
    assert loaded.config.adapter_prompt_length == 4
    torch.testing.assert_close(loaded(tokens()), model.eval()(tokens()), atol=0, rtol=0)


def test_generate_recipe_uses_the_adapter(tiny_dir, tmp_path, capsys):
    from lit_gpt.generate import load_model

    path = tmp_path / "lit_model.adapter.safetensors"
    model = finetuned_on(tiny_dir, adapter, path, adapter_start_layer=0, adapter_prompt_length=4)
    prompt = "The capital of France is"
    run_recipe(
        "generate/adapter.py", "--checkpoint_dir", str(tiny_dir), "--adapter_path", str(path), "--prompt", prompt,
        "--max_new_tokens", "8", "--temperature", "0", "--prompt_style", "raw", "--accelerator", "cpu",
    )
    out = capsys.readouterr().out.strip()
    assert out == greedy_text(model, tiny_dir, prompt, 8)
    assert out != greedy_text(load_model(tiny_dir), tiny_dir, prompt, 8)  # the adapter changed the text
