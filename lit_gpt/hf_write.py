"""A lit config -> Hugging Face: which HF `model_type` it is, and the `config.json` that `transformers` loads for
it (`hf_config_dict`), refused in one line where the HF family cannot express the config. The way in is
`lit_gpt.hf_read`."""

from typing import Any, Dict, Optional, Tuple

from lit_gpt.config import Config
from lit_gpt.utils import LitError

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "phi3", "gemma", "gemma2", "gemma3_text", "gemma3",
    "stablelm", "phi", "gpt_neox", "falcon", "mixtral", "qwen3_moe", "gpt_oss",
)
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "gpt_oss")


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "phi": "PhiForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "falcon": "FalconForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def hf_model_type(config: Config) -> str:
    """The HF `model_type` of a config: the one it was read from, else derived from the architecture fields."""
    if config.hf_model_type:
        if config.hf_model_type not in SUPPORTED_MODEL_TYPES:
            raise LitError(
                f"unsupported model_type {config.hf_model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        return config.hf_model_type
    if config.n_expert:
        if config.moe_routing == "topk_softmax":
            return "gpt_oss"
        return "qwen3_moe" if config.norm_qk else "mixtral"
    if config.mlp_class_name == "GemmaMLP":
        if config.norm_qk or config.rope_local_base is not None:
            return "gemma3_text"
        return "gemma2" if config.post_attention_norm else "gemma"
    if config.mlp_class_name == "LLaMAMLP":
        if config.norm_class_name == "LayerNorm":
            return "stablelm"
        if not config.pre_norm:
            return "olmo2"
        if config.norm_qk:
            return "qwen3"
        if config.layers_without_rope:
            return "smollm3"
        if (config.rope_scaling or {}).get("type") == "longrope" or config.rotary_percentage < 1.0:
            return "phi3"
        if config.attn_bias:
            return "qwen2"
        if config.sliding_window_size is not None or config.name.lower().startswith("mistral"):
            return "mistral"
        return "llama"
    if config.lm_head_bias:
        return "phi"
    if config.bias and not config.shared_attention_norm:
        return "gpt_neox"
    return "falcon"


def _falcon_arch(config: Config) -> Tuple[bool, bool]:
    """(new_decoder_architecture, multi_query) of a Falcon config. Where two HF variants fit the same config
    (e.g. one shared norm), their weight layouts coincide, so the choice does not change the tensors."""
    groups = config.n_query_groups
    new_arch = 1 < groups < config.n_head or (config.parallel_residual and not config.shared_attention_norm)
    return new_arch, groups == 1


def _require(ok: bool, model_type: str, what: str) -> None:
    if not ok:
        raise LitError(f"this config cannot be exported as HF {model_type!r}: {what}")


def hf_rope_scaling(s: Dict[str, Any]) -> Dict[str, Any]:
    """Our rope_scaling dict in HF's spelling (the inverse of `lit_gpt.config._scaling`)."""
    kind = s.get("type", "llama3")
    if kind == "llama3":
        return {
            "rope_type": "llama3",
            "factor": s["factor"],
            "low_freq_factor": s["low_freq_factor"],
            "high_freq_factor": s["high_freq_factor"],
            "original_max_position_embeddings": s["original_max_seq_len"],
        }
    out = {"rope_type": kind, **{k: v for k, v in s.items() if k not in ("type", "original_max_seq_len")}}
    if "original_max_seq_len" in s:
        out["original_max_position_embeddings"] = s["original_max_seq_len"]
    return out


# families whose HF rotary embedding reads any scaling type (transformers' ROPE_INIT_FUNCTIONS)
_SCALING_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "phi3", "gemma2", "gemma3_text",
                     *MOE_MODEL_TYPES)


