"""LoRA (Hu et al. 2021, arXiv:2106.09685): a frozen linear layer plus a trainable low-rank update,
y = W x + b + (alpha / r) * B A dropout(x), with B initialised to zero so that the model equals the base model
at the start of finetuning.

`GPT(config)` is the base model with the enabled linear layers turned into `LoRALinear`s that reuse the base
weights (state-dict keys unchanged, plus `lora_A` / `lora_B`). The fused `attn.qkv` gets a low-rank update only on
the q/k/v parts switched on in the config. `merge_lora_weights(model)` folds the updates into the weights so the
model runs at base speed; `scripts/merge_lora.py` writes the result as a plain checkpoint.

Mixture-of-experts models (`lit_gpt.moe`): `lora_experts` turns the experts' fc_1 / fc_2 / proj into
`LoRAExpertLinear`s (a rank-r pair per expert, merged like the others); `lora_mlp` adapts the dense MLP layers only
(Qwen3-MoE's `mlp_only_layers`). The router is never adapted: it stays frozen under LoRA.

QLoRA (Dettmers et al. 2023, arXiv:2305.14314): `lit_gpt.quantize.quantize_model(model, "bnb.nf4")` replaces the
frozen base weight of each block's LoRA layer with a bitsandbytes 4-bit one; the layer then multiplies with
bitsandbytes' kernel (`lit_gpt.quantize.linear`) and A, B train in the compute dtype as before. The saved file
holds A and B only, so a QLoRA run's `lit_model.lora.safetensors` merges into the unquantized base like any other.
"""

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.config import Config as BaseConfig
from lit_gpt.convert import HF_SIDE_FILES
from lit_gpt.model import GPT as BaseModel
from lit_gpt.moe import ExpertLinear, MoE, grouped_mm, grouped_mm_offsets
from lit_gpt.peft import base_config, load_variant_model
from lit_gpt.quantize import is_quantized, linear
from lit_gpt.utils import LitError, cannot_write, copy_file_atomic, write_text_atomic
from lit_gpt.weights import save_weights, weights_name


@dataclass
class Config(BaseConfig):
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_query: bool = True
    lora_key: bool = False
    lora_value: bool = True
    lora_projection: bool = False
    lora_mlp: bool = False
    lora_head: bool = False
    lora_experts: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lora_experts and not self.n_expert:
            raise ValueError("lora_experts needs a mixture-of-experts model (this one is dense): leave it out, or"
                             " use lora_mlp for the MLP")
        if self.lora_r <= 0:
            raise ValueError(f"lora_r must be positive, got {self.lora_r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")


