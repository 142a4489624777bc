"""LLaMA-Adapter (Zhang et al. 2023, arXiv:2303.16199): from layer `adapter_start_layer` on, every attention layer
gets `adapter_prompt_length` learned prompt vectors. The queries attend to them in a second, separate softmax
whose output is scaled by a per-head gate; the gate starts at zero, so the model equals the base model at the
start of finetuning.

The prompt vectors go through the layer's own `qkv` projection to give the prefix keys and values (no RoPE: they
have no position). The prefix attention is added in `scaled_dot_product_attention`, after the base attention has
used its KV cache and mask, so it works the same with and without a cache, with GQA/MQA and sliding windows.
"""

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.config import Config as BaseConfig
from lit_gpt.model import GPT as BaseModel
from lit_gpt.model import CausalSelfAttention as BaseCausalSelfAttention


@dataclass
class Config(BaseConfig):
    adapter_prompt_length: int = 10
    adapter_start_layer: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adapter_prompt_length <= 0:
            raise ValueError(f"adapter_prompt_length must be positive, got {self.adapter_prompt_length}")
        if not 0 <= self.adapter_start_layer < self.n_layer:
            raise ValueError(
                f"adapter_start_layer must be in [0, n_layer={self.n_layer}), got {self.adapter_start_layer}"
            )


class CausalSelfAttention(BaseCausalSelfAttention):
    def __init__(self, config: Config, block_idx: int = 0) -> None:
        super().__init__(config, block_idx)
        self.adapter_wte = nn.Embedding(config.adapter_prompt_length, config.n_embd)
        # one gate per head, zero: the prefix contributes nothing until it is trained
        self.gating_factor = nn.Parameter(torch.zeros(1, config.n_head, 1, 1))

    def reset_parameters(self) -> None:
        """Lightning/FSDP materialise meta modules by calling this on modules that own parameters directly."""
        with torch.no_grad():
            self.gating_factor.zero_()

    def scaled_dot_product_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        y = super().scaled_dot_product_attention(q, k, v, mask)
        return y + self.gating_factor.to(y.dtype) * self.prefix_attention(q)

    def prefix_attention(self, q: torch.Tensor) -> torch.Tensor:
        """q: (B, n_head, T, hs) -> every query attends to all prompt vectors (no mask): (B, n_head, T, hs)."""
        c = self.config
        B = q.size(0)
        P = c.adapter_prompt_length
        q_size, kv_size = c.n_head * c.head_size, c.n_query_groups * c.head_size
        _, ak, av = self.qkv(self.adapter_wte.weight).split((q_size, kv_size, kv_size), dim=-1)
        ak = ak.view(1, P, c.n_query_groups, c.head_size).transpose(1, 2)  # (1, ng, P, hs)
        av = av.view(1, P, c.n_query_groups, c.head_size).transpose(1, 2)
        if c.n_query_groups != c.n_head:
            rep = c.n_head // c.n_query_groups
            ak = ak.repeat_interleave(rep, dim=1)
            av = av.repeat_interleave(rep, dim=1)
        ak, av = ak.expand(B, -1, -1, -1), av.expand(B, -1, -1, -1)
        return F.scaled_dot_product_attention(q, ak.to(q.dtype), av.to(q.dtype), scale=1.0 / math.sqrt(c.head_size))


class GPT(BaseModel):
    peft_method = "adapter"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # the adapter layers get attention modules of their own; the base ones they replace cost nothing on the
        # meta device (how finetuning and generation build models) and one layer's attention at a time otherwise
        for block in self.transformer.h[config.adapter_start_layer :]:
            block.attn = CausalSelfAttention(config, block.attn.block_idx)

    @staticmethod
    def peft_filter(key: str, value: Any = None) -> bool:
        return adapter_filter(key, value)


def adapter_filter(key: str, value: Any = None) -> bool:
    """The adapter weights in a state dict (what an adapter checkpoint holds)."""
    return "adapter_wte" in key or "gating_factor" in key


def mark_only_adapter_as_trainable(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad = adapter_filter(name)
