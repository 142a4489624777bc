"""Hugging Face `config.json` -> the fields of a lit `Config`, for every model type the model implements
(`HF_MODEL_TYPES`); what it does not implement is refused with a ValueError that names the field. The way back,
a config.json that transformers loads, is `lit_gpt.hf_write`."""

from typing import Any, Dict, Optional, Tuple

# the HF model types `from_hf_config` reads
HF_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "phi3", "gemma", "gemma2", "gemma3_text", "gemma3",
    "gpt_neox", "falcon", "phi", "stablelm", "mixtral", "qwen3_moe", "gpt_oss",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
# the keys each rope_scaling type needs (the others are optional: yarn's beta_fast, beta_slow, attention_factor,
# truncate; longrope's attention_factor)
ROPE_SCALING_KEYS: Dict[str, Tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_seq_len"),
    "longrope": ("short_factor", "long_factor", "original_max_seq_len"),
}

# the keys of config.json's rope scaling dict that each type reads (ROPE_SCALING_KEYS are ours, converted from these)
_HF_SCALING_KEYS: Dict[str, Tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


def _scaling(hf: Dict[str, Any], scaling: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """An HF rope scaling dict -> ours ("type" plus the keys `ROPE_SCALING_KEYS` names); unknown types refused."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    # a type without the values it needs (a hand-edited or truncated config.json): named, not a KeyError
    missing = [key for key in _HF_SCALING_KEYS.get(kind, ()) if scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope scaling {kind!r} (rope_scaling / rope_parameters) lacks {', '.join(missing)}: the"
                         " config.json is incomplete; download it again or add the value(s)")
    # Phi-3 keeps the pretraining length at the top level, and transformers gives that one priority
    old_ctx = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    old_ctx = old_ctx or hf.get("max_position_embeddings")
    if kind in ("yarn", "longrope") and not old_ctx:
        raise ValueError(f"rope scaling {kind!r} needs original_max_position_embeddings (or max_position_embeddings)")
    if kind == "llama3":  # the default type: written without "type", as configs were before other types
        return {
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_seq_len": int(scaling["original_max_position_embeddings"]),
        }
    if kind == "linear":
        return {"type": "linear", "factor": float(scaling["factor"])}
    if kind == "yarn":
        out = {"type": "yarn", "factor": float(scaling["factor"]), "original_max_seq_len": int(old_ctx)}
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"):
            if scaling.get(key) is not None:
                out[key] = scaling[key]
        return out
    if kind == "longrope":
        out = {
            "type": "longrope",
            "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]],
            "original_max_seq_len": int(old_ctx),
        }
        for key in ("factor", "attention_factor"):
            if scaling.get(key) is not None:
                out[key] = float(scaling[key])
        # transformers derives the factor (and from it the attention factor) from the context lengths: kept here,
        # so that a shorter block_size for a run does not change it
        out.setdefault("factor", hf.get("max_position_embeddings", old_ctx) / int(old_ctx))
        return out
    raise ValueError(
        f"Unsupported rope scaling {kind!r} (rope_scaling / rope_parameters.rope_type): implemented are"
        f" {', '.join(ROPE_SCALING_KEYS)}"
    )


def _rope_params(hf: Dict[str, Any], per_layer_rope: bool = False) -> Dict[str, Any]:
    """Rope theta and scaling, whether stored at the top level (transformers 4.x), under rope_parameters (5.x),
    or per layer type under rope_parameters (5.x Gemma 3: full_attention / sliding_attention). `per_layer_rope`
    (Gemma 3): the sliding layers always get a table of their own, unscaled, even where both bases are equal."""
    params = hf.get("rope_parameters") or {}
    local_theta = hf.get("rope_local_base_freq")  # Gemma 3 configs of transformers 4.x
    if set(params) & set(LAYER_TYPES):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        if _scaling(hf, local):
            raise ValueError("RoPE scaling on the sliding_attention layers is not implemented")
        theta = full.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = _scaling(hf, full)
        local_theta = local.get("rope_theta", local_theta)
    else:
        theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
        scaling = _scaling(hf, hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default"
                                                         else None))
    out: Dict[str, Any] = {"rope_base": float(theta)}
    if scaling:
        out["rope_scaling"] = scaling
    if per_layer_rope or (local_theta is not None and float(local_theta) != float(theta)):
        out["rope_local_base"] = float(theta if local_theta is None else local_theta)
    return out


def _layer_types(hf: Dict[str, Any], default_pattern: Optional[int] = None, keep_kinds: bool = False) -> Dict[str, Any]:
    """`layer_types` and `sliding_window_size` from a config.json: its own `layer_types` (transformers 5), else the
    family's pattern (`default_pattern`: every n-th layer is global, Gemma 2: 2, Gemma 3: 6), else Qwen's
    `max_window_layers`, else the window on every layer.
    Collapsed where the window changes nothing (all layers alike, or a window no position can exceed), unless
    `keep_kinds` (Gemma 3: the sliding layers differ by their RoPE table too)."""
    window = hf.get("sliding_window")
    n_layer = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", default_pattern))
        if pattern:
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
        elif hf.get("use_sliding_window"):  # Qwen2/3 spelling of transformers 4.x: layers from max_window_layers
            first = hf.get("max_window_layers", 0)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
        else:  # Mistral, Phi-3: the window, if any, on every layer
            types = ["sliding_attention" if window else "full_attention"] * n_layer
    types = list(types)
    if window is None and "sliding_attention" in types:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    if window is None or (window >= hf.get("max_position_embeddings", float("inf")) and not keep_kinds):
        types = ["full_attention" if t == "sliding_attention" else t for t in types]
    if all(t == "full_attention" for t in types):
        return {}
    if all(t == "sliding_attention" for t in types):
        return {"sliding_window_size": int(window)}
    return {"sliding_window_size": int(window), "layer_types": types}


def _partial_rotary(hf: Dict[str, Any], legacy_key: str, default: float) -> float:
    """Fraction of head dims with RoPE: top level in transformers 4.x configs, under rope_parameters in 5.x."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get(legacy_key, params.get("partial_rotary_factor", default)))


# What transformers' config classes assume for keys a config.json leaves out (checked against transformers 5.24).
# The Hub's Gemma 3 4B-27B folders rely on them most: their `text_config` lists a handful of keys only.
_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6,
        rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
        final_logit_softcapping=None, attn_logit_softcapping=None,
    ),
    "gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
        query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "qwen3": dict(head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6, max_window_layers=28,
                  tie_word_embeddings=False),
    "smollm3": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=2000000.0, tie_word_embeddings=True,
                    no_rope_layer_interval=4),
    "olmo2": dict(max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "phi3": dict(max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    # the mixtures of experts (MixtralConfig, Qwen3MoeConfig, GptOssConfig; rope_theta: their default_theta)
    "mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e6,
        tie_word_embeddings=False, sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.001, router_jitter_noise=0.0,
    ),
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
        num_local_experts=128, num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.001,
        mlp_only_layers=[],
    ),
    "gpt_oss": dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
        tie_word_embeddings=False, sliding_window=128, num_local_experts=128, num_experts_per_tok=4,
        swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.001, attention_bias=True,
    ),
}
# gpt-oss's RoPE when its config.json names none (GptOssConfig.__post_init__)
_GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)
# quantized checkpoints the converter reads: gpt-oss's MXFP4 experts, kept packed (lit_gpt.mxfp4)
QUANTIZATIONS = {"gpt_oss": ("mxfp4",)}


