"""Numerical parity of `GPT` with `transformers` (the reference) for every supported family.

Each case builds a tiny random HF model in float32 with eager attention, saves it with `save_pretrained`, converts
it with the production converter and compares logits (the tiny configs: tests/tiny_hf.py).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_hf import FAMILIES, NEW_FAMILIES, SEQ, VOCAB, build_hf_model, hf_to_lit  # noqa: E402  (tiny HF models)

from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.convert import convert_hf_checkpoint, convert_lit_checkpoint  # noqa: E402
from lit_gpt.model import build_rope_cache  # noqa: E402
from lit_gpt.weights import load_weights  # noqa: E402
from tiny_hf import randomize_  # noqa: E402

@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_logits_match_transformers(family, tmp_path):
    hf_model, model = hf_to_lit(family, tmp_path)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = hf_model(idx).logits
    assert expected.std() > 0.3  # the random weights give logits large enough to show errors
    actual = model(idx)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)

    # the KV-cache path: prefill 5 tokens, then decode one at a time with `input_pos` tensors; LongRoPE in a cache
    # longer than its original context (64) keeps the short factors while the sequence stays within it
    longrope = (model.config.rope_scaling or {}).get("type") == "longrope"
    model.set_kv_cache(batch_size=2, max_seq_length=model.config.block_size if longrope else SEQ + 4)
    steps = [model(idx[:, :5], input_pos=torch.arange(5))]
    for t in range(5, SEQ):
        steps.append(model(idx[:, t : t + 1], input_pos=torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)

    # logits for chosen positions only
    last = model(idx[:, SEQ - 1 :], input_pos=torch.tensor([SEQ - 1]), last_only=torch.tensor([0]))
    torch.testing.assert_close(last[:, 0], expected[:, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mistral-v0.1", "llama-3.1", *NEW_FAMILIES, "phi3.5-longrope-beyond"])
@torch.no_grad()
def test_kv_cache_after_a_longer_prompt_matches_transformers_generation(family, tmp_path):
    """Greedy decoding with our cache gives the tokens HF's own cached `generate` gives: a 7-token prompt, longer
    than the sliding windows (4, 5) of the families that have one, and 8 new tokens. LongRoPE: within the original
    context (64) the short factors; past it (8, a 9-token prompt), the long ones."""
    hf_model, model = hf_to_lit(family, tmp_path, seed=3)
    prompt = torch.randint(0, VOCAB, (1, 9 if "beyond" in family else 7), generator=torch.Generator().manual_seed(2))
    new = 8
    hf_out = hf_model.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0)

    # a cache longer than the original LongRoPE context (64) must not change the factors: the sequence decides
    cache = model.config.block_size if "longrope" in family else prompt.size(1) + new
    model.set_kv_cache(batch_size=1, max_seq_length=cache)
    tokens = prompt
    logits = model(prompt, input_pos=torch.arange(prompt.size(1)))[:, -1]
    for t in range(prompt.size(1), prompt.size(1) + new):
        nxt = logits.argmax(-1, keepdim=True)
        tokens = torch.cat((tokens, nxt), dim=1)
        logits = model(nxt, input_pos=torch.tensor([t]))[:, -1]
    assert torch.equal(tokens, hf_out)


def test_rope_cache_matches_transformers_llama3_scaling():
    """Our llama3 frequency scaling equals transformers' implementation on the real Llama 3.1 settings."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Config.from_name("Llama-3.1-8B")
    hf_config = transformers.LlamaConfig(
        hidden_size=config.n_embd,
        num_attention_heads=config.n_head,
        rope_theta=config.rope_base,
        rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    cos, sin = build_rope_cache(4096, config)
    pos = torch.arange(4096).float()
    freqs = torch.outer(pos, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    torch.testing.assert_close(cos, emb.cos())
    torch.testing.assert_close(sin, emb.sin())


@torch.no_grad()
def test_sliding_window_masks_old_keys():
    """With a window of 3, changing a token 3+ positions back leaves the last logits unchanged (one layer)."""
    config = Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, block_size=32, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=32, sliding_window_size=3,
    )
    torch.manual_seed(0)
    model = GPT(config).eval()
    idx = torch.randint(0, VOCAB, (1, 10))
    changed = idx.clone()
    changed[0, 6] = (idx[0, 6] + 1) % VOCAB  # 3 positions before the last: outside the window
    torch.testing.assert_close(model(idx)[:, -1], model(changed)[:, -1], atol=0, rtol=0)
    changed[0, 7] = (idx[0, 7] + 1) % VOCAB  # inside the window
    assert not torch.allclose(model(idx)[:, -1], model(changed)[:, -1])


@torch.no_grad()
def test_kv_cache_batch_size_mismatch_is_an_error():
    config = Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, block_size=16)
    model = GPT(config)
    model.set_kv_cache(batch_size=2)
    with pytest.raises(ValueError, match="batch size"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.arange(3))
    model.clear_kv_cache()
    with pytest.raises(TypeError, match="set_kv_cache"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.arange(3))


