"""Numerical parity of `GPT` with `transformers` (the reference) for every supported family.

Each case builds a tiny random HF model in float32 with eager attention, saves it with `save_pretrained`, converts
it with the production converter and compares logits. Weights are re-drawn large enough that logits are O(1):
HF's default init (std 0.02) gives near-zero logits that would hide most bugs.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.convert import convert_hf_checkpoint  # noqa: E402
from lit_gpt.model import build_rope_cache  # noqa: E402

VOCAB = 128
SEQ = 12
_LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)

# name -> (HF config class, kwargs). Each mirrors the shape features of the real family at toy size.
FAMILIES = {
    "llama-2": ("LlamaConfig", dict(_SMALL, intermediate_size=96, rms_norm_eps=1e-5)),
    "code-llama": ("LlamaConfig", dict(_SMALL, intermediate_size=96, rms_norm_eps=1e-5, rope_theta=1e6)),
    "llama-3.1": (
        "LlamaConfig",
        dict(_SMALL, intermediate_size=96, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
    ),
    "llama-3.2": (
        "LlamaConfig",
        dict(
            _SMALL,
            intermediate_size=96,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE,
            tie_word_embeddings=True,
        ),
    ),
    "tinyllama": (
        "LlamaConfig",
        dict(_SMALL, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5),
    ),
    "smollm2": (
        "LlamaConfig",
        dict(
            _SMALL,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            intermediate_size=128,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
    ),
    # window 4 < SEQ: the sliding-window mask really drops keys
    "mistral-v0.1": ("MistralConfig", dict(_SMALL, intermediate_size=96, num_key_value_heads=2, sliding_window=4)),
    "mistral-v0.3": (
        "MistralConfig",
        dict(_SMALL, intermediate_size=96, num_key_value_heads=2, sliding_window=None, rope_theta=1e6),
    ),
    "pythia": ("GPTNeoXConfig", dict(_SMALL, intermediate_size=256, rotary_pct=0.25)),
    "stablelm-base-alpha": ("GPTNeoXConfig", dict(_SMALL, intermediate_size=192, rotary_pct=0.25, layer_norm_eps=1e-5)),
    "gpt-neox-sequential": ("GPTNeoXConfig", dict(_SMALL, intermediate_size=128, rotary_pct=0.5, use_parallel_residual=False)),
    "stablelm-2": (
        "StableLmConfig",
        dict(_SMALL, intermediate_size=96, num_key_value_heads=4, partial_rotary_factor=0.25, use_qkv_bias=True),
    ),
    "stablelm-zephyr-3b": (
        "StableLmConfig",
        dict(_SMALL, intermediate_size=96, num_key_value_heads=4, partial_rotary_factor=0.25, use_qkv_bias=False),
    ),
    "stablelm-gqa-parallel": (
        "StableLmConfig",
        dict(_SMALL, intermediate_size=96, num_key_value_heads=2, partial_rotary_factor=0.5, use_parallel_residual=True),
    ),
    "falcon-7b": (
        "FalconConfig",
        dict(_SMALL, multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False),
    ),
    "falcon-40b": (
        "FalconConfig",
        dict(_SMALL, num_attention_heads=8, new_decoder_architecture=True, num_kv_heads=2, bias=False),
    ),
    "falcon-mha-sequential": (
        "FalconConfig",
        dict(_SMALL, multi_query=False, parallel_attn=False, new_decoder_architecture=False, bias=True),
    ),
    "phi-1.5": ("PhiConfig", dict(_SMALL, intermediate_size=256, partial_rotary_factor=0.5)),
    # head size 20 as in phi-2 (80): 0.4 of it is 8 rotary dims
    "phi-2": ("PhiConfig", dict(_SMALL, hidden_size=80, intermediate_size=320, partial_rotary_factor=0.4)),
    "gemma-2b": ("GemmaConfig", dict(_SMALL, intermediate_size=128, num_key_value_heads=1, head_dim=32)),
    "gemma-7b": ("GemmaConfig", dict(_SMALL, intermediate_size=128, num_key_value_heads=4, head_dim=32)),
    "qwen2.5": (
        "Qwen2Config",
        dict(_SMALL, intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    ),
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Re-draw every parameter: norms around 1, everything else N(0, 1/fan_in)-ish, biases small but nonzero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            is_norm = type(module).__name__.endswith("Norm")
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=gen)
                if is_norm and name == "weight":
                    # Gemma stores the norm as an offset from 1, the others the scale itself
                    offset = 0.0 if "Gemma" in type(module).__name__ else 1.0
                    p.copy_(offset + 0.1 * noise)
                elif p.ndim == 1:
                    p.copy_(0.1 * noise)
                else:
                    p.copy_(noise / math.sqrt(p.shape[-1]))


def build_hf_model(family: str, seed: int = 0):
    cls_name, kwargs = FAMILIES[family]
    hf_config = getattr(transformers, cls_name)(**kwargs)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def hf_to_lit(family: str, tmp_path, seed: int = 0):
    """(HF model, converted lit GPT) for one family, through save_pretrained and the production converter."""
    hf_model = build_hf_model(family, seed)
    checkpoint_dir = tmp_path / family
    hf_model.save_pretrained(checkpoint_dir)
    convert_hf_checkpoint(checkpoint_dir)
    config = Config.from_checkpoint(checkpoint_dir)
    model = GPT(config)
    model.load_state_dict(torch.load(checkpoint_dir / "lit_model.pth", weights_only=True))
    return hf_model, model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_logits_match_transformers(family, tmp_path):
    hf_model, model = hf_to_lit(family, tmp_path)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = hf_model(idx).logits
    assert expected.std() > 0.3  # the random weights give logits large enough to show errors
    actual = model(idx)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)

    # the KV-cache path: prefill 5 tokens, then decode one at a time with `input_pos` tensors
    model.set_kv_cache(batch_size=2, max_seq_length=SEQ + 4)
    steps = [model(idx[:, :5], input_pos=torch.arange(5))]
    for t in range(5, SEQ):
        steps.append(model(idx[:, t : t + 1], input_pos=torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)

    # logits for chosen positions only
    last = model(idx[:, SEQ - 1 :], input_pos=torch.tensor([SEQ - 1]), last_only=torch.tensor([0]))
    torch.testing.assert_close(last[:, 0], expected[:, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mistral-v0.1", "llama-3.1"])
@torch.no_grad()
def test_kv_cache_after_a_longer_prompt_matches_transformers_generation(family, tmp_path):
    """Greedy decoding with our cache gives the tokens HF's own cached `generate` gives."""
    hf_model, model = hf_to_lit(family, tmp_path, seed=3)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    new = 8
    hf_out = hf_model.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0)

    model.set_kv_cache(batch_size=1, max_seq_length=prompt.size(1) + new)
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
