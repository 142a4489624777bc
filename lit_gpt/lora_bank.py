"""Many LoRA adapters on one base model, one chosen per row of a batch (as S-LoRA, Sheng et al. 2023,
arXiv:2311.03285, and punica, Chen et al. 2023, arXiv:2310.18547, serve them): every linear layer a LoRA can adapt
(`attn.qkv`, `attn.proj`, the dense MLP's layers) becomes a `BankLinear` that holds the adapters' A and B stacked,
and each forward takes every row's place in the stacks:

    y = base(x) + bmm(bmm(x, A[idx]^T), B[idx]^T)          # x: (rows, T, in), idx: (rows,)

so that requests for different adapters and for the base model share one decode step.

    bank = LoRABank.install(gpt, capacity=4, rank=16, static=False, to_device=runtime.to_device)
    staged = bank.stage(state, config)    # a lit_model.lora.safetensors' tensors laid out for the stacks (checked)
    bank.write(bank.free_row(), adapter_id, staged)   # on the device's thread; `adapter_id` is the caller's key
    bank.select([0, 7, 7, 0])             # each row's adapter id for the forwards that follow (0: the base model)

The stacks: place 0 holds zeros (the base model) and places 1..capacity an adapter each. A fused layer's parts
(q | k | v) get `rank` columns each, so every adapter's update fits whatever parts it adapts: an adapter of lower
rank is padded with zeros, and a layer an adapter does not adapt holds zeros in its place. Each adapter's
alpha / r is folded into its B. The shapes are fixed (`capacity`, `rank`), so on a backend that traces graphs (XLA,
`static`) one graph serves every mix of adapters, and loading one changes values only. On eager backends a forward
whose rows are all the base model skips the update, and so does a layer that no loaded adapter adapts.

Not banked (refused by `stage`, served merged instead): a LoRA of the head (`lora_head`: the head sees flattened
positions, not rows), of the MoE experts (`lora_experts`), and trained biases beside the LoRA matrices.
"""

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from lit_gpt.moe import MoE
from lit_gpt.utils import LitError


@dataclass
class Staged:
    """An adapter's update laid out for the stacks (on the host): per banked layer's name, (A (width, in),
    B (out, width)) with alpha / r folded into B; layers it does not adapt are absent."""

    layers: Dict[str, Tuple[torch.Tensor, torch.Tensor]]
    rank: int