def _check_quantization(hf: Dict[str, Any]) -> None:
    """Refuse a quantized checkpoint the converter cannot dequantize (its weights would not load)."""
    q = hf.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in QUANTIZATIONS.get(hf.get("model_type"), ()):
        raise ValueError(
            f"quantization_config quant_method {method!r} is not implemented for {hf.get('model_type')!r} (only"
            " gpt-oss's mxfp4 experts, which every loader decodes): download the unquantized (bf16) weights"
        )


def from_hf_config(hf: Dict[str, Any]) -> Dict[str, Any]:
    """The `Config` fields of a config.json dict (ValueError, naming the field, for what the model cannot run)."""
    _check_quantization(hf)
    mt = hf.get("model_type")
    if mt == "gemma3":  # the multimodal folder: its text tower (the converter says the vision tower is left out)
        text = dict(hf.get("text_config") or {})
        if "tie_word_embeddings" in hf:
            text.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
        text["model_type"] = "gemma3_text"
        return from_hf_config(text)
    if mt in ("mixtral", "qwen3_moe", "gpt_oss") and "num_local_experts" not in hf and "num_experts" in hf:
        hf = dict(hf, num_local_experts=hf["num_experts"])  # the Hub's Qwen3-MoE spelling (an alias in all three)
    if mt in _DEFAULTS:  # keys left out mean transformers' defaults (present keys, None included, stay)
        hf = {**_DEFAULTS[mt], **hf}
    hidden = hf.get("hidden_size")
    common = dict(
        block_size=hf.get("max_position_embeddings", 4096),
        vocab_size=hf["vocab_size"],
        n_layer=hf.get("num_hidden_layers"),
        n_head=hf.get("num_attention_heads"),
        n_embd=hidden,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if mt in ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "phi3"):
        return _llama_family(hf, common)
    if mt in ("gemma", "gemma2", "gemma3_text"):
        return _gemma_family(hf, common)
    if mt in ("mixtral", "qwen3_moe", "gpt_oss"):
        return _moe_family(hf, common)
    if mt == "gpt_neox":
        act = hf.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"Unsupported hidden_act {act!r} for gpt_neox")
        if not hf.get("attention_bias", True):
            # the MLP and norms keep their biases in HF, which one `bias` flag cannot express
            raise ValueError("gpt_neox with attention_bias=false is not supported")
        return dict(
            common,
            rotary_percentage=_partial_rotary(hf, "rotary_pct", 0.25),
            parallel_residual=bool(hf.get("use_parallel_residual", True)),
            bias=True,
            lm_head_bias=False,
            norm_class_name="LayerNorm",
            norm_eps=hf.get("layer_norm_eps", 1e-5),
            mlp_class_name="GptNeoxMLP",
            gelu_approximate="none" if act == "gelu" else "tanh",
            intermediate_size=hf.get("intermediate_size") or 4 * hidden,
            **_rope_params(hf),
        )
    if mt == "falcon":
        n_head = hf.get("num_attention_heads", hf.get("n_head"))
        new_arch = bool(hf.get("new_decoder_architecture", False))
        if new_arch:
            groups = hf.get("num_kv_heads") or hf.get("n_head_kv") or n_head  # n_head_kv: pre-2023 Falcon configs
        else:
            groups = 1 if hf.get("multi_query", True) else n_head
        if hf.get("alibi"):
            raise ValueError("Falcon with alibi is not supported")
        if hf.get("activation", "gelu") != "gelu":
            raise ValueError(f"Unsupported activation {hf.get('activation')!r} for falcon")
        parallel = bool(hf.get("parallel_attn", True))
        # HF Falcon: the new architecture defaults to two norms (ln_attn, ln_mlp) unless num_ln_in_parallel_attn=1;
        # the old one shares input_layernorm when parallel and has a post-attention norm when sequential
        if new_arch:
            shared_norm = hf.get("num_ln_in_parallel_attn") == 1
        else:
            shared_norm = parallel
        return dict(
            common,
            n_layer=hf.get("num_hidden_layers", hf.get("n_layer")),
            n_head=n_head,
            block_size=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            n_query_groups=groups,
            parallel_residual=parallel or new_arch,
            shared_attention_norm=shared_norm,
            bias=bool(hf.get("bias", False)),
            norm_class_name="LayerNorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            mlp_class_name="GptNeoxMLP",
            intermediate_size=hf.get("ffn_hidden_size") or 4 * hidden,
            **_rope_params(hf),
        )
    if mt == "phi":
        head = hidden // hf["num_attention_heads"]
        if hf.get("qk_layernorm"):
            raise ValueError("Phi with qk_layernorm=true is not supported")
        return dict(
            common,
            n_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            rotary_percentage=_partial_rotary(hf, "partial_rotary_factor", 0.5),
            parallel_residual=True,
            shared_attention_norm=True,
            bias=True,
            lm_head_bias=True,
            norm_class_name="LayerNorm",
            norm_eps=hf.get("layer_norm_eps", 1e-5),
            mlp_class_name="GptNeoxMLP",
            gelu_approximate="tanh",
            intermediate_size=hf["intermediate_size"],
            head_size=head,
            **_rope_params(hf),
        )
    if mt == "stablelm":
        if hf.get("qk_layernorm"):
            raise ValueError("StableLM with qk_layernorm=true is not supported")
        return dict(
            common,
            n_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            rotary_percentage=_partial_rotary(hf, "partial_rotary_factor", 0.25),
            parallel_residual=bool(hf.get("use_parallel_residual", False)),
            shared_attention_norm=bool(hf.get("use_parallel_residual", False)),
            attn_bias=bool(hf.get("use_qkv_bias", False)),
            norm_class_name="LayerNorm",
            norm_eps=hf.get("layer_norm_eps", 1e-5),
            mlp_class_name="LLaMAMLP",
            intermediate_size=hf["intermediate_size"],
            **_rope_params(hf),
        )
    raise ValueError(
        f"Unsupported model_type {mt!r}. Supported: {', '.join(HF_MODEL_TYPES)}"
    )


