"""The named configs (`Config.from_name("Llama-3.2-1B")`): data, one dict per model, each with a comment linking the
Hugging Face `config.json` it mirrors. `lit_gpt.config.Config` is the dataclass they fill."""

from copy import deepcopy
from typing import Any, Dict, List

configs: List[Dict[str, Any]] = []


def _llama(org: str, name: str, **kw: Any) -> Dict[str, Any]:
    return dict(
        name=name,
        hf_config=dict(org=org, name=name),
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        **kw,
    )


# ------------------------------------------------------------------ Llama 2
# https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
for size, (n_layer, n_head, n_embd, groups, inter) in {
    "7b": (32, 32, 4096, 32, 11008),
    "13b": (40, 40, 5120, 40, 13824),
    "70b": (80, 64, 8192, 8, 28672),
}.items():
    for suffix in ("-hf", "-chat-hf"):
        configs.append(
            _llama(
                "meta-llama",
                f"Llama-2-{size}{suffix}",
                block_size=4096,
                vocab_size=32000,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                n_query_groups=groups,
                intermediate_size=inter,
                norm_eps=1e-5,
            )
        )

# ------------------------------------------------------------------ Code Llama
# https://huggingface.co/codellama/CodeLlama-7b-hf/blob/main/config.json
for size, (n_layer, n_head, n_embd, groups, inter, vocab) in {
    "7b": (32, 32, 4096, 32, 11008, 32016),
    "13b": (40, 40, 5120, 40, 13824, 32016),
    "34b": (48, 64, 8192, 8, 22016, 32000),
    "70b": (80, 64, 8192, 8, 28672, 32016),
}.items():
    for variant in ("", "-Python", "-Instruct"):
        configs.append(
            _llama(
                "codellama",
                f"CodeLlama-{size}{variant}-hf",
                block_size=16384,
                vocab_size=32000 if variant == "-Python" else vocab,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                n_query_groups=groups,
                intermediate_size=inter,
                norm_eps=1e-5,
                rope_base=1000000.0,
            )
        )

# ------------------------------------------------------------------ Llama 3 / 3.1 / 3.2
# https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
# https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
# https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
_LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_LLAMA32_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
for name, (n_layer, n_head, n_embd, groups, inter, block, scaling, tie) in {
    "Meta-Llama-3-8B": (32, 32, 4096, 8, 14336, 8192, None, False),
    "Meta-Llama-3-70B": (80, 64, 8192, 8, 28672, 8192, None, False),
    "Llama-3.1-8B": (32, 32, 4096, 8, 14336, 131072, _LLAMA3_SCALING, False),
    "Llama-3.1-70B": (80, 64, 8192, 8, 28672, 131072, _LLAMA3_SCALING, False),
    "Llama-3.1-405B": (126, 128, 16384, 8, 53248, 131072, _LLAMA3_SCALING, False),
    "Llama-3.2-1B": (16, 32, 2048, 8, 8192, 131072, _LLAMA32_SCALING, True),
    "Llama-3.2-3B": (28, 24, 3072, 8, 8192, 131072, _LLAMA32_SCALING, True),
}.items():
    for instruct in (False, True):
        full = name + ("-Instruct" if instruct else "")
        configs.append(
            _llama(
                "meta-llama",
                full,
                block_size=block,
                vocab_size=128256,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                n_query_groups=groups,
                intermediate_size=inter,
                norm_eps=1e-5,
                rope_base=500000.0,
                rope_scaling=deepcopy(scaling),
                tie_embeddings=tie,
            )
        )

# ------------------------------------------------------------------ TinyLlama
# https://huggingface.co/TinyLlama/TinyLlama-1.1B-Chat-v1.0/blob/main/config.json
for name in ("TinyLlama-1.1B-intermediate-step-1431k-3T", "TinyLlama-1.1B-Chat-v1.0"):
    configs.append(
        _llama(
            "TinyLlama",
            name,
            block_size=2048,
            vocab_size=32000,
            n_layer=22,
            n_head=32,
            n_embd=2048,
            n_query_groups=4,
            intermediate_size=5632,
            norm_eps=1e-5,
        )
    )

