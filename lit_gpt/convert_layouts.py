"""Where each family's Hugging Face tensors live in lit_gpt's state dict: the name layouts that
`lit_gpt.convert` uses in both directions, and the (un)fusing of attention projections.

Fused HF qkv layouts all fit one pattern: the rows form `n_groups` blocks of `q_per_kv` query heads followed by
one key head and one value head. GPT-NeoX and non-multi-query Falcon interleave per head (n_groups = n_head,
q_per_kv = 1), multi-query Falcon-7B stores [q heads, k, v] (n_groups = 1) and Falcon-40B's new decoder
architecture stores one block per KV group.
"""

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from lit_gpt.config import Config
from lit_gpt.hf_write import _falcon_arch


@dataclass(frozen=True)
class Layout:
    top: Dict[str, str]  # HF module -> lit module, outside the layers
    layers: str  # HF prefix of layer i is f"{layers}.{i}."
    layer: Dict[str, str]  # HF sub-module -> lit sub-module inside a layer
    qkv: Tuple[str, ...]  # HF q, k, v projections (three names) or the fused projection (one name)
    skip: Tuple[str, ...] = ()  # regexes of HF tensors that hold no weights (buffers some checkpoints carry)
    rename: Tuple[Tuple[str, str], ...] = ()  # (regex, replacement) applied to HF names before mapping (import)


_GATED_MLP = {"mlp.gate_proj": "mlp.fc_1", "mlp.up_proj": "mlp.fc_2", "mlp.down_proj": "mlp.proj"}
_LLAMA_LAYER = {
    "input_layernorm": "norm_1",
    "post_attention_layernorm": "norm_2",
    "self_attn.o_proj": "attn.proj",
    **_GATED_MLP,
}
_LLAMA = Layout(
    top={"model.embed_tokens": "transformer.wte", "model.norm": "transformer.ln_f", "lm_head": "lm_head"},
    layers="model.layers",
    layer=_LLAMA_LAYER,
    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    skip=(r"\.rotary_emb\.inv_freq$",),
)
_QK_NORMS = {"self_attn.q_norm": "attn.norm_q", "self_attn.k_norm": "attn.norm_k"}
_QWEN3 = Layout(
    top=_LLAMA.top, layers=_LLAMA.layers, layer={**_LLAMA_LAYER, **_QK_NORMS}, qkv=_LLAMA.qkv, skip=_LLAMA.skip
)
_OLMO2 = Layout(
    top=_LLAMA.top,
    layers=_LLAMA.layers,
    layer={
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_mlp_norm",
        "self_attn.o_proj": "attn.proj",
        **_GATED_MLP,
        **_QK_NORMS,
    },
    qkv=_LLAMA.qkv,
    skip=_LLAMA.skip,
)
_GEMMA2_LAYER = {
    "input_layernorm": "norm_1",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "norm_2",
    "post_feedforward_layernorm": "post_mlp_norm",
    "self_attn.o_proj": "attn.proj",
    **_GATED_MLP,
}
_GEMMA2 = Layout(top=_LLAMA.top, layers=_LLAMA.layers, layer=_GEMMA2_LAYER, qkv=_LLAMA.qkv, skip=_LLAMA.skip)
_GEMMA3 = Layout(
    top=_LLAMA.top,
    layers=_LLAMA.layers,
    layer={**_GEMMA2_LAYER, **_QK_NORMS},
    qkv=_LLAMA.qkv,
    # the multimodal checkpoint (model_type gemma3): its text tower under `language_model.model.` (Hub files) or
    # `model.language_model.` (transformers 5), and the vision tower and projector, which are left out
    skip=_LLAMA.skip + (r"(^|\.)vision_tower\.", r"(^|\.)multi_modal_projector\."),
    rename=((r"^language_model\.model\.", "model."), (r"^model\.language_model\.", "model."),
            (r"^language_model\.lm_head\.", "lm_head.")),
)
# Phi-3's fused qkv_proj already holds [q heads | k heads | v heads]; gate_up_proj is [gate | up] (`FUSED_MLP`)
_PHI3 = Layout(
    top=_LLAMA.top,
    layers=_LLAMA.layers,
    layer={
        "input_layernorm": "norm_1",
        "post_attention_layernorm": "norm_2",
        "self_attn.qkv_proj": "attn.qkv",
        "self_attn.o_proj": "attn.proj",
        "mlp.down_proj": "mlp.proj",
    },
    qkv=(),
    skip=_LLAMA.skip,
)
FUSED_MLP = {"phi3": ("mlp.gate_up_proj", ("mlp.fc_1", "mlp.fc_2"))}
_PHI = Layout(
    top={"model.embed_tokens": "transformer.wte", "model.final_layernorm": "transformer.ln_f", "lm_head": "lm_head"},
    layers="model.layers",
    layer={"input_layernorm": "norm_1", "self_attn.dense": "attn.proj", "mlp.fc1": "mlp.fc", "mlp.fc2": "mlp.proj"},
    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    skip=(r"\.rotary_emb\.inv_freq$",),
)
_GPT_NEOX = Layout(
    # checkpoints name the head `embed_out`; transformers 5 renames it to `lm_head` in memory (export writes the first)
    top={
        "gpt_neox.embed_in": "transformer.wte",
        "gpt_neox.final_layer_norm": "transformer.ln_f",
        "embed_out": "lm_head",
        "lm_head": "lm_head",
    },
    layers="gpt_neox.layers",
    layer={
        "input_layernorm": "norm_1",
        "post_attention_layernorm": "norm_2",
        "attention.dense": "attn.proj",
        "mlp.dense_h_to_4h": "mlp.fc",
        "mlp.dense_4h_to_h": "mlp.proj",
    },
    qkv=("attention.query_key_value",),
    # older checkpoints store the causal-mask and RoPE buffers
    skip=(r"\.attention\.(bias|masked_bias)$", r"\.rotary_emb\.inv_freq$"),
)
_FALCON_COMMON = {"self_attention.dense": "attn.proj", "mlp.dense_h_to_4h": "mlp.fc", "mlp.dense_4h_to_h": "mlp.proj"}
_FALCON = Layout(
    top={"transformer.word_embeddings": "transformer.wte", "transformer.ln_f": "transformer.ln_f", "lm_head": "lm_head"},
    layers="transformer.h",
    # import accepts every norm naming; export picks the one the config's architecture uses (`_falcon_layer`)
    layer={
        "input_layernorm": "norm_1",
        "post_attention_layernorm": "norm_2",
        "ln_attn": "norm_1",
        "ln_mlp": "norm_2",
        **_FALCON_COMMON,
    },
    qkv=("self_attention.query_key_value",),
    skip=(r"\.rotary_emb\.inv_freq$",),
)
# the mixtures of experts: their norms, attention and router here; the experts and gpt-oss's sinks in
# `lit_gpt.convert_moe`
_NORMS_O = {"input_layernorm": "norm_1", "post_attention_layernorm": "norm_2", "self_attn.o_proj": "attn.proj"}
_MIXTRAL = Layout(
    top=_LLAMA.top,
    layers=_LLAMA.layers,
    layer={**_NORMS_O, "block_sparse_moe.gate": "mlp.router"},
    qkv=_LLAMA.qkv,
    skip=_LLAMA.skip,
    # transformers 5's in-memory names (`mlp.gate`, `mlp.experts.*`) -> the Hub's
    rename=((r"\.mlp\.(gate|experts)\.", r".block_sparse_moe.\1."),),
)
_QWEN3_MOE = Layout(
    top=_LLAMA.top, layers=_LLAMA.layers, layer={**_QWEN3.layer, "mlp.gate": "mlp.router"}, qkv=_LLAMA.qkv,
    skip=_LLAMA.skip,
)
_GPT_OSS = Layout(
    top=_LLAMA.top, layers=_LLAMA.layers, layer={**_NORMS_O, "mlp.router": "mlp.router"}, qkv=_LLAMA.qkv,
    skip=_LLAMA.skip,
)
LAYOUTS = {
    "mixtral": _MIXTRAL,
    "qwen3_moe": _QWEN3_MOE,
    "gpt_oss": _GPT_OSS,
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gemma": _LLAMA,
    "stablelm": _LLAMA,
    "phi": _PHI,
    "gpt_neox": _GPT_NEOX,
    "falcon": _FALCON,
    "qwen3": _QWEN3,
    "smollm3": _LLAMA,
    "olmo2": _OLMO2,
    "phi3": _PHI3,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA3,
    "gemma3": _GEMMA3,
}