class _Merge:
    """merge / unmerge of a layer with `weight`, `merged` and `delta_weight()` (the LoRA update in float32)."""

    weight: torch.Tensor
    merged: bool
    adapters_off = False
    """True inside `adapters_disabled`: the layer computes the base model's output."""
    delta_weight: Callable[[], torch.Tensor]  # each layer's own (LoRALinear, LoRAExpertLinear)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into the weight (computed in float32, rounded once to the weight's dtype)."""
        if is_quantized(self.weight):
            raise LitError("cannot merge LoRA into a quantized base weight: merge into the unquantized checkpoint"
                           " with scripts/merge_lora.py")
        if not self.merged:
            w = self.weight.data
            w.copy_((w.float() + self.delta_weight()).to(w.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            w = self.weight.data
            w.copy_((w.float() - self.delta_weight()).to(w.dtype))
            self.merged = False


class LoRALinear(_Merge, nn.Linear):
    """`nn.Linear` plus a low-rank update. The output may be a fusion of parts (`splits`, e.g. q | k | v sizes) of
    which only the `enabled` ones get an update: each enabled part has its own rank-r pair (A_i, B_i), stored
    stacked: `lora_A` is (r * n_enabled, in_features), `lora_B` is (sum of enabled sizes, r)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        splits: Optional[Sequence[int]] = None,
        enabled: Optional[Sequence[bool]] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.splits = tuple(splits) if splits is not None else (out_features,)
        self.enabled = tuple(enabled) if enabled is not None else (True,) * len(self.splits)
        if sum(self.splits) != out_features or len(self.enabled) != len(self.splits) or not any(self.enabled):
            raise ValueError(f"bad LoRA parts: splits {self.splits}, enabled {self.enabled}, out {out_features}")
        self.r = r
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self._create_lora_parameters(device=self.weight.device, dtype=self.weight.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **lora_kwargs: Any) -> "LoRALinear":
        """Turn `linear` into a LoRA layer that reuses its weight and bias: converting a model allocates only the
        LoRA matrices (built on the meta device first, then given the existing tensors)."""
        new = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", **lora_kwargs
        )
        new.weight, new.bias = linear.weight, linear.bias
        new._create_lora_parameters(device=linear.weight.device, dtype=linear.weight.dtype)
        return new

    def _create_lora_parameters(self, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> None:
        n_enabled = sum(self.enabled)
        enabled_out = sum(s for s, e in zip(self.splits, self.enabled) if e)
        self.lora_A = nn.Parameter(torch.empty(self.r * n_enabled, self.in_features, device=device, dtype=dtype))
        # zeros, so that the model equals the base model until B is trained
        self.lora_B = nn.Parameter(torch.zeros(enabled_out, self.r, device=device, dtype=dtype))
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        with torch.no_grad():
            # nn.Linear's default init (kaiming uniform, a=sqrt(5)); `uniform_` rather than `nn.init`, which
            # Lightning's empty-init context skips: A must never hold garbage (garbage * 0 can be NaN)
            bound = 1.0 / math.sqrt(self.in_features)
            self.lora_A.uniform_(-bound, bound)
            self.lora_B.zero_()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lora_A"):  # nn.Linear.__init__ calls this before the LoRA parameters exist
            self.reset_lora_parameters()

    def _enabled_parts(self):
        """(slot, A_i, B_i) for every enabled part."""
        out_sizes = [s for s, e in zip(self.splits, self.enabled) if e]
        slots = [i for i, e in enumerate(self.enabled) if e]
        return zip(slots, self.lora_A.split(self.r, dim=0), self.lora_B.split(out_sizes, dim=0))

    def delta_weight(self) -> torch.Tensor:
        """The (out_features, in_features) update (alpha / r) * B A, zero on the disabled parts; in float32."""
        rows = [torch.zeros(s, self.in_features, device=self.weight.device) for s in self.splits]
        for slot, a, b in self._enabled_parts():
            rows[slot] = b.float() @ a.float()
        return torch.cat(rows, dim=0) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)  # F.linear, or bitsandbytes' 4-bit product for a QLoRA base
        if self.merged or self.adapters_off:
            return y
        a = self.lora_dropout(x) @ self.lora_A.transpose(0, 1)  # (..., r * n_enabled): all parts in one matmul
        if len(self.splits) == 1:
            return y + (a @ self.lora_B.transpose(0, 1)) * self.scaling
        chunks = list(y.split(self.splits, dim=-1))
        for (slot, _, b), a_i in zip(self._enabled_parts(), a.split(self.r, dim=-1)):
            chunks[slot] = chunks[slot] + (a_i @ b.transpose(0, 1)) * self.scaling
        return torch.cat(chunks, dim=-1)

    def extra_repr(self) -> str:
        parts = "" if len(self.splits) == 1 else f", splits={self.splits}, enabled={self.enabled}"
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling}{parts}"


class LoRAExpertLinear(_Merge, ExpertLinear):
    """`lit_gpt.moe.ExpertLinear` (n_expert linear layers as one (E, out, in) weight) plus a low-rank update per
    expert: `lora_A` (E, r, in), `lora_B` (E, out, r), B zero at the start; y_e = W_e x + b_e + (alpha / r) B_e A_e
    dropout(x), in the batched (bmm) path and in `forward_selected` (each row through its own expert's pair)."""

    def __init__(self, n_expert: int, in_features: int, out_features: int, bias: bool = False, *, r: int,
                 alpha: float, dropout: float = 0.0, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(n_expert, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.r = r
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self._create_lora_parameters(device=self.weight.device, dtype=self.weight.dtype)

    @classmethod
    def from_expert_linear(cls, linear: ExpertLinear, **lora_kwargs: Any) -> "LoRAExpertLinear":
        """Reuse `linear`'s weight and bias (built on the meta device first): converting allocates only A and B."""
        new = cls(linear.n_expert, linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", **lora_kwargs)
        new.weight, new.bias = linear.weight, linear.bias
        new._create_lora_parameters(device=linear.weight.device, dtype=linear.weight.dtype)
        return new

    def _create_lora_parameters(self, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> None:
        E = self.n_expert
        self.lora_A = nn.Parameter(torch.empty(E, self.r, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(E, self.out_features, self.r, device=device, dtype=dtype))
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        with torch.no_grad():  # as LoRALinear: uniform_ (not nn.init, which Lightning's empty init skips), B zero
            bound = 1.0 / math.sqrt(self.in_features)
            self.lora_A.uniform_(-bound, bound)
            self.lora_B.zero_()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lora_A"):  # ExpertLinear.__init__ calls this before the LoRA parameters exist
            self.reset_lora_parameters()

    def delta_weight(self) -> torch.Tensor:
        """The (E, out, in) update (alpha / r) B_e A_e, in float32."""
        return torch.bmm(self.lora_B.float(), self.lora_A.float()) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (E, C, in) -> (E, C, out)."""
        y = super().forward(x)
        if self.merged or self.adapters_off:
            return y
        a = torch.bmm(self.lora_dropout(x), self.lora_A.transpose(1, 2))  # (E, C, r)
        return y + torch.bmm(a, self.lora_B.transpose(1, 2)) * self.scaling

    def forward_grouped(self, x: torch.Tensor, experts: torch.Tensor, bounds: Any) -> torch.Tensor:
        """x: (S, in) rows sorted by expert (`lit_gpt.moe.group_bounds`) -> (S, out)."""
        y = super().forward_grouped(x, experts, bounds)
        if self.merged or self.adapters_off:
            return y
        a = grouped_mm(self.lora_dropout(x), self.lora_A, bounds)  # (S, r)
        return y + grouped_mm(a, self.lora_B, bounds) * self.scaling

    def forward_offsets(self, x: torch.Tensor, experts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x: (S, in) rows sorted by expert, ends: (E,) their groups' end rows (`torch._grouped_mm`) -> (S, out)."""
        y = super().forward_offsets(x, experts, ends)
        if self.merged or self.adapters_off:
            return y
        a = grouped_mm_offsets(self.lora_dropout(x), self.lora_A, ends)  # (S, r)
        return y + grouped_mm_offsets(a, self.lora_B, ends) * self.scaling

    def forward_tiles(self, x: torch.Tensor, tile_experts: torch.Tensor) -> torch.Tensor:
        """x: (T, m, in) tiles of one expert each (`lit_gpt.moe` dropless) -> (T, m, out)."""
        y = super().forward_tiles(x, tile_experts)
        if self.merged or self.adapters_off:
            return y
        E = self.n_expert
        lora_a = F.embedding(tile_experts, self.lora_A.reshape(E, -1)).view(-1, self.r, self.in_features)
        lora_b = F.embedding(tile_experts, self.lora_B.reshape(E, -1)).view(-1, self.out_features, self.r)
        a = torch.bmm(self.lora_dropout(x), lora_a.transpose(1, 2))  # (T, m, r)
        return y + torch.bmm(a, lora_b.transpose(1, 2)) * self.scaling

    def widths(self) -> tuple:
        return self.in_features, self.out_features, self.r

    def forward_selected(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: (M, in), experts: (M,) -> (M, out)."""
        y = super().forward_selected(x, experts)
        if self.merged or self.adapters_off:
            return y
        a = torch.bmm(self.lora_A.index_select(0, experts), self.lora_dropout(x).unsqueeze(-1))  # (M, r, 1)
        return y + torch.bmm(self.lora_B.index_select(0, experts), a).squeeze(-1) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling}"


class GPT(BaseModel):
    peft_method = "lora"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        c = config
        lora = dict(r=c.lora_r, alpha=c.lora_alpha, dropout=c.lora_dropout)
        qkv_enabled = (c.lora_query, c.lora_key, c.lora_value)
        q_size, kv_size = c.n_head * c.head_size, c.n_query_groups * c.head_size
        for block in self.transformer.h:
            attn = block.attn
            if any(qkv_enabled):
                attn.qkv = LoRALinear.from_linear(
                    attn.qkv, splits=(q_size, kv_size, kv_size), enabled=qkv_enabled, **lora
                )
            if c.lora_projection:
                attn.proj = LoRALinear.from_linear(attn.proj, **lora)
            if isinstance(block.mlp, MoE):
                # the router stays a frozen nn.Linear (full finetuning trains it); lora_mlp is the dense layers'
                if c.lora_experts:
                    for name in ("fc_1", "fc_2", "proj"):
                        child = getattr(block.mlp.experts, name)
                        setattr(block.mlp.experts, name, LoRAExpertLinear.from_expert_linear(child, **lora))
            elif c.lora_mlp:
                for name, child in list(block.mlp.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(block.mlp, name, LoRALinear.from_linear(child, **lora))
        if c.lora_head:
            # with tied embeddings the LoRA head shares (and never changes) the embedding matrix
            self.lm_head = LoRALinear.from_linear(self.lm_head, **lora)

    @staticmethod
    def peft_filter(key: str, value: Any = None) -> bool:
        return lora_filter(key, value)


def lora_filter(key: str, value: Any = None) -> bool:
    """The LoRA weights in a state dict (what a LoRA checkpoint holds)."""
    return "lora_" in key


def mark_only_lora_as_trainable(model: nn.Module, bias: Literal["none", "all", "lora_only"] = "none") -> None:
    """Freeze everything but the LoRA matrices; `bias="all"` also trains every bias, `"lora_only"` the biases of
    the LoRA layers (those then go into the finetuned file too: see `lit_gpt.peft.save_finetuned`)."""
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    for name, param in model.named_parameters():
        param.requires_grad = lora_filter(name) or (bias == "all" and name.endswith(".bias"))
    if bias == "lora_only":
        for module in model.modules():
            if isinstance(module, (LoRALinear, LoRAExpertLinear)) and module.bias is not None:
                module.bias.requires_grad = True


def _lora_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExpertLinear))]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every LoRA layer of `model` computes the base model's output (its update left out; the weights are
    untouched): DPO's reference model at no memory cost. Without LoRA layers it changes nothing."""
    layers = _lora_layers(model)
    for layer in layers:
        layer.adapters_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_off = False


def merge_lora_weights(model: GPT, dtype: Optional[torch.dtype] = None) -> None:
    """Fold every LoRA update into its weight, in place; the model then runs without the LoRA matmuls.

    `dtype`: the dtype the model will compute in. Where it is wider than a stored weight (a bf16 base run in
    32-true), that weight is cast to it first and the update folded in after the cast: folded into the bf16 weight,
    the sum would be rounded to bf16, which alone moves the outputs by ~1e-3 relative against the unmerged model.

    A LoRA head on tied embeddings changes the head but not the embedding matrix: the two are untied first
    (and `model.config.tie_embeddings` becomes False, which is what a merged checkpoint must record)."""
    if model.config.tie_embeddings and isinstance(model.lm_head, LoRALinear):
        model.lm_head.weight = nn.Parameter(
            model.lm_head.weight.detach().clone(), requires_grad=model.lm_head.weight.requires_grad
        )
        model.config = replace(model.config, tie_embeddings=False)
    for layer in _lora_layers(model):
        w = layer.weight
        if dtype is not None and not is_quantized(w) and torch.finfo(w.dtype).bits < torch.finfo(dtype).bits:
            layer.weight = nn.Parameter(w.detach().to(dtype), requires_grad=w.requires_grad)
        layer.merge()


def unmerge_lora_weights(model: GPT) -> None:
    """Undo `merge_lora_weights` (up to float rounding); the LoRA matrices train again."""
    for layer in _lora_layers(model):
        layer.unmerge()


def merge_lora_checkpoint(checkpoint_dir: Path, lora_path: Path, out_dir: Optional[Path] = None,
                          allow_other_base: bool = False) -> Path:
    """Write base + LoRA as one standalone checkpoint folder (`lit_model.safetensors`, `lit_config.json`, tokenizer
    files) whose model gives the LoRA model's outputs; `scripts/convert_lit_checkpoint.py` exports it to HF. Returns
    the path of the merged weights (in `out_dir`, default: the LoRA file's folder). A LoRA file that records another
    base than `checkpoint_dir` is refused before anything is written, unless `allow_other_base`."""
    checkpoint_dir, lora_path = Path(checkpoint_dir), Path(lora_path)
    out_dir = lora_path.parent if out_dir is None else Path(out_dir)
    out_path = out_dir / weights_name()
    if out_path.resolve() == lora_path.resolve():
        raise LitError(f"the merged weights would overwrite the LoRA file {str(lora_path)!r}: pass another --out_dir")
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise LitError(f"--out_dir is the base checkpoint {str(checkpoint_dir)!r}: pass another folder")

    model = load_variant_model(GPT, Config, checkpoint_dir, lora_path, allow_other_base=allow_other_base)
    merge_lora_weights(model)
    state = {k: v for k, v in model.state_dict().items() if not lora_filter(k)}
    # the config and tokenizer files first, the weights last: a merge killed on the way leaves no weights file, so
    # nothing in out_dir looks like a complete checkpoint that lacks its config or tokenizer
    config = base_config(model.config)
    try:  # a full disk, a read-only folder: one line, and no partial file
        out_dir.mkdir(parents=True, exist_ok=True)
        config.save(out_dir)
        for name in HF_SIDE_FILES:
            if (checkpoint_dir / name).is_file():
                copy_file_atomic(checkpoint_dir / name, out_dir / name)
        if (checkpoint_dir / "config.json").is_file():
            hf = json.loads((checkpoint_dir / "config.json").read_text())
            if hf.get("tie_word_embeddings") and not config.tie_embeddings:
                hf["tie_word_embeddings"] = False  # a merged LoRA head is no longer the embedding matrix
            write_text_atomic(out_dir / "config.json", json.dumps(hf, indent=2))
        return save_weights(state, out_dir)[-1]  # the file, or the index of its shards
    except OSError as e:
        raise cannot_write(e, out_dir, weights_name()) from None