# ------------------------------------------------------------------ SmolLM2
# https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json
for size, (n_layer, n_head, n_embd, groups, inter, theta) in {
    "135M": (30, 9, 576, 3, 1536, 100000.0),
    "360M": (32, 15, 960, 5, 2560, 100000.0),
    "1.7B": (24, 32, 2048, 32, 8192, 130000.0),
}.items():
    for suffix in ("", "-Instruct"):
        configs.append(
            _llama(
                "HuggingFaceTB",
                f"SmolLM2-{size}{suffix}",
                block_size=8192,
                vocab_size=49152,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                n_query_groups=groups,
                intermediate_size=inter,
                norm_eps=1e-5,
                rope_base=theta,
                tie_embeddings=True,
            )
        )

# ------------------------------------------------------------------ Mistral
# https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
# https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.2/blob/main/config.json
# https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json
for name, (vocab, block, window, theta) in {
    "Mistral-7B-v0.1": (32000, 32768, 4096, 10000.0),
    "Mistral-7B-Instruct-v0.1": (32000, 32768, 4096, 10000.0),
    "Mistral-7B-Instruct-v0.2": (32000, 32768, None, 1000000.0),
    "Mistral-7B-v0.3": (32768, 32768, None, 1000000.0),
    "Mistral-7B-Instruct-v0.3": (32768, 32768, None, 1000000.0),
}.items():
    configs.append(
        _llama(
            "mistralai",
            name,
            block_size=block,
            vocab_size=vocab,
            n_layer=32,
            n_head=32,
            n_embd=4096,
            n_query_groups=8,
            intermediate_size=14336,
            norm_eps=1e-5,
            rope_base=theta,
            sliding_window_size=window,
        )
    )

# ------------------------------------------------------------------ Pythia
# https://huggingface.co/EleutherAI/pythia-70m/blob/main/config.json
for size, (n_layer, n_head, n_embd, vocab) in {
    "70m": (6, 8, 512, 50304),
    "160m": (12, 12, 768, 50304),
    "410m": (24, 16, 1024, 50304),
    "1b": (16, 8, 2048, 50304),
    "1.4b": (24, 16, 2048, 50304),
    "2.8b": (32, 32, 2560, 50304),
    "6.9b": (32, 32, 4096, 50432),
    "12b": (36, 40, 5120, 50688),
}.items():
    for dedup in ("", "-deduped"):
        configs.append(
            dict(
                name=f"pythia-{size}{dedup}",
                hf_config=dict(org="EleutherAI", name=f"pythia-{size}{dedup}"),
                block_size=2048,
                vocab_size=vocab,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                rotary_percentage=0.25,
                parallel_residual=True,
                bias=True,
                norm_class_name="LayerNorm",
                mlp_class_name="GptNeoxMLP",
            )
        )

# ------------------------------------------------------------------ StableLM
# https://huggingface.co/stabilityai/stablelm-base-alpha-3b/blob/main/config.json  (gpt_neox)
for size, (n_layer, n_embd) in {"3b": (16, 4096), "7b": (16, 6144)}.items():
    configs.append(
        dict(
            name=f"stablelm-base-alpha-{size}",
            hf_config=dict(org="stabilityai", name=f"stablelm-base-alpha-{size}"),
            block_size=4096,
            vocab_size=50688,
            n_layer=n_layer,
            n_head=32 if size == "3b" else 48,
            n_embd=n_embd,
            rotary_percentage=0.25,
            parallel_residual=True,
            bias=True,
            norm_class_name="LayerNorm",
            mlp_class_name="GptNeoxMLP",
        )
    )
