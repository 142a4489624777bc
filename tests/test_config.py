"""The config registry, `Config.from_hf_config` for every family, and the registry's agreement with HF configs."""

import json
from dataclasses import fields

import pytest
import torch

import lit_gpt.config_registry as config_module  # the named configs (data)
from lit_gpt import Config
from lit_gpt.convert import _HFToLit, _check_state, _expected_state, hf_config_dict, hf_model_type

# the HF family each registry name belongs to, by name prefix (first match wins)
FAMILY_BY_PREFIX = [
    ("Llama-", "llama"),
    ("CodeLlama-", "llama"),
    ("Meta-Llama-", "llama"),
    ("TinyLlama-", "llama"),
    ("SmolLM2-", "llama"),
    ("SmolLM3-", "smollm3"),
    ("Mistral-", "mistral"),
    ("Qwen3-30B-A3B", "qwen3_moe"),
    ("Qwen3-235B-A22B", "qwen3_moe"),
    ("Qwen3-", "qwen3"),
    ("Mixtral-", "mixtral"),
    ("gpt-oss-", "gpt_oss"),
    ("OLMo-2-", "olmo2"),
    ("Phi-3.5-", "phi3"),
    ("Phi-4-", "phi3"),
    ("phi-4", "phi3"),
    ("gemma-2-", "gemma2"),
    ("gemma-3-", "gemma3_text"),
    ("pythia-", "gpt_neox"),
    ("stablelm-base-alpha-", "gpt_neox"),
    ("stablelm-", "stablelm"),
    ("falcon-", "falcon"),
    ("phi-", "phi"),
    ("gemma-", "gemma"),
    ("Qwen2.5-", "qwen2"),
]
IGNORED = {"name", "hf_config", "hf_model_type"}


def architecture(config: Config) -> dict:
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in IGNORED}


def test_unknown_name_lists_the_nearest_names():
    with pytest.raises(ValueError, match="Unknown model name 'Llama-2-7b-chat'.*Did you mean: .*Llama-2-7b-chat-hf"):
        Config.from_name("Llama-2-7b-chat")
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct"):
        Config.from_name("SmolLM2-135M-instruct")


def test_from_name_overrides_and_names():
    names = Config.names()
    assert names == sorted(names) and len(names) == len(set(names)) > 50
    config = Config.from_name("pythia-70m", n_layer=2)
    assert config.n_layer == 2 and Config.from_name("pythia-70m").n_layer == 6


@pytest.mark.parametrize("name", Config.names())
def test_every_named_config(name):
    config = Config.from_name(name)
    assert config.name == name and config.hf_config == {"org": config.hf_config["org"], "name": name}
    assert config.n_head % config.n_query_groups == 0
    assert 0 < config.rope_n_elem <= config.head_size and config.rope_n_elem % 2 == 0
    family = next(f for prefix, f in FAMILY_BY_PREFIX if name.startswith(prefix))
    assert hf_model_type(config) == family
    # the HF config.json the exporter writes reads back as the same architecture
    hf = hf_config_dict(config)
    assert hf["model_type"] == family
    assert architecture(Config.from_hf_config(json.loads(json.dumps(hf)))) == architecture(config)


