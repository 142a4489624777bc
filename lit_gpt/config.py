"""Model configurations: one dataclass, the registry of named configs (its data is `lit_gpt.config_registry`), and a
reader for HF `config.json`.

Each named config carries a comment with the Hugging Face `config.json` it mirrors. Checkpoints written by
`scripts/convert_hf_checkpoint.py` store the resolved config next to the weights (`lit_config.json`), so a
checkpoint loads with `Config.from_checkpoint(dir)` whether or not its model has a registry entry.
"""

import difflib
import json
import math
from copy import deepcopy
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

from lit_gpt.config_registry import configs
from lit_gpt.hf_read import LAYER_TYPES, ROPE_SCALING_KEYS, from_hf_config
from lit_gpt.moe import DISPATCHES, MOE_ACTIVATIONS, ROUTINGS

CONFIG_FILE = "lit_config.json"


@dataclass
class Config:
    name: str = ""
    hf_config: Dict[str, str] = field(default_factory=dict)  # {"org": ..., "name": ...} on the HF Hub
    block_size: int = 4096  # the context length the model was trained for
    vocab_size: int = 50304  # rows of the embedding matrix (HF `vocab_size`, already padded by the authors)
    n_layer: int = 16
    n_head: int = 32
    n_embd: int = 4096
    head_size: Optional[int] = None  # defaults to n_embd // n_head
    n_query_groups: Optional[int] = None  # KV heads: n_head = MHA, 1 = MQA, otherwise GQA
    rotary_percentage: float = 1.0  # fraction of each head's dims that get RoPE
    rope_base: float = 10000.0
    # frequency scaling of the full-attention layers' RoPE, a dict with "type" (`ROPE_SCALING_KEYS` lists each
    # type's keys): llama3 (Llama 3.1+; the default type, for configs written before types existed), linear
    # (Gemma 3 4B+), yarn, longrope (Phi-3.5 / Phi-4-mini)
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_local_base: Optional[float] = None  # RoPE base of the sliding-window layers (Gemma 3: 10k); None: rope_base
    layers_without_rope: List[int] = field(default_factory=list)  # indices of layers without RoPE (SmolLM3's NoPE)
    parallel_residual: bool = False  # x + attn(norm_1(x)) + mlp(norm_2(x))
    shared_attention_norm: bool = False  # parallel residual with a single norm (Falcon-7B, Phi)
    bias: bool = False  # bias on every linear layer
    attn_bias: bool = False  # bias on the fused qkv projection only (Qwen2, StableLM-2)
    lm_head_bias: bool = False
    norm_class_name: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # Gemma: y = norm(x) * (1 + weight)
    norm_float_weight: bool = False  # OLMo 2: RMSNorm multiplies by its weight in float32, then rounds once
    mlp_class_name: Literal["GptNeoxMLP", "LLaMAMLP", "GemmaMLP"] = "GptNeoxMLP"
    gelu_approximate: Literal["none", "tanh"] = "none"
    intermediate_size: Optional[int] = None
    scale_embeddings: bool = False  # Gemma: embeddings * sqrt(n_embd)
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    sliding_window_size: Optional[int] = None  # Mistral v0.1: a query sees the last `sliding_window_size` keys
    # per layer "full_attention" or "sliding_attention" (Gemma 2 alternates, Gemma 3 has five local to one
    # global); None: every layer slides when sliding_window_size is set (Mistral, Phi-3), else none does
    layer_types: Optional[List[str]] = None
    # RMSNorm of the queries and keys before RoPE: over each head (Qwen3, Gemma 3) or over the whole projection
    # (OLMo 2)
    norm_qk: Optional[Literal["per_head", "all_heads"]] = None
    pre_norm: bool = True  # norm_1 / norm_2 before attention and MLP (OLMo 2 has post norms only)
    post_attention_norm: bool = False  # a norm on the attention output before the residual add (Gemma 2/3, OLMo 2)
    post_mlp_norm: bool = False  # the same after the MLP
    attention_scores_scalar: Optional[float] = None  # Gemma 2/3 query_pre_attn_scalar: scores * scalar**-0.5
    attention_logit_softcapping: Optional[float] = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: Optional[float] = None  # Gemma 2: logits = cap * tanh(logits / cap)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax, whose share attends nowhere
    # mixture of experts (lit_gpt.moe; Mixtral, Qwen3-MoE, gpt-oss): n_expert 0 is a dense model
    n_expert: int = 0
    n_expert_per_token: int = 0  # k: experts per token
    moe_intermediate_size: Optional[int] = None  # each expert's hidden width (default: intermediate_size)
    moe_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 (Qwen3-MoE decoder_sparse_step)
    moe_dense_layers: List[int] = field(default_factory=list)  # layers with a dense MLP (Qwen3-MoE mlp_only_layers)
    # "softmax_topk" (Mixtral, Qwen3-MoE) or "topk_softmax" (gpt-oss); see lit_gpt.moe
    moe_routing: str = "softmax_topk"
    moe_norm_topk_prob: bool = True  # softmax_topk: renormalise the k weights (Mixtral always, Qwen3 norm_topk_prob)
    moe_bias: bool = False  # biases on the router and the experts (gpt-oss)
    moe_activation: str = "silu"  # the experts' gate: "silu" (SwiGLU) or "clamped_swiglu" (gpt-oss)
    swiglu_limit: float = 7.0  # clamped_swiglu's clamp
    swiglu_alpha: float = 1.702  # clamped_swiglu's sigmoid slope
    # experts' buffer size in training: ceil(factor * tokens * k / n_expert) (assignments beyond it are dropped and
    # reported); None: never drop. Evaluation and generation never drop (lit_gpt.moe)
    moe_capacity_factor: Optional[float] = 2.0
    moe_dispatch: str = "auto"  # "auto", "capacity", "gather" or "dense" (the reference; lit_gpt.moe)
    router_aux_loss_coef: float = 0.0  # weight of the router's load-balancing loss in training (HF's name)
    # HF `model_type` the weights came from (llama, mistral, ...): picks the HF layout when exporting back.
    # None for configs not read from a config.json; `lit_gpt.convert.hf_model_type` derives it then.
    hf_model_type: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.hf_config.get("name", "")
        if self.head_size is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd ({self.n_embd}) is not a multiple of n_head ({self.n_head}); set head_size")
            self.head_size = self.n_embd // self.n_head
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.n_head % self.n_query_groups:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_query_groups ({self.n_query_groups})")
        if self.intermediate_size is None:
            if self.mlp_class_name != "GptNeoxMLP":
                raise ValueError(f"{self.mlp_class_name} needs intermediate_size")
            self.intermediate_size = 4 * self.n_embd
        if self.n_expert and self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self.rope_n_elem = int(self.rotary_percentage * self.head_size)
        if self.rope_n_elem % 2:
            raise ValueError(f"rotary dims ({self.rope_n_elem}) must be even")
        self._check_layer_features()

    def _check_layer_features(self) -> None:
        """Refuse what the model does not implement, naming the field (never a silent wrong answer)."""
        if self.rope_scaling:
            kind = self.rope_scaling.get("type", "llama3")
            if kind not in ROPE_SCALING_KEYS:
                raise ValueError(
                    f"rope_scaling type {kind!r} is not implemented; implemented: {', '.join(ROPE_SCALING_KEYS)}"
                )
            missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling of type {kind!r} needs {', '.join(missing)}")
            if kind == "longrope":
                for key in ("short_factor", "long_factor"):
                    if len(self.rope_scaling[key]) != self.rope_n_elem // 2:
                        raise ValueError(
                            f"rope_scaling {key} has {len(self.rope_scaling[key])} values, the model's RoPE"
                            f" needs {self.rope_n_elem // 2} (rotary dims / 2)"
                        )
            if kind == "longrope" and self.rope_local_base is not None:
                raise ValueError("rope_scaling of type 'longrope' with rope_local_base is not implemented")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layer} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(
                    f"layer_types value(s) {', '.join(map(repr, unknown))} not implemented;"
                    f" use {', '.join(LAYER_TYPES)}"
                )
            if "sliding_attention" in self.layer_types and not self.sliding_window_size:
                raise ValueError("layer_types has sliding_attention layers but sliding_window_size is not set")
        if self.sliding_window_size is not None and self.sliding_window_size < 1:
            raise ValueError(f"sliding_window_size must be positive, got {self.sliding_window_size}")
        bad = [i for i in self.layers_without_rope if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"layers_without_rope names layers {bad} outside 0..{self.n_layer - 1}")
        if self.norm_qk not in (None, "per_head", "all_heads"):
            raise ValueError(f"norm_qk {self.norm_qk!r} is not implemented; use 'per_head' or 'all_heads'")
        if not self.pre_norm and (self.parallel_residual or self.shared_attention_norm):
            raise ValueError("pre_norm=false (post norms only) needs a sequential residual")
        if self.attention_sinks and self.attention_logit_softcapping is not None:
            raise ValueError("attention_sinks with attention_logit_softcapping is not implemented")
        self._check_moe()
        for key in ("attention_scores_scalar", "attention_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key} must be positive, got {value}")

    def _check_moe(self) -> None:
        if self.n_expert < 0:
            raise ValueError(f"n_expert must be 0 (a dense model) or positive, got {self.n_expert}")
        if not self.n_expert:
            return
        if not 1 <= self.n_expert_per_token <= self.n_expert:
            raise ValueError(f"n_expert_per_token must be in 1..{self.n_expert}, got {self.n_expert_per_token}")
        for key, value, implemented in (("moe_routing", self.moe_routing, ROUTINGS),
                                        ("moe_activation", self.moe_activation, MOE_ACTIVATIONS),
                                        ("moe_dispatch", self.moe_dispatch, DISPATCHES)):
            if value not in implemented:
                raise ValueError(f"{key} {value!r} is not implemented; implemented: {', '.join(implemented)}")
        if self.moe_sparse_step < 1:
            raise ValueError(f"moe_sparse_step must be positive, got {self.moe_sparse_step}")
        bad = [i for i in self.moe_dense_layers if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"moe_dense_layers names layers {bad} outside 0..{self.n_layer - 1}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(f"moe_capacity_factor must be positive (or None: no drops), got {self.moe_capacity_factor}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")

    # ------------------------------------------------------------------ per-layer features
    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward is the mixture of experts (else the dense `mlp_class_name`)."""
        return bool(self.n_expert) and layer not in self.moe_dense_layers and (layer + 1) % self.moe_sparse_step == 0

    def sliding_window(self, layer: int) -> Optional[int]:
        """The attention window of `layer` (None: it sees every earlier position)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window_size
        return None

    def rope_kind(self, layer: int) -> Optional[int]:
        """Which RoPE table `layer` uses: 0 the global one, 1 the local one of sliding layers (`rope_local_base`),
        None for a layer without RoPE."""
        if layer in self.layers_without_rope:
            return None
        if self.rope_local_base is not None and self.sliding_window(layer) is not None:
            return 1
        return 0

    @property
    def rope_kinds(self) -> int:
        """How many RoPE tables the model needs (1, or 2 with a local base for the sliding layers)."""
        return 1 + any(self.rope_kind(i) == 1 for i in range(self.n_layer))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        conf = _NAME_TO_CONFIG.get(name)
        if conf is None:
            close = difflib.get_close_matches(name, list(_NAME_TO_CONFIG), n=5, cutoff=0.4)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ValueError(f"Unknown model name {name!r}.{hint} (`Config.names()` lists all {len(_NAME_TO_CONFIG)}.)")
        conf = deepcopy(conf)
        n_layer = overrides.get("n_layer")
        if n_layer is not None and n_layer != conf.get("n_layer"):
            # a shallower (or deeper) copy keeps the per-layer pattern: Gemma's layer types repeat from layer 0
            if conf.get("layer_types") and "layer_types" not in overrides:
                conf["layer_types"] = [conf["layer_types"][i % len(conf["layer_types"])] for i in range(n_layer)]
            if conf.get("layers_without_rope") and "layers_without_rope" not in overrides:
                conf["layers_without_rope"] = [i for i in conf["layers_without_rope"] if i < n_layer]
        conf.update(overrides)
        return cls(**conf)

    @classmethod
    def names(cls) -> List[str]:
        return sorted(_NAME_TO_CONFIG)

    @classmethod
    def from_file(cls, path: Path, **overrides: Any) -> "Config":
        with open(path, encoding="utf-8") as f:
            conf = json.load(f)
        conf.update(overrides)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in conf.items() if k in known})

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path, **overrides: Any) -> "Config":
        """The config the converter wrote next to the weights, else the registry entry named like the folder."""
        checkpoint_dir = Path(checkpoint_dir)
        if (checkpoint_dir / CONFIG_FILE).is_file():
            return cls.from_file(checkpoint_dir / CONFIG_FILE, **overrides)
        if (checkpoint_dir / "config.json").is_file():
            return cls.from_hf_config(json.loads((checkpoint_dir / "config.json").read_text()), **overrides)
        if checkpoint_dir.name in _NAME_TO_CONFIG:
            return cls.from_name(checkpoint_dir.name, **overrides)
        raise FileNotFoundError(
            f"No {CONFIG_FILE} or config.json in {str(checkpoint_dir)!r}. Download and convert a model first:"
            f" python scripts/download.py --repo_id ORG/NAME"
        )

    @classmethod
    def from_hf_config(cls, hf: Dict[str, Any], name: str = "", **overrides: Any) -> "Config":
        """Build a Config straight from a Hugging Face `config.json` dict (the model types of
        `lit_gpt.hf_read.HF_MODEL_TYPES`). Used by the converter so that a checkpoint converts without a registry
        entry."""
        conf = from_hf_config(hf)
        # a Gemma 3 multimodal folder is read (and exported) as its text model
        conf["hf_model_type"] = "gemma3_text" if hf["model_type"] == "gemma3" else hf["model_type"]
        if name:
            conf["name"] = name
        conf.update(overrides)
        return cls(**conf)

    # ------------------------------------------------------------------ helpers
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        return d

    def save(self, checkpoint_dir: Path) -> None:
        path = Path(checkpoint_dir) / CONFIG_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(path)

    @property
    def rope_cache_dim(self) -> int:
        return self.rope_n_elem

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Forward FLOPs per token: 2 * (matmul parameters) + attention scores (causal average)."""
        seq_len = seq_len or self.block_size
        q = self.n_head * self.head_size
        kv = 2 * self.n_query_groups * self.head_size
        attn_params = self.n_embd * (q + kv) + q * self.n_embd
        n_mlp_mats = 2 if self.mlp_class_name == "GptNeoxMLP" else 3
        total = 0.0
        for i in range(self.n_layer):
            if self.is_moe_layer(i):  # the router, and the k experts a token goes through
                mlp_params = self.n_embd * self.n_expert + self.n_expert_per_token * 3 * self.n_embd * (
                    self.moe_intermediate_size)
            else:
                mlp_params = n_mlp_mats * self.n_embd * self.intermediate_size
            total += 2 * (attn_params + mlp_params) + 2 * 2 * q * seq_len / 2
        return total + 2 * self.n_embd * self.vocab_size


_NAME_TO_CONFIG: Dict[str, Dict[str, Any]] = {c["name"]: c for c in configs}


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


# --rope_scaling: the types that extend a checkpoint's context with one static table, exactly as transformers'
# rope_init_functions compute them ("dynamic" NTK rescales with each forward's length, which one table cannot give;
# "longrope" needs per-dimension factors fitted to the model: a checkpoint's own only), and each type's optional keys
EXTENDING_ROPE: Dict[str, tuple] = {
    "linear": (),
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
    "llama3": ("low_freq_factor", "high_freq_factor"),
}


def with_rope_scaling(config: "Config", scaling: Dict[str, Any], max_seq_length: Optional[int] = None) -> "Config":
    """`config` with the user's RoPE scaling (`--rope_scaling '{"type": "yarn", "factor": 4}'`): the RoPE frequencies
    scaled for a context of `factor` times the checkpoint's (its `block_size`, which becomes the original context),
    and that longer `block_size`. Raises ValueError (one line, what to do) for a type that cannot extend exactly, a
    model without RoPE or with its own scaling, or a `max_seq_length` beyond the scaled context."""
    scaling = dict(scaling)
    kind = scaling.pop("type", None) or scaling.pop("rope_type", None)
    if kind not in EXTENDING_ROPE:
        raise ValueError(f"--rope_scaling type {kind!r} cannot extend the context exactly here: use one of"
                         f" {', '.join(map(repr, EXTENDING_ROPE))} with a factor, e.g."
                         """ '{"type": "yarn", "factor": 4}'""")
    factor = scaling.pop("factor", None)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 1:
        raise ValueError(f"--rope_scaling needs a \"factor\" > 1 (the context grows by it), got {factor!r}")
    unknown = sorted(set(scaling) - set(EXTENDING_ROPE[kind]))
    if unknown:
        raise ValueError(f"--rope_scaling of type {kind!r} does not take {', '.join(unknown)}; it takes factor"
                         + "".join(f", {k}" for k in EXTENDING_ROPE[kind]))
    if config.rope_n_elem == 0 or len(config.layers_without_rope) == config.n_layer:
        raise ValueError(f"{config.name or 'this model'} has no RoPE to scale: it cannot extend its context"
                         f" ({config.block_size}); drop --rope_scaling")
    if config.rope_scaling:
        own = config.rope_scaling.get("type", "llama3")
        raise ValueError(f"{config.name or 'this model'} has its own RoPE scaling ({own!r}) up to its context"
                         f" {config.block_size}: drop --rope_scaling")
    old = config.block_size
    ours: Dict[str, Any] = {"type": kind, "factor": float(factor), **scaling}
    if kind == "llama3":  # transformers' Llama 3.1 defaults where the user names none
        ours = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, **ours, "original_max_seq_len": old}
    elif kind == "yarn":
        ours["original_max_seq_len"] = old
    context = int(old * factor)
    if max_seq_length is not None and max_seq_length > context:
        raise ValueError(f"a context of {max_seq_length} exceeds what --rope_scaling gives ({old} x {factor:g} ="
                         f" {context}): raise its factor to at least {max_seq_length / old:.3g} or shorten the context")
    return type(config)(**{**config.to_dict(), "rope_scaling": ours, "block_size": context})


def load_config(checkpoint_dir: Path, config_cls: Optional[type] = None, rope_scaling: Optional[Dict[str, Any]] = None,
                max_seq_length: Optional[int] = None, **overrides: Any) -> "Config":
    """The checkpoint's config, as `config_cls` (a variant's Config, e.g. `lit_gpt.lora.Config`) with the method's
    `overrides`, or a LitError that says what is wrong (no config in the folder, invalid settings). The one
    config loader of the recipes, scripts and data preparation. `rope_scaling` (`--rope_scaling`): the context
    extended by `with_rope_scaling`, refused in one line where it cannot reach `max_seq_length`."""
    from lit_gpt.utils import LitError  # here: lit_gpt.utils imports nothing of the model package

    config_cls = config_cls or Config
    checkpoint_dir = Path(checkpoint_dir)
    if rope_scaling:  # --rope_scaling: the checkpoint's context extended (its refusals are one line too)
        try:
            return with_rope_scaling(config_cls.from_checkpoint(checkpoint_dir, **overrides), rope_scaling,
                                     max_seq_length)
        except ValueError as e:
            raise LitError(str(e)) from e
    try:
        return config_cls.from_checkpoint(checkpoint_dir, **overrides)
    except FileNotFoundError as e:
        raise LitError(str(e)) from e
    except (ValueError, TypeError) as e:
        raise LitError(f"invalid model config or settings in {str(checkpoint_dir)!r}: {e}") from e