# https://huggingface.co/stabilityai/stablelm-2-1_6b/blob/main/config.json
# https://huggingface.co/stabilityai/stablelm-zephyr-3b/blob/main/config.json
for name, (n_layer, n_head, n_embd, inter, vocab, qkv_bias) in {
    "stablelm-2-1_6b": (24, 32, 2048, 5632, 100352, True),
    "stablelm-2-zephyr-1_6b": (24, 32, 2048, 5632, 100352, True),
    "stablelm-zephyr-3b": (32, 32, 2560, 6912, 50304, False),
    "stablelm-3b-4e1t": (32, 32, 2560, 6912, 50304, False),
}.items():
    configs.append(
        dict(
            name=name,
            hf_config=dict(org="stabilityai", name=name),
            block_size=4096,
            vocab_size=vocab,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            rotary_percentage=0.25,
            attn_bias=qkv_bias,
            norm_class_name="LayerNorm",
            mlp_class_name="LLaMAMLP",
            intermediate_size=inter,
        )
    )

# ------------------------------------------------------------------ Falcon
# https://huggingface.co/tiiuae/falcon-7b/blob/main/config.json  (multi-query, one shared norm)
# https://huggingface.co/tiiuae/falcon-40b/blob/main/config.json  (new decoder architecture)
for kind in ("", "-instruct"):
    configs.append(
        dict(
            name=f"falcon-7b{kind}",
            hf_config=dict(org="tiiuae", name=f"falcon-7b{kind}"),
            block_size=2048,
            vocab_size=65024,
            n_layer=32,
            n_head=71,
            n_embd=4544,
            n_query_groups=1,
            parallel_residual=True,
            shared_attention_norm=True,
            bias=False,
            tie_embeddings=True,
            norm_class_name="LayerNorm",
            mlp_class_name="GptNeoxMLP",
        )
    )
    configs.append(
        dict(
            name=f"falcon-40b{kind}",
            hf_config=dict(org="tiiuae", name=f"falcon-40b{kind}"),
            block_size=2048,
            vocab_size=65024,
            n_layer=60,
            n_head=128,
            n_embd=8192,
            n_query_groups=8,
            parallel_residual=True,
            shared_attention_norm=False,
            bias=False,
            tie_embeddings=True,
            norm_class_name="LayerNorm",
            mlp_class_name="GptNeoxMLP",
        )
    )

# ------------------------------------------------------------------ Phi
# https://huggingface.co/microsoft/phi-1_5/blob/main/config.json
# https://huggingface.co/microsoft/phi-2/blob/main/config.json
for name, (n_layer, n_head, n_embd, rot) in {"phi-1_5": (24, 32, 2048, 0.5), "phi-2": (32, 32, 2560, 0.4)}.items():
    configs.append(
        dict(
            name=name,
            hf_config=dict(org="microsoft", name=name),
            block_size=2048,
            vocab_size=51200,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            rotary_percentage=rot,
            parallel_residual=True,
            shared_attention_norm=True,
            bias=True,
            lm_head_bias=True,
            norm_class_name="LayerNorm",
            mlp_class_name="GptNeoxMLP",
            gelu_approximate="tanh",
            intermediate_size=4 * n_embd,
        )
    )

# ------------------------------------------------------------------ Gemma
# https://huggingface.co/google/gemma-2b/blob/main/config.json
# https://huggingface.co/google/gemma-7b/blob/main/config.json
for size, (n_layer, n_head, n_embd, groups, inter) in {
    "2b": (18, 8, 2048, 1, 16384),
    "7b": (28, 16, 3072, 16, 24576),
}.items():
    for it in ("", "-it"):
        configs.append(
            dict(
                name=f"gemma-{size}{it}",
                hf_config=dict(org="google", name=f"gemma-{size}{it}"),
                block_size=8192,
                vocab_size=256000,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                head_size=256,
                n_query_groups=groups,
                norm_class_name="RMSNorm",
                norm_eps=1e-6,
                norm_unit_offset=True,
                mlp_class_name="GemmaMLP",
                gelu_approximate="tanh",
                intermediate_size=inter,
                scale_embeddings=True,
                tie_embeddings=True,
            )
        )