def layer_map(model_type: str, config: Config) -> Dict[str, str]:
    """HF sub-module -> lit sub-module for one layer, one-to-one for this config (what export uses)."""
    if model_type != "falcon":
        layer = dict(LAYOUTS[model_type].layer)
        if config.shared_attention_norm:
            layer.pop("post_attention_layernorm", None)
        return layer
    new_arch, _ = _falcon_arch(config)
    if config.shared_attention_norm:
        norms = {"input_layernorm": "norm_1"}
    elif new_arch:
        norms = {"ln_attn": "norm_1", "ln_mlp": "norm_2"}
    else:
        norms = {"input_layernorm": "norm_1", "post_attention_layernorm": "norm_2"}
    return {**norms, **_FALCON_COMMON}


def qkv_grouping(model_type: str, config: Config) -> Tuple[int, int]:
    """(n_groups, q_per_kv) of a fused HF qkv tensor (see the module docstring)."""
    if model_type == "gpt_neox":
        return config.n_head, 1
    return config.n_query_groups, config.n_head // config.n_query_groups


def ungroup_qkv(t: torch.Tensor, n_groups: int, q_per_kv: int, head_size: int) -> torch.Tensor:
    """HF fused rows (n_groups, q_per_kv + 2, head_size) -> lit rows [q heads | k heads | v heads]."""
    rest = t.shape[1:]
    g = t.reshape(n_groups, q_per_kv + 2, head_size, *rest)
    q = g[:, :q_per_kv].reshape(-1, *rest)
    k = g[:, q_per_kv].reshape(-1, *rest)
    v = g[:, q_per_kv + 1].reshape(-1, *rest)
    return torch.cat((q, k, v))


def group_qkv(t: torch.Tensor, n_groups: int, q_per_kv: int, head_size: int) -> torch.Tensor:
    """lit rows [q heads | k heads | v heads] -> HF fused rows (n_groups, q_per_kv + 2, head_size)."""
    rest = t.shape[1:]
    q_rows = n_groups * q_per_kv * head_size
    kv_rows = n_groups * head_size
    q, k, v = t.split((q_rows, kv_rows, kv_rows))
    q = q.reshape(n_groups, q_per_kv, head_size, *rest)
    k = k.reshape(n_groups, 1, head_size, *rest)
    v = v.reshape(n_groups, 1, head_size, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def split_qkv(t: torch.Tensor, config: Config) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv_rows = config.n_query_groups * config.head_size
    return t.split((config.n_head * config.head_size, kv_rows, kv_rows))
