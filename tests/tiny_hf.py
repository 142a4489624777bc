"""Tiny random Hugging Face models of every supported family (the numerical reference of the parity tests), shared
by tests/test_model.py and tests/test_convert.py.

Weights are re-drawn large enough that logits are O(1): HF's default init (std 0.02) gives near-zero logits that
would hide most bugs.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.convert import convert_hf_checkpoint  # noqa: E402
from lit_gpt.weights import find_weights, load_weights  # noqa: E402

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
    # head_dim 32 != hidden / heads (16), as in Qwen3 (128 with 1024 / 16 at 0.6B); per-head q/k norms
    "qwen3": (
        "Qwen3Config",
        dict(_SMALL, intermediate_size=96, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
    ),
    # Qwen3's long-context recipe: YaRN scaling of RoPE; and a window on the upper layer (max_window_layers)
    "qwen3-yarn-window": (
        "Qwen3Config",
        dict(
            _SMALL,
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=16,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8),
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
    ),
    # soft-capping low enough to bend these random scores and logits; query_pre_attn_scalar != head_dim;
    # layer 0 slides (window 4 < SEQ), layer 1 is global
    "gemma2": (
        "Gemma2Config",
        dict(
            _SMALL,
            intermediate_size=128,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=4,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
    ),
    # five local layers to one global (7 layers: the pattern restarts), local RoPE base 10k, global 1M with
    # linear scaling 8 (Gemma 3 4B and up), q/k norms
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            _SMALL,
            num_hidden_layers=7,
            intermediate_size=128,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=4,
            query_pre_attn_scalar=32,
            rope_scaling=dict(rope_type="linear", factor=8.0),
        ),
    ),
    "phi3": ("Phi3Config", dict(_SMALL, intermediate_size=96, num_key_value_heads=2, pad_token_id=0)),
    # Phi-3.5-mini: LongRoPE factors and a sliding window; 6 factors for the 12 rotary dims
    "phi3.5-longrope": (
        "Phi3Config",
        dict(
            _SMALL,
            intermediate_size=96,
            pad_token_id=0,
            sliding_window=5,
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            rope_scaling=dict(
                type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0],
            ),
        ),
    ),
    # Phi-4-mini: GQA, partial rotary 0.75 (12 of 16 dims), tied embeddings
    "phi4-mini": (
        "Phi3Config",
        dict(
            _SMALL,
            intermediate_size=96,
            num_key_value_heads=2,
            pad_token_id=0,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            rope_scaling=dict(type="longrope", short_factor=[1.0] * 6, long_factor=[1.0, 2.0, 3.0, 5.0, 8.0, 13.0]),
        ),
    ),
    "olmo2": ("Olmo2Config", dict(_SMALL, intermediate_size=96, num_key_value_heads=2, pad_token_id=0)),
    # every 4th layer without RoPE (layer 3)
    "smollm3": (
        "SmolLM3Config",
        dict(_SMALL, num_hidden_layers=4, intermediate_size=96, num_key_value_heads=2, pad_token_id=0,
             tie_word_embeddings=True),
    ),
    # mixtures of experts (tests/test_moe_parity.py): 4 experts, top 2, renormalised (Mixtral always)
    "mixtral": ("MixtralConfig", dict(_SMALL, intermediate_size=96, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    # a dense first layer (mlp_only_layers) before MoE layers, top-k weights renormalised; head_dim != hidden / heads
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(_SMALL, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
             head_dim=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True),
    ),
    # every second layer MoE (decoder_sparse_step 2), top-k weights as the softmax gave them (norm_topk_prob off)
    "qwen3_moe-sparse-step": (
        "Qwen3MoeConfig",
        dict(_SMALL, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=False),
    ),
    # biased attention with sinks, window 4 < SEQ on layer 0, YaRN, top-k-then-softmax routing with a biased router,
    # clamped SwiGLU experts with biases (a clamp these activations reach); widths multiples of 32 (MXFP4 groups)
    "gpt_oss": (
        "GptOssConfig",
        dict(_SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.0, swiglu_alpha=1.5),
    ),
}
# (not in NEW_FAMILIES: in a bf16 run a near tie between two experts' router probabilities may round either way, so
# one token's logits can differ from transformers' bf16 run by far more than bf16's rounding; their bf16 folders are
# checked computing in float32, tests/test_moe_parity.py)
MOE_FAMILIES = ["mixtral", "qwen3_moe", "qwen3_moe-sparse-step", "gpt_oss"]


# families used by the generation test only: Phi-3.5-style LongRoPE with an original context (8) shorter than the
# prompt, so the long factors apply throughout (as in transformers for such a prompt)
GENERATION_FAMILIES = {
    "phi3.5-longrope-beyond": (
        "Phi3Config",
        dict(
            FAMILIES["phi3.5-longrope"][1], sliding_window=None, max_position_embeddings=32,
            original_max_position_embeddings=8,
        ),
    ),
}
# the families added with their layer features (the parity tests of each run in the default suite)
NEW_FAMILIES = [
    "qwen3", "qwen3-yarn-window", "gemma2", "gemma3", "phi3", "phi3.5-longrope", "phi4-mini", "olmo2", "smollm3",
]


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Re-draw every parameter: norms around 1, everything else N(0, 1/fan_in)-ish, biases small but nonzero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            is_norm = type(module).__name__.endswith("Norm")
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=gen)
                if name == "sinks":  # gpt-oss's sink logits: large enough to take a visible share of attention
                    p.copy_(noise)
                elif is_norm and name == "weight":
                    # Gemma stores the norm as an offset from 1, the others the scale itself
                    offset = 0.0 if "Gemma" in type(module).__name__ else 1.0
                    p.copy_(offset + 0.1 * noise)
                elif p.ndim == 1:
                    p.copy_(0.1 * noise)
                else:
                    p.copy_(noise / math.sqrt(p.shape[-1]))


def build_hf_model(family: str, seed: int = 0):
    cls_name, kwargs = FAMILIES[family] if family in FAMILIES else GENERATION_FAMILIES[family]
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
    model.load_state_dict(load_weights(find_weights(checkpoint_dir)))
    return hf_model, model.eval()