def test_named_configs_match_transformers_model_shapes():
    """For every distinct registry architecture (1 layer), transformers builds a model from the exported config
    whose tensors convert to exactly the shapes of our `GPT` (on the meta device: no memory)."""
    transformers = pytest.importorskip("transformers")
    seen = set()
    for name in Config.names():
        config = Config.from_name(name, n_layer=1)
        hf = hf_config_dict(config)
        key = json.dumps(hf, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
        mapper = _HFToLit(hf["model_type"], config)
        state = {}
        for k, v in model.state_dict().items():
            for lit_name, t in mapper(k, v):  # one HF tensor gives none (q/k/v waiting), one or two lit tensors
                state[lit_name] = t
        mapper.finish()
        if config.tie_embeddings:
            state["lm_head.weight"] = state["transformer.wte.weight"]
        _check_state(state, _expected_state(config), name, "")
    assert len(seen) > 30


# Contents of real Hugging Face config.json files (the fields that matter), in the transformers 4.x spelling most
# Hub repos still use; each must give the registry entry of the same name.
REAL_HF_CONFIGS = {
    "SmolLM2-135M-Instruct": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, max_position_embeddings=8192,
        num_attention_heads=9, num_hidden_layers=30, num_key_value_heads=3, rms_norm_eps=1e-5, rope_scaling=None,
        rope_theta=100000, tie_word_embeddings=True, vocab_size=49152, hidden_act="silu",
    ),
    "Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, max_position_embeddings=131072,
        num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8, rms_norm_eps=1e-5, head_dim=64,
        rope_scaling=dict(
            factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
        rope_theta=500000.0, tie_word_embeddings=True, vocab_size=128256, hidden_act="silu",
    ),
    "TinyLlama-1.1B-Chat-v1.0": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, max_position_embeddings=2048,
        num_attention_heads=32, num_hidden_layers=22, num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, vocab_size=32000,
    ),
    "Mistral-7B-v0.1": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
        num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=4096, tie_word_embeddings=False, vocab_size=32000,
    ),
    "pythia-70m": dict(
        model_type="gpt_neox", hidden_size=512, intermediate_size=2048, max_position_embeddings=2048,
        num_attention_heads=8, num_hidden_layers=6, rotary_emb_base=10000, rotary_pct=0.25,
        use_parallel_residual=True, vocab_size=50304, layer_norm_eps=1e-5, hidden_act="gelu",
        tie_word_embeddings=False,
    ),
    "falcon-7b": dict(
        model_type="falcon", hidden_size=4544, num_attention_heads=71, num_hidden_layers=32, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False, vocab_size=65024,
        layer_norm_epsilon=1e-5,
    ),
    "falcon-40b": dict(
        model_type="falcon", hidden_size=8192, n_head=128, n_head_kv=8, n_layer=60, new_decoder_architecture=True,
        parallel_attn=True, bias=False, alibi=False, vocab_size=65024, layer_norm_epsilon=1e-5,
    ),
    "phi-2": dict(
        model_type="phi", hidden_size=2560, intermediate_size=10240, num_attention_heads=32, num_hidden_layers=32,
        partial_rotary_factor=0.4, vocab_size=51200, max_position_embeddings=2048, layer_norm_eps=1e-5,
        hidden_act="gelu_new", rope_theta=10000.0, tie_word_embeddings=False, qk_layernorm=False,
    ),
    "gemma-2b": dict(
        model_type="gemma", head_dim=256, hidden_size=2048, intermediate_size=16384, num_attention_heads=8,
        num_hidden_layers=18, num_key_value_heads=1, max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_theta=10000.0, vocab_size=256000, hidden_act="gelu",
    ),
    "stablelm-2-1_6b": dict(
        model_type="stablelm", hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
        num_hidden_layers=24, num_key_value_heads=32, partial_rotary_factor=0.25, rope_theta=10000,
        use_qkv_bias=True, vocab_size=100352, max_position_embeddings=4096, layer_norm_eps=1e-5,
        use_parallel_residual=False, hidden_act="silu", tie_word_embeddings=False, qk_layernorm=False,
    ),
    "Qwen2.5-0.5B": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, max_position_embeddings=32768,
        num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        sliding_window=32768, use_sliding_window=False, tie_word_embeddings=True, vocab_size=151936,
        hidden_act="silu",
    ),
    "Qwen3-0.6B": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, max_position_embeddings=40960,
        num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000, rope_scaling=None, sliding_window=None, use_sliding_window=False, max_window_layers=28,
        tie_word_embeddings=True, vocab_size=151936, attention_bias=False, hidden_act="silu",
    ),
    "gemma-2-2b": dict(
        model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, num_hidden_layers=26, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        vocab_size=256000, hidden_activation="gelu_pytorch_tanh", cache_implementation="hybrid",
    ),
    "gemma-3-1b-it": dict(
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, num_hidden_layers=26, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000, rope_local_base_freq=10000, rope_scaling=None, query_pre_attn_scalar=256,
        sliding_window=512, sliding_window_pattern=6, attn_logit_softcapping=None, final_logit_softcapping=None,
        vocab_size=262144, hidden_activation="gelu_pytorch_tanh",
    ),
    # the multimodal folders: a sparse text_config, the rest from transformers' Gemma3TextConfig defaults
    "gemma-3-4b-it": dict(
        model_type="gemma3", text_config=dict(
            hidden_size=2560, intermediate_size=10240, model_type="gemma3_text", num_hidden_layers=34,
            rope_scaling=dict(factor=8.0, rope_type="linear"), sliding_window=1024,
        ), vision_config=dict(model_type="siglip_vision_model"), mm_tokens_per_image=256,
    ),
    "gemma-3-27b-it": dict(
        model_type="gemma3", text_config=dict(
            head_dim=128, hidden_size=5376, intermediate_size=21504, model_type="gemma3_text", num_attention_heads=32,
            num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168,
            rope_scaling=dict(factor=8.0, rope_type="linear"), sliding_window=1024,
        ), vision_config=dict(model_type="siglip_vision_model"),
    ),
    "Phi-3.5-mini-instruct": dict(
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
        num_hidden_layers=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=False, vocab_size=32064,
        rope_scaling=dict(type="longrope", long_factor=config_module._PHI35_LONG,
                          short_factor=config_module._PHI35_SHORT),
    ),
    "Phi-4-mini-instruct": dict(
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
        num_hidden_layers=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=262144,
        tie_word_embeddings=True, vocab_size=200064,
        rope_scaling=dict(type="longrope", long_factor=config_module._PHI4_MINI_LONG, short_factor=[1.0] * 48),
    ),
    "phi-4": dict(
        model_type="phi3", hidden_size=5120, intermediate_size=17920, num_attention_heads=40, num_key_value_heads=10,
        num_hidden_layers=40, max_position_embeddings=16384, original_max_position_embeddings=16384,
        rms_norm_eps=1e-5, rope_theta=250000, rope_scaling=None, sliding_window=None, tie_word_embeddings=False,
        vocab_size=100352,
    ),
    "OLMo-2-1124-7B": dict(
        model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
        num_hidden_layers=32, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000,
        tie_word_embeddings=False, vocab_size=100352, attention_bias=False,
    ),
    "SmolLM3-3B": dict(
        model_type="smollm3", hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
        num_key_value_heads=4, num_hidden_layers=36, max_position_embeddings=65536, rms_norm_eps=1e-6,
        rope_theta=5000000.0, no_rope_layers=[1, 1, 1, 0] * 9, use_sliding_window=False, sliding_window=None,
        tie_word_embeddings=True, vocab_size=128256,
    ),
}