class BankLinear(nn.Module):
    """A linear layer (`nn.Linear`, or the CPU's packed stand-in) plus the bank's per-row low-rank updates. `parts`:
    the output sizes of a fused layer's parts (q, k, v), else (out,); `stack_A` (capacity + 1, rank * parts, in),
    `stack_B` (capacity + 1, out, rank * parts), not in the state dict."""

    def __init__(self, base: nn.Module, bank: "LoRABank", parts: Sequence[int], device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.bank = bank  # a plain object: not a submodule
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = tuple(parts)
        width = bank.rank * len(self.parts)
        self.register_buffer("stack_A", torch.zeros(bank.capacity + 1, width, self.in_features, device=device,
                                                    dtype=dtype), persistent=False)
        self.register_buffer("stack_B", torch.zeros(bank.capacity + 1, self.out_features, width, device=device,
                                                    dtype=dtype), persistent=False)
        self.live: set = set()
        """Rows of the stacks that hold an update of this layer (eager backends skip the layer when none does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.bank.spans is not None:  # a ragged forward (1, N, in): each token group its adapter's update
            shape, y = y.shape, y.reshape(-1, self.out_features)
            flat = x.reshape(-1, self.in_features)
            for place, tokens in self.bank.spans:
                if place in self.live:
                    a = flat.index_select(0, tokens) @ self.stack_A[place].t()
                    y = y.index_add(0, tokens, a @ self.stack_B[place].t())
            return y.view(shape)
        idx = self.bank.index
        if idx is None or not (self.live or self.bank.static):
            return y
        rows = idx.size(0)
        if x.size(0) != rows:
            raise RuntimeError(f"the LoRA bank was given {rows} rows' adapters for a batch of {x.size(0)} rows:"
                               " call bank.select with one adapter per row of the forward")
        a = torch.bmm(x.reshape(rows, -1, self.in_features), self.stack_A.index_select(0, idx).transpose(1, 2))
        return y + torch.bmm(a, self.stack_B.index_select(0, idx).transpose(1, 2)).view(y.shape)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, rank={self.bank.rank}, capacity={self.bank.capacity}"


class LoRABank:
    """The adapters of one model (`install`): which adapter id sits in which place of the stacks, and the places of
    the rows of the next forward (`select`)."""

    def __init__(self, capacity: int, rank: int, static: bool,
                 to_device: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if capacity < 1 or rank < 1:
            raise LitError(f"a LoRA bank needs capacity >= 1 and rank >= 1, got {capacity} and {rank}")
        self.capacity, self.rank, self.static, self.to_device = capacity, rank, static, to_device
        self.layers: Dict[str, BankLinear] = {}
        self.row_of: Dict[int, int] = {}  # adapter id -> its place in the stacks (1..capacity)
        self.index: Optional[torch.Tensor] = None
        """(rows,) places of the rows of the next forward; None: all rows are the base model (eager backends)."""
        self._last: Tuple[Tuple[int, ...], Optional[torch.Tensor]] = ((), None)
        self.spans: Optional[List[Tuple[int, torch.Tensor]]] = None
        """A ragged forward's (eager backends, `select` with `tokens`): per place other than the base, the indices of
        the tokens (of the N) whose sequences take it; None: a forward by rows (`index`)."""

    @classmethod
    def install(cls, gpt: nn.Module, capacity: int, rank: int, static: bool,
                to_device: Callable[[torch.Tensor], torch.Tensor]) -> "LoRABank":
        """Turn the layers of `gpt` (a `lit_gpt.model.GPT`) that a LoRA can adapt into `BankLinear`s with empty
        stacks, on the device and in the dtype of its embeddings; the bank is `gpt.lora_bank`."""
        bank = cls(capacity, rank, static, to_device)
        c = gpt.config
        ref = gpt.transformer.wte.weight
        q_size, kv_size = c.n_head * c.head_size, c.n_query_groups * c.head_size
        for i, block in enumerate(gpt.transformer.h):
            attn = block.attn
            targets = [(attn, "qkv", (q_size, kv_size, kv_size)), (attn, "proj", None)]
            if not isinstance(block.mlp, MoE):  # lora_mlp adapts the dense MLP layers only (as lit_gpt.lora.GPT)
                targets += [(block.mlp, name, None) for name, child in block.mlp.named_children()
                            if hasattr(child, "in_features") and hasattr(child, "out_features")]
            prefix = f"transformer.h.{i}."
            for parent, name, parts in targets:
                child = getattr(parent, name)
                layer = BankLinear(child, bank, parts or (child.out_features,), ref.device, ref.dtype)
                setattr(parent, name, layer)
                bank.layers[prefix + ("attn." if parent is attn else "mlp.") + name] = layer
        gpt.lora_bank = bank
        return bank

    # ------------------------------------------------------------------------------------------------ adapters
    def stage(self, state: Mapping[str, torch.Tensor], config: object) -> Staged:
        """Check an adapter (the tensors of a `lit_model.lora.safetensors` and its `lit_gpt.lora.Config`) against
        the bank and lay it out for the stacks: one LitError line for what cannot be banked or does not fit."""
        r, alpha = int(config.lora_r), float(config.lora_alpha)
        if getattr(config, "lora_head", False):
            raise LitError("adapts the head (lora_head), which is not served per request: serve it merged with"
                           " --lora_path")
        if getattr(config, "lora_experts", False):
            raise LitError("adapts MoE experts (lora_experts), which are not served per request: serve it merged"
                           " with --lora_path")
        if r > self.rank:
            raise LitError(f"has rank {r}, above this server's --max_lora_rank {self.rank}: restart the server with"
                           f" --max_lora_rank {r}")
        others = sorted(k for k in state if not (k.endswith(".lora_A") or k.endswith(".lora_B")))
        if others:
            raise LitError(f"holds weights besides LoRA's (e.g. {others[0]!r}: trained biases), which are not served"
                           " per request: serve it merged with --lora_path")
        qkv = (bool(config.lora_query), bool(config.lora_key), bool(config.lora_value))
        wanted = {"qkv": qkv, "proj": (bool(config.lora_projection),)}
        layers: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        seen = set()
        for name, layer in self.layers.items():
            kind = name.rsplit(".", 1)[1] if ".attn." in name else "mlp"
            enabled = wanted.get(kind, (bool(config.lora_mlp),))
            a, b = state.get(name + ".lora_A"), state.get(name + ".lora_B")
            if a is None and b is None:
                if any(enabled):
                    raise LitError(f"lacks {name}.lora_A / lora_B, which its settings say it adapts: it does not"
                                   " match the settings it records")
                continue
            seen.update((name + ".lora_A", name + ".lora_B"))
            parts = layer.parts
            if len(parts) == 1:
                enabled = (True,)
            out = sum(p for p, e in zip(parts, enabled) if e)
            n = sum(enabled)
            if a is None or b is None or tuple(a.shape) != (r * n, layer.in_features) or tuple(b.shape) != (out, r):
                raise LitError(f"{name}: its LoRA matrices ({None if a is None else tuple(a.shape)},"
                               f" {None if b is None else tuple(b.shape)}) do not fit this model's layer"
                               f" ({layer.in_features} -> {layer.out_features}) at rank {r}: it was finetuned from"
                               " another model")
            full_a = torch.zeros(layer.stack_A.shape[1:], dtype=torch.float32)
            full_b = torch.zeros(layer.stack_B.shape[1:], dtype=torch.float32)
            full_a[: r * n] = a.float()
            column, top, taken = 0, 0, 0
            for size, on in zip(parts, enabled):
                if on:  # this part's B in its rows of the output and its r columns
                    full_b[top: top + size, column: column + r] = b[taken: taken + size].float()
                    column, taken = column + r, taken + size
                top += size
            layers[name] = (full_a, full_b * (alpha / r))
        unknown = sorted(set(state) - seen)
        if unknown:
            raise LitError(f"has LoRA weights this model lacks (e.g. {unknown[0]!r}): it was finetuned from another"
                           " model")
        return Staged(layers, r)

    def free_row(self, reserved: Sequence[int] = ()) -> Optional[int]:
        """A place of the stacks no adapter holds (nor `reserved`), or None when all are taken."""
        taken = set(self.row_of.values()) | set(reserved)
        return next((row for row in range(1, self.capacity + 1) if row not in taken), None)

    @torch.no_grad()
    def write(self, row: int, adapter_id: int, staged: Staged) -> None:
        """Put `staged` in place `row` of every layer's stacks (zeros where it adapts nothing) and map `adapter_id`
        to it; on the device's thread. One copy per layer with a device index (on XLA: one graph for any place)."""
        if not 1 <= row <= self.capacity or adapter_id == 0:
            raise ValueError(f"bank.write: place {row} (1..{self.capacity}), adapter id {adapter_id} (not 0)")
        where = self.to_device(torch.tensor([row]))
        for name, layer in self.layers.items():
            a, b = staged.layers.get(name, (None, None))
            if a is None:
                a, b = torch.zeros(layer.stack_A.shape[1:]), torch.zeros(layer.stack_B.shape[1:])
                layer.live.discard(row)
            else:
                layer.live.add(row)
            layer.stack_A.index_copy_(0, where, self.to_device(a.to(layer.stack_A.dtype).unsqueeze(0)))
            layer.stack_B.index_copy_(0, where, self.to_device(b.to(layer.stack_B.dtype).unsqueeze(0)))
        self.row_of[adapter_id] = row
        self._last = ((), None)

    def clear(self, row: int) -> None:
        """Zeros in place `row` (held by no adapter): on XLA, compiles `write`'s copies before a request waits."""
        self.write(row, -1, Staged({}, 0))
        del self.row_of[-1]

    def release(self, adapter_id: int) -> None:
        """`adapter_id`'s place is free again (call it when no row uses the adapter any more)."""
        row = self.row_of.pop(adapter_id, None)
        if row is not None:
            for layer in self.layers.values():
                layer.live.discard(row)
        self._last = ((), None)

    # ------------------------------------------------------------------------------------------------ per row
    def select(self, adapter_ids: Sequence[int], tokens: Optional[Sequence[int]] = None) -> None:
        """The adapters of the rows of the forwards that follow, one id per row (0, or an id not held: the base
        model). The same places as the last call reuse its device tensor (a static step's input stays put).
        `tokens` (eager backends): a ragged forward (`lit_gpt.kv_cache.Ragged`), whose sequences are laid end to end
        in one row, `tokens[i]` tokens for `adapter_ids[i]`: their tokens are grouped by adapter (`spans`)."""
        rows = tuple(self.row_of.get(i, 0) if i else 0 for i in adapter_ids)
        self.spans = None
        if tokens is not None:
            if self.static:
                raise ValueError("a ragged forward's adapters are selected on eager backends only")
            self.index = None
            if any(rows):
                ends = list(itertools.accumulate(tokens))
                places = sorted(set(rows) - {0})
                self.spans = [(p, self.to_device(torch.cat([torch.arange(e - n, e) for r, n, e in
                                                            zip(rows, tokens, ends) if r == p]))) for p in places]
            return
        if not self.static and not any(rows):
            self.index = None
            return
        if rows != self._last[0]:
            self._last = (rows, self.to_device(torch.tensor(rows, dtype=torch.long)))
        self.index = self._last[1]


def bank_of(gpt: nn.Module) -> Optional[LoRABank]:
    """The `LoRABank` installed in `gpt`, if any."""
    return getattr(gpt, "lora_bank", None)


def select_adapters(gpt: nn.Module, jobs: Sequence[Any], tokens: Optional[Sequence[int]] = None) -> None:
    """The rows of `gpt`'s next forwards, one per entry of `jobs`: each its job's LoRA adapter (`job.adapter`; None,
    a free row: the base model), where `gpt` holds a bank (else nothing to do). What lit_gpt.recipes.serving calls
    before each prefill call and decode step. `tokens`: a ragged forward's tokens per entry (`LoRABank.select`)."""
    bank = bank_of(gpt)
    if bank is not None:
        bank.select([job.adapter if job is not None else 0 for job in jobs], tokens)