def _rope_fields(config: Config, partial_key: Optional[str], model_type: str) -> Dict[str, Any]:
    """RoPE settings in both spellings: top-level keys (transformers 4.x) and `rope_parameters` (5.x); Gemma 3's
    two bases nested by layer type (5.x) and as `rope_local_base_freq` (4.x)."""
    params: Dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base}
    out: Dict[str, Any] = {"rope_theta": config.rope_base, "rope_scaling": None}
    if config.rope_scaling:
        _require(model_type in _SCALING_FAMILIES, model_type, "rope scaling needs a llama-style or gemma 2/3 config")
        scaling = hf_rope_scaling(config.rope_scaling)
        params.update(scaling)
        out["rope_scaling"] = scaling
        if scaling["rope_type"] == "longrope":  # Phi-3 keeps it at the top level too, and transformers prefers it
            out["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    if partial_key is not None:
        params["partial_rotary_factor"] = config.rotary_percentage
        out[partial_key] = config.rotary_percentage
    else:
        _require(config.rotary_percentage == 1.0, model_type, "partial rotary embeddings")
    if model_type == "gemma3_text":
        local = config.rope_local_base if config.rope_local_base is not None else config.rope_base
        out["rope_local_base_freq"] = local
        out["rope_parameters"] = {
            "full_attention": params,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
        return out
    _require(config.rope_local_base is None, model_type, "a second RoPE base for sliding layers needs gemma3_text")
    out["rope_parameters"] = params
    return out


def _layer_type_fields(c: Config, model_type: str) -> Dict[str, Any]:
    """Sliding windows: one for all layers (Mistral, Phi-3) or chosen per layer (`layer_types`)."""
    per_layer = model_type in ("qwen3", "smollm3", "gemma2", "gemma3_text")
    if c.sliding_window_size is None:
        _require(c.layer_types is None, model_type, "layer_types without sliding_window_size")
        out: Dict[str, Any] = {"sliding_window": None}
        if per_layer:
            out["layer_types"] = ["full_attention"] * c.n_layer
            if model_type.startswith("gemma"):  # their configs compute with the window: one no position exceeds
                out["sliding_window"] = c.block_size
        return out
    if model_type in ("mistral", "phi3"):
        _require(c.layer_types is None, model_type, "a window on some layers only (layer_types)")
        return {"sliding_window": c.sliding_window_size}
    _require(per_layer, model_type, "sliding window attention needs mistral, phi3, qwen3, smollm3 or gemma 2/3")
    types = c.layer_types or ["sliding_attention"] * c.n_layer
    out = {"sliding_window": c.sliding_window_size, "layer_types": list(types)}
    if model_type in ("qwen3", "smollm3"):
        out["use_sliding_window"] = True
        out["max_window_layers"] = c.n_layer
    return out


# what each family of the newer layout has switched on (everything else must be off): the features of
# `Config` and their values
_FEATURES = (
    "norm_qk", "pre_norm", "post_attention_norm", "post_mlp_norm", "norm_unit_offset", "scale_embeddings",
    "norm_float_weight",
)
_FAMILY_FEATURES: Dict[str, Tuple[Any, ...]] = {
    "llama": (None, True, False, False, False, False, False),
    "mistral": (None, True, False, False, False, False, False),
    "qwen2": (None, True, False, False, False, False, False),
    "phi3": (None, True, False, False, False, False, False),
    "smollm3": (None, True, False, False, False, False, False),
    "qwen3": ("per_head", True, False, False, False, False, False),
    "olmo2": ("all_heads", False, True, True, False, False, True),
    "gemma": (None, True, False, False, True, True, False),
    "gemma2": (None, True, True, True, True, True, False),
    "gemma3_text": ("per_head", True, True, True, True, True, False),
}


def hf_config_dict(config: Config, model_type: Optional[str] = None) -> Dict[str, Any]:
    """The HF `config.json` contents for `config` (raises a LitError where the HF family cannot express it)."""
    mt = model_type or hf_model_type(config)
    c = config
    req = lambda ok, what: _require(ok, mt, what)  # noqa: E731
    hf: Dict[str, Any] = {
        "architectures": [_ARCHITECTURES[mt]],
        "model_type": mt,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "max_position_embeddings": c.block_size,
        "tie_word_embeddings": c.tie_embeddings,
    }
    if mt in MOE_MODEL_TYPES:
        return _moe_family(c, mt, hf)
    req(not c.n_expert and not c.attention_sinks, "mixtures of experts and attention sinks need mixtral, qwen3_moe"
        " or gpt_oss")
    if mt in _FAMILY_FEATURES:
        return _rms_family(c, mt, hf)
    _require_old_layout(c, mt)
    req(c.head_size * c.n_head == c.n_embd, "head_size must be n_embd // n_head")
    req(c.norm_class_name == "LayerNorm", "needs LayerNorm")
    if mt == "stablelm":
        req(c.mlp_class_name == "LLaMAMLP" and not c.bias and not c.lm_head_bias, "LLaMAMLP without biases")
        req(c.shared_attention_norm == c.parallel_residual, "parallel residual shares one norm")
        hf.update(
            num_key_value_heads=c.n_query_groups,
            intermediate_size=c.intermediate_size,
            layer_norm_eps=c.norm_eps,
            hidden_act="silu",
            use_qkv_bias=c.attn_bias,
            use_parallel_residual=c.parallel_residual,
            qk_layernorm=False,
            **_rope_fields(c, "partial_rotary_factor", mt),
        )
        return hf
    req(c.mlp_class_name == "GptNeoxMLP", "needs GptNeoxMLP")
    if mt == "phi":
        req(c.bias and c.lm_head_bias and c.parallel_residual and c.shared_attention_norm, "phi layout")
        req(c.gelu_approximate == "tanh" and not c.tie_embeddings, "tanh gelu, untied embeddings")
        hf.update(
            num_key_value_heads=c.n_query_groups,
            intermediate_size=c.intermediate_size,
            layer_norm_eps=c.norm_eps,
            hidden_act="gelu_new",
            qk_layernorm=False,
            **_rope_fields(c, "partial_rotary_factor", mt),
        )
        return hf
    if mt == "gpt_neox":
        req(c.bias and not c.lm_head_bias and not c.shared_attention_norm and not c.tie_embeddings, "gpt_neox layout")
        req(c.n_query_groups == c.n_head, "multi-head attention only")
        rope = _rope_fields(c, "rotary_pct", mt)
        rope["rotary_emb_base"] = rope.pop("rope_theta")
        hf.update(
            intermediate_size=c.intermediate_size,
            layer_norm_eps=c.norm_eps,
            hidden_act="gelu" if c.gelu_approximate == "none" else "gelu_pytorch_tanh",
            use_parallel_residual=c.parallel_residual,
            attention_bias=True,
            **rope,
        )
        return hf
    # falcon
    new_arch, multi_query = _falcon_arch(c)
    req(not c.lm_head_bias and not c.attn_bias and c.gelu_approximate == "none", "falcon layout")
    req(c.parallel_residual or not new_arch, "the new decoder architecture is parallel")
    hf.update(
        num_kv_heads=c.n_query_groups,
        multi_query=multi_query,
        new_decoder_architecture=new_arch,
        parallel_attn=c.parallel_residual,
        num_ln_in_parallel_attn=(1 if c.shared_attention_norm else 2) if new_arch else None,
        bias=c.bias,
        alibi=False,
        activation="gelu",
        ffn_hidden_size=c.intermediate_size,
        layer_norm_epsilon=c.norm_eps,
        **_rope_fields(c, None, mt),
    )
    return hf


def _rms_family(c: Config, mt: str, hf: Dict[str, Any]) -> Dict[str, Any]:
    """Llama's layout and its descendants (Mistral, Qwen2/3, SmolLM3, OLMo 2, Phi-3/4, Gemma 1-3)."""
    req = lambda ok, what: _require(ok, mt, what)  # noqa: E731
    req(c.norm_class_name == "RMSNorm", "needs RMSNorm")
    req(not c.bias and not c.lm_head_bias and not c.parallel_residual, "no biases, sequential residual")
    req(c.attn_bias == (mt == "qwen2"), "qkv bias exactly for qwen2")
    gemma = mt.startswith("gemma")
    req(c.mlp_class_name == ("GemmaMLP" if gemma else "LLaMAMLP"), "wrong MLP class")
    for feature, value in zip(_FEATURES, _FAMILY_FEATURES[mt]):
        req(getattr(c, feature) == value, f"{feature} must be {value!r} (it is {getattr(c, feature)!r})")
    req(not c.layers_without_rope or mt == "smollm3", "layers without RoPE need smollm3")
    softcap = c.attention_logit_softcapping is not None or c.final_logit_softcapping is not None
    req(not softcap or mt in ("gemma2", "gemma3_text"), "logit soft-capping needs gemma2 or gemma3_text")
    req(c.attention_scores_scalar is None or mt in ("gemma2", "gemma3_text"), "query_pre_attn_scalar needs gemma 2/3")
    hf.update(
        num_key_value_heads=c.n_query_groups,
        head_dim=c.head_size,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.norm_eps,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        attention_bias=False,
        **_rope_fields(c, "partial_rotary_factor" if mt == "phi3" else None, mt),
    )
    if mt in ("llama", "mistral", "smollm3"):
        hf["mlp_bias"] = False
    if gemma:
        req(c.gelu_approximate == "tanh", "gemma uses tanh gelu")
        req(c.tie_embeddings or mt != "gemma", "gemma ties embeddings")
        hf["hidden_activation"] = "gelu_pytorch_tanh"
    if mt in ("gemma2", "gemma3_text"):
        hf.update(
            query_pre_attn_scalar=c.attention_scores_scalar or c.head_size,  # the same scale as 1/sqrt(head_size)
            attn_logit_softcapping=c.attention_logit_softcapping,
            final_logit_softcapping=c.final_logit_softcapping,
        )
    if mt == "smollm3":
        hf["no_rope_layers"] = [int(i not in c.layers_without_rope) for i in range(c.n_layer)]
    if mt == "qwen2":
        req(c.sliding_window_size is None, "sliding window attention is not exported for qwen2")
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)
    elif mt in ("llama", "gemma", "olmo2"):
        req(c.sliding_window_size is None, "sliding window attention needs mistral, phi3, qwen3, smollm3 or gemma 2/3")
    else:
        hf.update(_layer_type_fields(c, mt))
    return hf


def _require_old_layout(c: Config, mt: str) -> None:
    """The families of LayerNorm and GELU MLPs (Pythia, StableLM, Phi-1/2, Falcon) have none of the newer features."""
    for feature, value in zip(_FEATURES, _FAMILY_FEATURES["llama"]):
        _require(getattr(c, feature) == value, mt, f"{feature} must be {value!r} (it is {getattr(c, feature)!r})")
    newer = (c.layers_without_rope, c.attention_scores_scalar, c.attention_logit_softcapping, c.final_logit_softcapping)
    _require(not any(x for x in newer), mt, "no layers without RoPE, scores scalar or soft-capping")
    _require(c.sliding_window_size is None, mt,
             "sliding window attention needs mistral, phi3, qwen3, smollm3 or gemma 2/3")


def _moe_family(c: Config, mt: str, hf: Dict[str, Any]) -> Dict[str, Any]:
    """Mixtral, Qwen3-MoE and gpt-oss (the inverse of `lit_gpt.hf_read._moe_family`)."""
    req = lambda ok, what: _require(ok, mt, what)  # noqa: E731
    gpt_oss = mt == "gpt_oss"
    req(c.n_expert > 0, "a mixture of experts (n_expert > 0)")
    req(c.norm_class_name == "RMSNorm" and c.mlp_class_name == "LLaMAMLP", "RMSNorm and LLaMAMLP")
    req(not c.lm_head_bias and not c.parallel_residual and not c.attn_bias, "no lm_head or qkv-only bias")
    req(gpt_oss or not c.bias, "biases on the attention only for gpt_oss")
    req(c.norm_qk == ("per_head" if mt == "qwen3_moe" else None), "q/k norms exactly for qwen3_moe")
    req(c.attention_sinks == gpt_oss and c.norm_float_weight == gpt_oss, "attention sinks and float norm weights"
        " exactly for gpt_oss")
    req(c.moe_routing == ("topk_softmax" if gpt_oss else "softmax_topk"), f"moe_routing {c.moe_routing!r}")
    req(c.moe_bias == gpt_oss, "router and expert biases exactly for gpt_oss")
    req(c.moe_activation == ("clamped_swiglu" if gpt_oss else "silu"), f"moe_activation {c.moe_activation!r}")
    req(mt == "qwen3_moe" or (c.moe_sparse_step == 1 and not c.moe_dense_layers), "every layer a mixture of experts")
    req(mt == "qwen3_moe" or c.moe_norm_topk_prob or gpt_oss, "renormalised top-k weights")
    for feature, value in zip(_FEATURES, _FAMILY_FEATURES["llama"]):
        if feature not in ("norm_qk", "norm_float_weight"):
            req(getattr(c, feature) == value, f"{feature} must be {value!r} (it is {getattr(c, feature)!r})")
    newer = (c.layers_without_rope, c.attention_scores_scalar, c.attention_logit_softcapping, c.final_logit_softcapping)
    req(not any(x for x in newer), "no layers without RoPE, scores scalar or soft-capping")
    hf.update(
        num_key_value_heads=c.n_query_groups,
        head_dim=c.head_size,
        rms_norm_eps=c.norm_eps,
        hidden_act="silu",
        num_experts_per_tok=c.n_expert_per_token,
        router_aux_loss_coef=c.router_aux_loss_coef,
        **_rope_fields(c, None, mt),
    )
    if mt == "mixtral":
        req(c.layer_types is None, "a window on some layers only (layer_types)")
        hf.update(intermediate_size=c.moe_intermediate_size, num_local_experts=c.n_expert, router_jitter_noise=0.0,
                  sliding_window=c.sliding_window_size)
    elif mt == "qwen3_moe":
        req(c.layer_types is None, "a window on some layers only (layer_types)")
        hf.update(
            intermediate_size=c.intermediate_size,
            moe_intermediate_size=c.moe_intermediate_size,
            num_experts=c.n_expert,
            norm_topk_prob=c.moe_norm_topk_prob,
            decoder_sparse_step=c.moe_sparse_step,
            mlp_only_layers=list(c.moe_dense_layers),
            attention_bias=False,
            use_sliding_window=c.sliding_window_size is not None,
            sliding_window=c.sliding_window_size,
            max_window_layers=c.n_layer,
        )
    else:
        window = c.sliding_window_size
        types = ["full_attention"] * c.n_layer if window is None else list(c.layer_types or
                                                                           ["sliding_attention"] * c.n_layer)
        hf.update(
            intermediate_size=c.moe_intermediate_size,
            num_local_experts=c.n_expert,
            attention_bias=c.bias,
            swiglu_limit=c.swiglu_limit,
            swiglu_alpha=c.swiglu_alpha,
            layer_types=types,
            sliding_window=window,
        )
    return hf