# ------------------------------------------------------------------ Qwen2.5
# https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
for size, (n_layer, n_head, n_embd, groups, inter, vocab, tie) in {
    "0.5B": (24, 14, 896, 2, 4864, 151936, True),
    "1.5B": (28, 12, 1536, 2, 8960, 151936, True),
    "3B": (36, 16, 2048, 2, 11008, 151936, True),
    "7B": (28, 28, 3584, 4, 18944, 152064, False),
}.items():
    for instruct in ("", "-Instruct"):
        configs.append(
            _llama(
                "Qwen",
                f"Qwen2.5-{size}{instruct}",
                block_size=32768,
                vocab_size=vocab,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                n_query_groups=groups,
                intermediate_size=inter,
                norm_eps=1e-6,
                rope_base=1000000.0,
                attn_bias=True,
                tie_embeddings=tie,
            )
        )

# ------------------------------------------------------------------ Qwen3
# https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json (1.7B, 4B, 8B, 14B, 32B alike; no 32B base model)
for size, (n_layer, n_head, n_embd, inter, tie) in {
    "0.6B": (28, 16, 1024, 3072, True),
    "1.7B": (28, 16, 2048, 6144, True),
    "4B": (36, 32, 2560, 9728, True),
    "8B": (36, 32, 4096, 12288, False),
    "14B": (40, 40, 5120, 17408, False),
    "32B": (64, 64, 5120, 25600, False),
}.items():
    for suffix in ("", "-Base") if size != "32B" else ("",):
        configs.append(
            _llama(
                "Qwen",
                f"Qwen3-{size}{suffix}",
                hf_model_type="qwen3",
                block_size=40960,
                vocab_size=151936,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                head_size=128,
                n_query_groups=8,
                intermediate_size=inter,
                norm_eps=1e-6,
                rope_base=1000000.0,
                norm_qk="per_head",
                tie_embeddings=tie,
            )
        )


def _every_nth_global(n_layer: int, n: int) -> List[str]:
    """Gemma's layer pattern: each n-th layer attends globally, the others through the sliding window."""
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(n_layer)]


def _gemma2(org: str, name: str, n_layer: int, pattern: int, **kw: Any) -> Dict[str, Any]:
    return dict(
        name=name,
        hf_config=dict(org=org, name=name),
        norm_class_name="RMSNorm",
        norm_eps=1e-6,
        norm_unit_offset=True,
        mlp_class_name="GemmaMLP",
        gelu_approximate="tanh",
        scale_embeddings=True,
        tie_embeddings=True,
        post_attention_norm=True,
        post_mlp_norm=True,
        n_layer=n_layer,
        layer_types=_every_nth_global(n_layer, pattern),
        **kw,
    )


# ------------------------------------------------------------------ Gemma 2
# https://huggingface.co/google/gemma-2-2b/blob/main/config.json (9b, 27b alike)
for size, (n_layer, n_head, n_embd, groups, head, inter, scalar) in {
    "2b": (26, 8, 2304, 4, 256, 9216, 256),
    "9b": (42, 16, 3584, 8, 256, 14336, 256),
    "27b": (46, 32, 4608, 16, 128, 36864, 144),
}.items():
    for it in ("", "-it"):
        configs.append(
            _gemma2(
                "google",
                f"gemma-2-{size}{it}",
                n_layer,
                2,
                hf_model_type="gemma2",
                block_size=8192,
                vocab_size=256000,
                n_head=n_head,
                n_embd=n_embd,
                head_size=head,
                n_query_groups=groups,
                intermediate_size=inter,
                attention_scores_scalar=scalar,
                attention_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                sliding_window_size=4096,
            )
        )

