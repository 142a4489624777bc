"""RoPE: the cos/sin tables of rotary position embeddings with the frequency scalings the families use (llama3,
linear, yarn, longrope), and their application to queries and keys. `lit_gpt.model` builds the tables once per model
(`GPT.reset_rope_cache`) and re-exports these functions."""

import math
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from lit_gpt.config import Config

_NO_SCALING: Dict[str, Any] = {}


def build_rope_cache(
    seq_len: int,
    config: Config,
    device: Optional[torch.device] = None,
    base: Optional[float] = None,
    scaling: Optional[Mapping[str, Any]] = _NO_SCALING,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, rope_n_elem), in float32, with the frequency scaling of `config.rope_scaling`
    (or of `scaling`; None: unscaled) and the base `config.rope_base` (or `base`)."""
    n_elem = config.rope_n_elem
    base = config.rope_base if base is None else base
    scaling = config.rope_scaling if scaling is _NO_SCALING else scaling
    exponents = torch.arange(0, n_elem, 2, device=device, dtype=torch.int64).float() / n_elem
    inv_freq = 1.0 / (base**exponents)
    attention_factor = 1.0
    if scaling:
        kind = scaling.get("type", "llama3")
        if kind == "llama3":
            inv_freq = _llama3_scale(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn_scale(inv_freq, base, n_elem, scaling, device)
        elif kind == "longrope":  # the short factors' table (GPT.reset_rope_cache builds the long one beside it)
            inv_freq, attention_factor = _longrope_scale(base, exponents, config, scaling, device)
        else:  # Config refuses unknown types; a hand-made dict must not pass silently either
            raise ValueError(f"rope_scaling type {kind!r} is not implemented")
    pos = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention_factor != 1.0:
        return emb.cos() * attention_factor, emb.sin() * attention_factor
    return emb.cos(), emb.sin()


def _yarn_scale(
    inv_freq: torch.Tensor, base: float, dim: int, s: Mapping[str, Any], device: Optional[torch.device]
) -> Tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071) as transformers computes it: interpolated low frequencies, extrapolated high ones,
    a linear ramp between, and cos/sin scaled by the attention factor."""
    factor, old_ctx = float(s["factor"]), s["original_max_seq_len"]

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = get_mscale(factor, s["mscale"]) / get_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    # interpolated (divided by the factor) where the ramp is 1, the original frequencies where it is 0
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention_factor)


def _longrope_scale(
    base: float, exponents: torch.Tensor, config: Config, s: Mapping[str, Any], device: Optional[torch.device]
) -> Tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): per-dimension rescaling factors, short ones for sequences within the
    pretraining context, long ones beyond it (`GPT.forward` chooses), and cos/sin scaled by the attention factor."""
    old_ctx = s["original_max_seq_len"]
    factor = s.get("factor") or config.block_size / old_ctx  # configs read from config.json store it
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    factors = torch.tensor(s["short_factor"], dtype=torch.float32, device=device)
    return 1.0 / (factors * base**exponents), float(attention_factor)


def _llama3_scale(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_seq_len"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_elem: int) -> torch.Tensor:
    """Rotate the first `n_elem` dims of each head (HF's rotate_half convention); the rest pass through."""
    if n_elem == 0:
        return x
    if n_elem < x.size(-1):
        x_rope, x_pass = x[..., :n_elem], x[..., n_elem:]
    else:
        x_rope, x_pass = x, None
    half = n_elem // 2
    x1, x2 = x_rope[..., :half], x_rope[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (x_rope * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)
    return out if x_pass is None else torch.cat((out, x_pass), dim=-1)