def _llama_family(hf: Dict[str, Any], common: Dict[str, Any]) -> Dict[str, Any]:
    """Llama, and Mistral, Qwen2/3, SmolLM3, OLMo 2 and Phi-3/4: Llama's layout with one or two features on."""
    mt = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Unsupported hidden_act {hf.get('hidden_act')!r} for {mt}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{mt} with attention_bias/mlp_bias is not supported")
    n_head = hf["num_attention_heads"]
    conf = dict(
        common,
        n_query_groups=hf.get("num_key_value_heads") or n_head,
        head_size=hf.get("head_dim") or common["n_embd"] // n_head,
        norm_class_name="RMSNorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp_class_name="LLaMAMLP",
        intermediate_size=hf["intermediate_size"],
        **_rope_params(hf),
    )
    if mt == "mistral" and hf.get("sliding_window"):
        conf["sliding_window_size"] = hf["sliding_window"]
    elif mt == "qwen2":
        conf["attn_bias"] = True  # Qwen2's q/k/v projections always have biases (no config key)
        if hf.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
    elif mt == "qwen3":
        conf["norm_qk"] = "per_head"
        if hf.get("use_sliding_window") or "layer_types" in hf:
            conf.update(_layer_types(hf))
    elif mt == "smollm3":
        # HF's no_rope_layers has one entry per layer: 1 = RoPE, 0 = none
        flags = hf.get("no_rope_layers")
        if flags is None:
            interval = hf.get("no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])]
        conf["layers_without_rope"] = [i for i, use_rope in enumerate(flags) if not use_rope]
        if hf.get("use_sliding_window") and hf.get("sliding_window") and not hf.get("layer_types"):
            # transformers' SmolLM3: the window on the layers without RoPE
            hf = dict(hf, layer_types=["full_attention" if r else "sliding_attention" for r in flags])
        if hf.get("use_sliding_window") or "layer_types" in hf:
            conf.update(_layer_types(hf))
    elif mt == "olmo2":
        conf.update(norm_qk="all_heads", pre_norm=False, post_attention_norm=True, post_mlp_norm=True,
                    norm_float_weight=True)
    elif mt == "phi3":
        conf["rotary_percentage"] = _partial_rotary(hf, "partial_rotary_factor", 1.0)
        conf.update(_layer_types(hf))
    return conf


def _gemma_family(hf: Dict[str, Any], common: Dict[str, Any]) -> Dict[str, Any]:
    """Gemma, and Gemma 2 and Gemma 3 (text): Gemma's layout, plus post norms, a per-layer sliding window,
    soft-capping (2), query-key norms and a local RoPE base (3)."""
    mt = hf["model_type"]
    conf = dict(
        common,
        tie_embeddings=True if mt == "gemma" else bool(hf.get("tie_word_embeddings", True)),
        n_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_size=hf["head_dim"],
        norm_class_name="RMSNorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_unit_offset=True,
        mlp_class_name="GemmaMLP",
        gelu_approximate="tanh",
        intermediate_size=hf["intermediate_size"],
        scale_embeddings=True,
        **_rope_params(hf, per_layer_rope=mt == "gemma3_text"),
    )
    if mt == "gemma":  # transformers runs tanh GELU whatever `hidden_act` says (old configs say "gelu")
        return conf
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Unsupported hidden_activation {act!r} for {mt}")
    if hf.get("attention_bias"):
        raise ValueError(f"{mt} with attention_bias is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{mt} with use_bidirectional_attention is not supported (a causal language model only)")
    gemma3 = mt == "gemma3_text"
    conf.update(
        post_attention_norm=True,
        post_mlp_norm=True,
        attention_scores_scalar=hf.get("query_pre_attn_scalar"),
        attention_logit_softcapping=hf.get("attn_logit_softcapping", None if gemma3 else 50.0),
        final_logit_softcapping=hf.get("final_logit_softcapping", None if gemma3 else 30.0),
        **_layer_types(hf, default_pattern=6 if gemma3 else 2, keep_kinds=gemma3),
    )
    if gemma3:
        conf["norm_qk"] = "per_head"
    return conf


def _moe_family(hf: Dict[str, Any], common: Dict[str, Any]) -> Dict[str, Any]:
    """The mixtures of experts (lit_gpt.moe): Mixtral, Qwen3-MoE (Llama's and Qwen3's attention) and gpt-oss.
    What changes their routing or activation and is not implemented is refused by name."""
    mt = hf["model_type"]
    act = hf.get("hidden_act", "silu")
    if act != "silu":  # gpt-oss: transformers runs its clamped SwiGLU whatever this says; "silu" is what it ships
        raise ValueError(f"Unsupported hidden_act {act!r} for {mt}")
    n_head = hf["num_attention_heads"]
    n_expert = hf["num_local_experts"]
    conf = dict(
        common,
        n_query_groups=hf.get("num_key_value_heads") or n_head,
        head_size=hf.get("head_dim") or common["n_embd"] // n_head,
        norm_class_name="RMSNorm",
        norm_eps=hf["rms_norm_eps"],
        mlp_class_name="LLaMAMLP",
        intermediate_size=hf["intermediate_size"],
        n_expert=int(n_expert or 0),
        n_expert_per_token=int(hf["num_experts_per_tok"]),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
    )
    if conf["n_expert"] and not 1 <= conf["n_expert_per_token"] <= conf["n_expert"]:
        raise ValueError(f"num_experts_per_tok {conf['n_expert_per_token']} must be in 1..{conf['n_expert']} (the"
                         " number of experts)")
    if mt == "mixtral":
        if hf.get("router_jitter_noise"):
            raise ValueError(
                f"mixtral router_jitter_noise {hf['router_jitter_noise']} is not implemented (it changes the"
                " routing in training); set it to 0"
            )
        conf.update(moe_norm_topk_prob=True, **_rope_params(hf))
        if hf.get("sliding_window") is not None and hf["sliding_window"] < conf["block_size"]:
            conf["sliding_window_size"] = int(hf["sliding_window"])  # on every layer, as in Mistral
        return conf
    if mt == "qwen3_moe":
        if hf.get("attention_bias"):
            raise ValueError("qwen3_moe with attention_bias is not supported")
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError("qwen3_moe with shared_expert_intermediate_size (a shared expert) is not implemented")
        conf.update(
            norm_qk="per_head",
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            moe_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            moe_dense_layers=sorted(int(i) for i in hf.get("mlp_only_layers") or []),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob")),
            **_rope_params(hf),
        )
        if not conf["n_expert"]:  # transformers: num_experts 0 means every layer dense
            conf.update(n_expert=0, n_expert_per_token=0, moe_intermediate_size=None, moe_dense_layers=[])
        window = hf.get("sliding_window")
        if hf.get("use_sliding_window") and window and window < conf["block_size"]:
            conf["sliding_window_size"] = int(window)  # transformers' Qwen3-MoE slides on every layer
        return conf
    # gpt_oss: biased attention (attention_bias) with sinks, alternating windows, YaRN; routed by the top k logits
    # of a biased router, then a softmax over them; biased experts with the clamped SwiGLU
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf = dict(hf, rope_parameters=dict(_GPT_OSS_ROPE, rope_theta=hf["rope_theta"]))
    conf.update(
        bias=bool(hf.get("attention_bias", True)),
        norm_float_weight=True,  # GptOssRMSNorm: weight * x in float32, then one rounding
        attention_sinks=True,
        moe_routing="topk_softmax",
        moe_bias=True,
        moe_activation="clamped_swiglu",
        swiglu_limit=float(hf["swiglu_limit"]),
        swiglu_alpha=float(hf["swiglu_alpha"]),
        **_rope_params(hf),
        **_layer_types(hf, default_pattern=2),
    )
    return conf