# ------------------------------------------------------------------ Gemma 3
# https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json (text only)
# https://huggingface.co/google/gemma-3-4b-it/blob/main/config.json (12b, 27b alike: the text_config of a
# multimodal model, whose vision tower the converter leaves out)
for size, (n_layer, n_head, n_embd, groups, head, inter, scalar, vocab, block, window, scaling) in {
    "1b": (26, 4, 1152, 1, 256, 6912, 256, 262144, 32768, 512, None),
    "4b": (34, 8, 2560, 4, 256, 10240, 256, 262208, 131072, 1024, {"type": "linear", "factor": 8.0}),
    "12b": (48, 16, 3840, 8, 256, 15360, 256, 262208, 131072, 1024, {"type": "linear", "factor": 8.0}),
    "27b": (62, 32, 5376, 16, 128, 21504, 168, 262208, 131072, 1024, {"type": "linear", "factor": 8.0}),
}.items():
    for it in ("-pt", "-it"):
        configs.append(
            _gemma2(
                "google",
                f"gemma-3-{size}{it}",
                n_layer,
                6,
                hf_model_type="gemma3_text",
                block_size=block,
                vocab_size=vocab,
                n_head=n_head,
                n_embd=n_embd,
                head_size=head,
                n_query_groups=groups,
                intermediate_size=inter,
                attention_scores_scalar=scalar,
                sliding_window_size=window,
                norm_qk="per_head",
                rope_base=1000000.0,
                rope_local_base=10000.0,
                rope_scaling=deepcopy(scaling),
            )
        )

# ------------------------------------------------------------------ Phi-3.5 / Phi-4
# https://huggingface.co/microsoft/Phi-3.5-mini-instruct/blob/main/config.json
# https://huggingface.co/microsoft/Phi-4-mini-instruct/blob/main/config.json
# https://huggingface.co/microsoft/phi-4/blob/main/config.json
# (Phi-3.5 and Phi-4-mini's sliding_window 262144 exceeds their context: no window)
_PHI35_LONG = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
]
_PHI35_SHORT = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533,
]
_PHI4_MINI_LONG = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23,
    32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]
for name, (n_layer, n_head, n_embd, groups, inter, vocab, block, theta, partial, tie, scaling) in {
    "Phi-3.5-mini-instruct": (
        32, 32, 3072, 32, 8192, 32064, 131072, 10000.0, 1.0, False,
        dict(type="longrope", short_factor=_PHI35_SHORT, long_factor=_PHI35_LONG, original_max_seq_len=4096,
             factor=32.0),
    ),
    "Phi-4-mini-instruct": (
        32, 24, 3072, 8, 8192, 200064, 131072, 10000.0, 0.75, True,
        dict(type="longrope", short_factor=[1.0] * 48, long_factor=_PHI4_MINI_LONG, original_max_seq_len=4096,
             factor=32.0),
    ),
    "phi-4": (40, 40, 5120, 10, 17920, 100352, 16384, 250000.0, 1.0, False, None),
}.items():
    configs.append(
        _llama(
            "microsoft",
            name,
            hf_model_type="phi3",
            block_size=block,
            vocab_size=vocab,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            n_query_groups=groups,
            intermediate_size=inter,
            norm_eps=1e-5,
            rope_base=theta,
            rotary_percentage=partial,
            rope_scaling=deepcopy(scaling),
            tie_embeddings=tie,
        )
    )

# ------------------------------------------------------------------ OLMo 2
# https://huggingface.co/allenai/OLMo-2-0425-1B/blob/main/config.json
# https://huggingface.co/allenai/OLMo-2-1124-7B/blob/main/config.json (13B alike)
for name, (n_layer, n_head, n_embd, inter, variants) in {
    "OLMo-2-0425-1B": (16, 16, 2048, 8192, ("", "-SFT", "-DPO", "-Instruct")),
    "OLMo-2-1124-7B": (32, 32, 4096, 11008, ("", "-SFT", "-DPO", "-Instruct")),
    "OLMo-2-1124-13B": (40, 40, 5120, 13824, ("", "-SFT", "-DPO", "-Instruct")),
}.items():
    for variant in variants:
        configs.append(
            _llama(
                "allenai",
                f"{name}{variant}",
                hf_model_type="olmo2",
                block_size=4096,
                vocab_size=100352,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                intermediate_size=inter,
                norm_eps=1e-6,
                rope_base=500000.0,
                norm_qk="all_heads",
                pre_norm=False,
                post_attention_norm=True,
                post_mlp_norm=True,
                norm_float_weight=True,
            )
        )

