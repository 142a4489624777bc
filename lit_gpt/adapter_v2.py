"""LLaMA-Adapter V2 (Gao et al. 2023, arXiv:2304.15010): the LLaMA-Adapter prefix (`lit_gpt.adapter`) plus a
learned scale and bias on every linear layer, y = scale * (W x + b) + bias (scale 1, bias 0 at the start, so the
model equals the base model), and trainable norms.

Every `nn.Linear` of the base model becomes an `AdapterV2Linear` that reuses the base weight (state-dict keys
unchanged, plus `adapter_scale` / `adapter_bias`), except a mixture-of-experts router, which stays frozen as it is.
"""

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt import adapter
from lit_gpt.moe import MoE


@dataclass
class Config(adapter.Config):
    pass


class AdapterV2Linear(nn.Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._create_adapter_parameters(device=self.weight.device, dtype=self.weight.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "AdapterV2Linear":
        """Reuse `linear`'s weight and bias (built on the meta device first): converting allocates only scale/bias."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        new._create_adapter_parameters(device=linear.weight.device, dtype=linear.weight.dtype)
        return new

    def _create_adapter_parameters(self, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> None:
        # torch.ones/zeros rather than nn.init: Lightning's empty-init context skips nn.init, and these must be exact
        self.adapter_scale = nn.Parameter(torch.ones(self.out_features, device=device, dtype=dtype))
        self.adapter_bias = nn.Parameter(torch.zeros(self.out_features, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "adapter_scale"):  # nn.Linear.__init__ calls this before the adapter parameters exist
            with torch.no_grad():
                self.adapter_scale.fill_(1.0)
                self.adapter_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter_scale * F.linear(x, self.weight, self.bias) + self.adapter_bias


class GPT(adapter.GPT):
    peft_method = "adapter_v2"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                # a mixture-of-experts router stays a plain frozen linear layer (a scale on its logits would only
                # change how sharply it routes); the experts are `ExpertLinear`s, not nn.Linear, and stay frozen
                if type(child) is nn.Linear and not (isinstance(parent, MoE) and name == "router"):
                    setattr(parent, name, AdapterV2Linear.from_linear(child))

    @staticmethod
    def peft_filter(key: str, value: Any = None) -> bool:
        return adapter_v2_filter(key, value)


def adapter_v2_filter(key: str, value: Any = None) -> bool:
    """The adapter-v2 weights in a state dict: prefix and gates, linear scales/biases, and the norms."""
    return (
        adapter.adapter_filter(key, value)
        or "adapter_scale" in key
        or "adapter_bias" in key
        or ".norm_1." in key
        or ".norm_2." in key
        or ".post_attention_norm." in key  # Gemma 2/3, OLMo 2 (whose only block norms these and the next are)
        or ".post_mlp_norm." in key
        or ".attn.norm_q." in key  # Qwen3, Gemma 3, OLMo 2
        or ".attn.norm_k." in key
        or "transformer.ln_f." in key
    )


def mark_only_adapter_v2_as_trainable(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad = adapter_v2_filter(name)
