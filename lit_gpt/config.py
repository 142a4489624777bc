"""Model configurations: one dataclass, a registry of named configs, and a reader for HF `config.json`.

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
    rope_scaling: Optional[Dict[str, Any]] = None  # llama3 style: factor, low/high_freq_factor, original_max_...
    parallel_residual: bool = False  # x + attn(norm_1(x)) + mlp(norm_2(x))
    shared_attention_norm: bool = False  # parallel residual with a single norm (Falcon-7B, Phi)
    bias: bool = False  # bias on every linear layer
    attn_bias: bool = False  # bias on the fused qkv projection only (Qwen2, StableLM-2)
    lm_head_bias: bool = False
    norm_class_name: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # Gemma: y = norm(x) * (1 + weight)
    mlp_class_name: Literal["GptNeoxMLP", "LLaMAMLP", "GemmaMLP"] = "GptNeoxMLP"
    gelu_approximate: Literal["none", "tanh"] = "none"
    intermediate_size: Optional[int] = None
    scale_embeddings: bool = False  # Gemma: embeddings * sqrt(n_embd)
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    sliding_window_size: Optional[int] = None  # Mistral v0.1: a query sees the last `sliding_window_size` keys
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
        self.rope_n_elem = int(self.rotary_percentage * self.head_size)
        if self.rope_n_elem % 2:
            raise ValueError(f"rotary dims ({self.rope_n_elem}) must be even")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        conf = _NAME_TO_CONFIG.get(name)
        if conf is None:
            close = difflib.get_close_matches(name, list(_NAME_TO_CONFIG), n=5, cutoff=0.4)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ValueError(f"Unknown model name {name!r}.{hint} (`Config.names()` lists all {len(_NAME_TO_CONFIG)}.)")
        conf = deepcopy(conf)
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
        """Build a Config straight from a Hugging Face `config.json` dict (llama, mistral, gpt_neox, falcon, phi,
        gemma, qwen2, stablelm). Used by the converter so that a checkpoint converts without a registry entry."""
        conf = _from_hf_config(hf)
        conf["hf_model_type"] = hf["model_type"]
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
        mlp_params = n_mlp_mats * self.n_embd * self.intermediate_size
        per_layer = 2 * (attn_params + mlp_params) + 2 * 2 * q * seq_len / 2
        return self.n_layer * per_layer + 2 * self.n_embd * self.vocab_size


# ---------------------------------------------------------------------------------------------------------------
# HF config.json -> Config
# ---------------------------------------------------------------------------------------------------------------
def _rope_params(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Rope theta and scaling, whether stored at the top level (transformers 4.x) or under rope_parameters (5.x)."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    out: Dict[str, Any] = {"rope_base": float(theta)}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            out["rope_scaling"] = {
                "factor": float(scaling["factor"]),
                "low_freq_factor": float(scaling["low_freq_factor"]),
                "high_freq_factor": float(scaling["high_freq_factor"]),
                "original_max_seq_len": int(scaling["original_max_position_embeddings"]),
            }
        elif kind not in (None, "default"):
            raise ValueError(f"Unsupported rope scaling {kind!r}: only 'llama3' is implemented")
    return out


def _partial_rotary(hf: Dict[str, Any], legacy_key: str, default: float) -> float:
    """Fraction of head dims with RoPE: top level in transformers 4.x configs, under rope_parameters in 5.x."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get(legacy_key, params.get("partial_rotary_factor", default)))


def _from_hf_config(hf: Dict[str, Any]) -> Dict[str, Any]:
    mt = hf.get("model_type")
    hidden = hf.get("hidden_size")
    common = dict(
        block_size=hf.get("max_position_embeddings", 4096),
        vocab_size=hf["vocab_size"],
        n_layer=hf.get("num_hidden_layers"),
        n_head=hf.get("num_attention_heads"),
        n_embd=hidden,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if mt in ("llama", "mistral", "qwen2"):
        conf = dict(
            common,
            n_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_size=hf.get("head_dim") or hidden // hf["num_attention_heads"],
            norm_class_name="RMSNorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            mlp_class_name="LLaMAMLP",
            intermediate_size=hf["intermediate_size"],
            attn_bias=mt == "qwen2",
            **_rope_params(hf),
        )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Unsupported hidden_act {hf.get('hidden_act')!r} for {mt}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError(f"{mt} with attention_bias/mlp_bias is not supported")
        if mt == "mistral" and hf.get("sliding_window"):
            conf["sliding_window_size"] = hf["sliding_window"]
        if mt == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        return conf
    if mt == "gemma":
        return dict(
            common,
            tie_embeddings=True,
            n_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_size=hf["head_dim"],
            norm_class_name="RMSNorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            norm_unit_offset=True,
            mlp_class_name="GemmaMLP",
            gelu_approximate="tanh",
            intermediate_size=hf["intermediate_size"],
            scale_embeddings=True,
            **_rope_params(hf),
        )
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
        f"Unsupported model_type {mt!r}. Supported: llama, mistral, qwen2, gemma, gpt_neox, falcon, phi, stablelm"
    )


# ---------------------------------------------------------------------------------------------------------------
# Named configs
# ---------------------------------------------------------------------------------------------------------------
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

_NAME_TO_CONFIG: Dict[str, Dict[str, Any]] = {c["name"]: c for c in configs}


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def load_config(checkpoint_dir: Path, config_cls: Optional[type] = None, **overrides: Any) -> "Config":
    """The checkpoint's config, as `config_cls` (a variant's Config, e.g. `lit_gpt.lora.Config`) with the method's
    `overrides`, or a LitError that says what is wrong (no config in the folder, invalid settings). The one
    config loader of the recipes, scripts and data preparation."""
    from lit_gpt.utils import LitError  # here: lit_gpt.utils imports nothing of the model package

    config_cls = config_cls or Config
    checkpoint_dir = Path(checkpoint_dir)
    try:
        return config_cls.from_checkpoint(checkpoint_dir, **overrides)
    except FileNotFoundError as e:
        raise LitError(str(e)) from e
    except (ValueError, TypeError) as e:
        raise LitError(f"invalid model config or settings in {str(checkpoint_dir)!r}: {e}") from e