# ------------------------------------------------------------------ SmolLM3
# https://huggingface.co/HuggingFaceTB/SmolLM3-3B/blob/main/config.json (every 4th layer without RoPE)
for name in ("SmolLM3-3B", "SmolLM3-3B-Base"):
    configs.append(
        _llama(
            "HuggingFaceTB",
            name,
            hf_model_type="smollm3",
            block_size=65536,
            vocab_size=128256,
            n_layer=36,
            n_head=16,
            n_embd=2048,
            n_query_groups=4,
            intermediate_size=11008,
            norm_eps=1e-6,
            rope_base=5000000.0,
            layers_without_rope=[i for i in range(36) if (i + 1) % 4 == 0],
            tie_embeddings=True,
        )
    )

# ------------------------------------------------------------------ Mixtral (mixture of experts)
# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (Instruct alike). The MoE entries below
# equal `Config.from_hf_config` of their Hub config.json (tests/test_moe_parity.py HUB_CONFIGS)
for name in ("Mixtral-8x7B-v0.1", "Mixtral-8x7B-Instruct-v0.1"):
    configs.append(
        _llama(
            "mistralai",
            name,
            hf_model_type="mixtral",
            block_size=32768,
            vocab_size=32000,
            n_layer=32,
            n_head=32,
            n_embd=4096,
            n_query_groups=8,
            intermediate_size=14336,
            norm_eps=1e-5,
            rope_base=1000000.0,
            n_expert=8,
            n_expert_per_token=2,
            router_aux_loss_coef=0.02,
        )
    )

# ------------------------------------------------------------------ Qwen3-MoE
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
# https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
for name, (n_layer, n_head, n_embd, inter, moe_inter) in {
    "Qwen3-30B-A3B": (48, 32, 2048, 6144, 768),
    "Qwen3-235B-A22B": (94, 64, 4096, 12288, 1536),
}.items():
    configs.append(
        _llama(
            "Qwen",
            name,
            hf_model_type="qwen3_moe",
            block_size=40960,
            vocab_size=151936,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            head_size=128,
            n_query_groups=4,
            intermediate_size=inter,
            norm_eps=1e-6,
            rope_base=1000000.0,
            norm_qk="per_head",
            n_expert=128,
            n_expert_per_token=8,
            moe_intermediate_size=moe_inter,
            moe_norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        )
    )

# ------------------------------------------------------------------ gpt-oss
# https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json (120b alike); the Hub's experts are MXFP4, which
# the converter dequantizes (lit_gpt.mxfp4)
for name, (n_layer, n_expert) in {"gpt-oss-20b": (24, 32), "gpt-oss-120b": (36, 128)}.items():
    configs.append(
        _llama(
            "openai",
            name,
            hf_model_type="gpt_oss",
            block_size=131072,
            vocab_size=201088,
            n_layer=n_layer,
            n_head=64,
            n_embd=2880,
            head_size=64,
            n_query_groups=8,
            intermediate_size=2880,
            norm_eps=1e-5,
            norm_float_weight=True,
            bias=True,
            attention_sinks=True,
            sliding_window_size=128,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)],
            rope_base=150000.0,
            rope_scaling=dict(type="yarn", factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0,
                              truncate=False),
            n_expert=n_expert,
            n_expert_per_token=4,
            moe_routing="topk_softmax",
            moe_bias=True,
            moe_activation="clamped_swiglu",
            swiglu_limit=7.0,
            swiglu_alpha=1.702,
            router_aux_loss_coef=0.9,
        )
    )