@pytest.mark.parametrize("name", list(REAL_HF_CONFIGS))
def test_registry_agrees_with_real_hf_configs(name):
    config = Config.from_hf_config(REAL_HF_CONFIGS[name], name=name)
    model_type = REAL_HF_CONFIGS[name]["model_type"]
    assert config.name == name and config.hf_model_type == ("gemma3_text" if model_type == "gemma3" else model_type)
    assert architecture(config) == architecture(Config.from_name(name))


def test_from_hf_config_reads_transformers_5_configs():
    """transformers 5 writes RoPE settings under `rope_parameters`; the partial rotary factor lives there too."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)

    def read(cls, **kw):
        return Config.from_hf_config(getattr(transformers, cls)(**small, **kw).to_dict())

    assert read("GPTNeoXConfig", rotary_pct=0.5, rotary_emb_base=20000).rope_n_elem == 8
    assert read("GPTNeoXConfig", rotary_pct=0.5, rotary_emb_base=20000).rope_base == 20000.0
    assert read("PhiConfig", partial_rotary_factor=0.25).rotary_percentage == 0.25
    assert read("StableLmConfig", partial_rotary_factor=0.5, num_key_value_heads=2).rotary_percentage == 0.5
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    c = read("LlamaConfig", rope_theta=500000.0, rope_scaling=llama3)
    assert c.rope_base == 500000.0
    assert c.rope_scaling == dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=32)
    assert read("MistralConfig", sliding_window=7, num_key_value_heads=2).sliding_window_size == 7
    qwen = read("Qwen2Config", num_key_value_heads=2, tie_word_embeddings=True)
    assert qwen.attn_bias and qwen.tie_embeddings and qwen.n_query_groups == 2 and qwen.sliding_window_size is None
    gemma = read("GemmaConfig", head_dim=32, num_key_value_heads=1)
    assert gemma.head_size == 32 and gemma.norm_unit_offset and gemma.scale_embeddings and gemma.tie_embeddings

    # Falcon: (parallel residual, one shared norm, KV heads) for each of its architectures
    falcon = {
        "7b": dict(multi_query=True, parallel_attn=True, new_decoder_architecture=False),
        "mha sequential": dict(multi_query=False, parallel_attn=False, new_decoder_architecture=False),
        "40b": dict(new_decoder_architecture=True, num_kv_heads=2),
        "40b one norm": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    }
    got = {k: read("FalconConfig", **kw) for k, kw in falcon.items()}
    assert {k: (c.parallel_residual, c.shared_attention_norm, c.n_query_groups) for k, c in got.items()} == {
        "7b": (True, True, 1),
        "mha sequential": (False, False, 4),
        "40b": (True, False, 2),
        "40b one norm": (True, True, 2),
    }


@pytest.mark.parametrize(
    "hf, message",
    [
        (dict(model_type="gpt2", vocab_size=8), "Unsupported model_type 'gpt2'"),
        (
            dict(model_type="llama", vocab_size=8, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                 rope_scaling=dict(rope_type="dynamic", factor=2.0)),
            "Unsupported rope scaling 'dynamic'",
        ),
        (
            dict(model_type="gemma2", vocab_size=8, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                 head_dim=4, num_key_value_heads=1, num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention", "chunked_attention"]),
            r"layer_types value\(s\) 'chunked_attention' not implemented",
        ),
        (
            dict(model_type="gemma3_text", vocab_size=8, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                 head_dim=4, num_key_value_heads=1, num_hidden_layers=1, rope_parameters=dict(
                     full_attention=dict(rope_type="default", rope_theta=1e6),
                     sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
            "RoPE scaling on the sliding_attention layers",
        ),
        (
            dict(model_type="phi3", vocab_size=8, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                 num_hidden_layers=1, max_position_embeddings=64, original_max_position_embeddings=16,
                 rope_scaling=dict(type="longrope", short_factor=[1.0], long_factor=[2.0])),
            r"short_factor has 1 values, the model's RoPE needs 2",
        ),
        (
            dict(model_type="qwen3", vocab_size=8, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                 num_hidden_layers=1, attention_bias=True),
            "attention_bias",
        ),
        (
            dict(model_type="qwen2", vocab_size=8, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                 use_sliding_window=True),
            "use_sliding_window",
        ),
        (dict(model_type="falcon", vocab_size=8, hidden_size=8, num_attention_heads=2, alibi=True), "alibi"),
        (
            dict(model_type="gpt_neox", vocab_size=8, hidden_size=8, num_attention_heads=2, attention_bias=False),
            "attention_bias",
        ),
    ],
)
def test_from_hf_config_rejects_what_the_model_cannot_run(hf, message):
    with pytest.raises(ValueError, match=message):
        Config.from_hf_config(hf)


def test_save_and_from_checkpoint_round_trip(tmp_path):
    config = Config.from_name("Llama-3.1-8B", n_layer=2, hf_model_type="llama")
    config.save(tmp_path)
    assert Config.from_checkpoint(tmp_path) == config
    with pytest.raises(FileNotFoundError, match="download.py"):
        Config.from_checkpoint(tmp_path / "empty")