@pytest.mark.parametrize("family", ["llama-3.2", *NEW_FAMILIES])
@torch.no_grad()
def test_bf16_checkpoint_is_within_bf16_error_of_transformers(family, tmp_path):
    """A bf16 checkpoint (what the Hub serves) run in bf16: its logits are as close to the float32 reference as
    transformers' own bf16 run of the same weights, prefill and cached decode alike."""
    reference = build_hf_model(family)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = reference(idx).logits
    hf16 = reference.to(torch.bfloat16)
    hf16.save_pretrained(tmp_path / family)
    hf_error = (hf16(idx).logits.float() - expected).abs().max()

    convert_hf_checkpoint(tmp_path / family)
    state = load_weights(tmp_path / family / "lit_model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in state.values())  # the converter keeps the file's dtype
    with torch.device("meta"):
        model = GPT(Config.from_checkpoint(tmp_path / family))
    model.load_state_dict(state, assign=True)  # bf16 parameters, float32 RoPE tables rebuilt on the CPU
    model.eval()
    ours = model(idx).float()
    error = (ours - expected).abs().max()
    # bf16 has 8 bits of mantissa: both runs round differently, but neither may be far worse than the other
    assert error <= 2 * hf_error + 0.02, (error, hf_error)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9

    model.set_kv_cache(batch_size=2, max_seq_length=SEQ)
    steps = [model(idx[:, :5], input_pos=torch.arange(5))]
    for t in range(5, SEQ):
        steps.append(model(idx[:, t : t + 1], input_pos=torch.tensor([t])))
    cached_error = (torch.cat(steps, dim=1).float() - expected).abs().max()
    assert cached_error <= 2 * hf_error + 0.02, (cached_error, hf_error)


@torch.no_grad()
def test_gemma3_multimodal_folder_converts_its_text_tower(tmp_path, capsys):
    """A Gemma 3 folder with a vision tower (model_type gemma3, as 4B-27B ship): the text model is converted, one
    line says the vision tower is left out, and the logits equal transformers' on text input."""
    text = transformers.Gemma3TextConfig(**FAMILIES["gemma3"][1])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_(hf_model)
    hf_model.save_pretrained(tmp_path / "gemma3-mm")
    assert json.loads((tmp_path / "gemma3-mm" / "config.json").read_text())["model_type"] == "gemma3"

    convert_hf_checkpoint(tmp_path / "gemma3-mm")
    err = capsys.readouterr().err
    assert "vision tower is left out" in err
    lit_config = Config.from_checkpoint(tmp_path / "gemma3-mm")
    assert lit_config.hf_model_type == "gemma3_text" and lit_config.rope_local_base == 10000.0
    model = GPT(lit_config)
    model.load_state_dict(load_weights(tmp_path / "gemma3-mm" / "lit_model.safetensors"))
    idx = torch.randint(0, VOCAB - 4, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.eval()(idx), hf_model(input_ids=idx).logits, atol=1e-4, rtol=0)
    # exported back as the text model, with the multimodal config's special token ids
    out = convert_lit_checkpoint(tmp_path / "gemma3-mm", tmp_path / "text")
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == "gemma3_text" and exported["eos_token_id"] == config.text_config.eos_token_id
    text_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(text_model(idx).logits, hf_model(input_ids=idx).logits, atol=1e-4, rtol=0)
