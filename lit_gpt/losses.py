"""The training losses: summed next-token cross-entropy over the labelled positions, in float32 and in chunks.

`lit_gpt.training.fit` divides the sums by the optimizer step's target-token count, so the logged loss is the mean
per target token over the whole step on every backend. Mixture-of-experts models add the router's
load-balancing loss (`MoETerms`) and report each expert's load (`write_expert_load`)."""

import csv
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from lit_gpt.batches import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-ignored labels, in float32, in chunks of rows so that the
    float32 copy of a (rows, vocab) block never exists whole."""
    logits = logits.reshape(-1, logits.size(-1))
    labels = labels.reshape(-1)
    parts = [
        nn.functional.cross_entropy(lc.float(), tc, ignore_index=IGNORE_INDEX, reduction="sum")
        for lc, tc in zip(logits.split(chunk_rows), labels.split(chunk_rows))
    ]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def labelled_rows(labels: torch.Tensor) -> Optional[torch.Tensor]:
    """Flat indices of the positions that have a label, or None when all have one. The loop takes them from the
    host batch before it goes to the device: a `nonzero` of device labels makes the host wait for the GPU (the
    result's size must be known) once per micro-batch."""
    flat = labels.reshape(-1)
    rows = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    return None if rows.numel() == flat.numel() else rows


def loss_sum(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, targets_only: bool = True,
    rows: Optional[torch.Tensor] = None,
    **documents: torch.Tensor,
) -> torch.Tensor:
    """Summed next-token cross-entropy over the labelled positions of a batch (`documents`: packed rows' positions
    and segments, passed to the model).

    With `targets_only` the vocabulary projection (the largest matmul of a small model) runs only on the positions
    that have a label: not on the masked prompts nor on the padding. That makes the shape data-dependent, which
    tracing backends avoid (their runtime says `targets_only = False`). `rows`: `labelled_rows(labels)`, already
    on the device (computed from `labels` here when not given)."""
    if targets_only:
        rows = labelled_rows(labels) if rows is None else rows
        if rows is not None:
            if rows.numel() == 0:  # nothing to learn in this batch: a zero loss that still has a graph
                return model(input_ids[:, :1], **{k: v[:, :1] for k, v in documents.items()}).sum() * 0.0
            logits = model(input_ids, head_rows=rows, **documents)
            return cross_entropy_sum(logits, labels.reshape(-1).index_select(0, rows))
    return cross_entropy_sum(model(input_ids, **documents), labels)


# ---------------------------------------------------------------------------------------------------------------
# Mixture-of-experts models: the router's load-balancing loss and the per-expert load (lit_gpt.moe)
# ---------------------------------------------------------------------------------------------------------------
def token_mask(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, the real input positions of a right-padded micro-batch (transformers' attention mask): every
    position up to the last labelled one of its row. Padding (and a row `pad_rows` added) has no label after it;
    a masked prompt does (its response follows), so it counts as real, as in transformers. Computed from the host
    labels, before the batch goes to the device: no host read inside the step."""
    labelled = (labels != IGNORE_INDEX).to(torch.int32)
    return labelled.flip(-1).cumsum(-1).flip(-1) > 0


class MoETerms:
    """The mixture-of-experts part of the training loop, for a model with MoE layers.

    Objective: each micro-batch adds `coef / accum` x its load-balancing loss (`lit_gpt.moe.load_balancing_loss`,
    transformers' `load_balancing_loss_func` over the micro-batch's real tokens, `token_mask`) to its share of the
    mean cross-entropy, so a step minimises mean CE per target token + coef x the mean aux loss over the step's
    micro-batches. No `grad_scale` on it: DDP/FSDP average the processes' gradients, which is already the mean over
    every process's micro-batches (each process routes its own rows); an SPMD program (XLA) routes the global
    micro-batch once. The aux loss is a function of a whole micro-batch (fractions of its tokens), so it depends on
    how many rows one forward holds (micro_batch_size x the devices a forward spans); the CE does not.

    The routing comes from the forward's return (`GPT.forward(..., return_routing=True)`), not from the modules:
    the loop hands the objective `forward` (a `RoutedModel` of the loop's model), which calls the model that way,
    gives the objective the logits as before and keeps the routing of the micro-batch's forward with gradient (not
    DPO's no-grad reference forward) for `micro_batch`.

    Logs: the running sums (mean aux loss per step, assignments and drops per layer and expert) stay on the device
    and are read at log steps only, like the loss."""

    def __init__(self, model: nn.Module, coef: float, accum: int, zeros: Callable[..., torch.Tensor],
                 wrapped: Optional[nn.Module] = None) -> None:
        from lit_gpt.moe import moe_layers

        config = model.config
        self.forward = RoutedModel(model if wrapped is None else wrapped)  # what the objective calls
        self.model, self.coef, self.accum, self.zeros = model, float(coef), accum, zeros
        self.layers = [i for i in range(config.n_layer) if config.is_moe_layer(i)]
        self.n_expert = config.n_expert
        self.moe_modules = moe_layers(model)
        assert len(self.moe_modules) == len(self.layers), "every MoE layer of the config is a lit_gpt.moe.MoE"
        self.reset()

    @staticmethod
    def of(model: nn.Module, accum: int, zeros: Callable[..., torch.Tensor], wrapped: Optional[nn.Module] = None
           ) -> Optional["MoETerms"]:
        """The terms for `model` (the plain module; `wrapped`: as the loop calls it, Fabric's), or None for a dense
        model."""
        config = getattr(model, "config", None)
        if not getattr(config, "n_expert", 0):
            return None
        return MoETerms(model, config.router_aux_loss_coef, accum, zeros, wrapped)

    def reset(self) -> None:
        self.aux = self.zeros(())
        self.assigned = self.zeros((len(self.layers), self.n_expert))
        self.dropped = self.zeros((len(self.layers), self.n_expert))

    def micro_batch(self, mask: torch.Tensor, routing: Optional[Sequence[Any]] = None) -> Optional[torch.Tensor]:
        """After a micro-batch's forward: its term of the objective (None when the coefficient is 0), with the
        routing its forward returned (default: what `forward` took from it) added to the running sums. `mask`:
        `token_mask` on the device."""
        from lit_gpt.moe import expert_load, load_balancing_loss

        routing = self.forward.take() if routing is None else routing
        if not routing:
            return None
        n = routing[0].probs.size(0)
        if mask.numel() != n:  # a forward on fewer positions (loss_sum's empty batch: the first one of each row)
            mask = mask[:, : n // mask.size(0)]
        aux = load_balancing_loss(routing, mask)
        load = expert_load(routing, mask)
        self.aux += aux.detach().float() / self.accum
        self.assigned += load["assigned"]
        self.dropped += load["dropped"]
        return aux * (self.coef / self.accum) if self.coef > 0 else None

    def read(self, steps: int, combine: Callable[[List[float], bool], List[float]]
             ) -> Tuple[Dict[str, float], torch.Tensor]:
        """At a log step: the metrics ({aux_loss: mean per step, expert_load_max / _min: the most and least loaded
        expert's share of its layer's assignments over an even share (1 = balanced), expert_dropped: the fraction
        of assignments dropped by capacity}) and the (layers, experts, 2) assigned/dropped counts, over the steps
        since the last log step; the sums start again. `combine(values, mean)`: over processes (their mean or
        sum)."""
        E, L = self.n_expert, len(self.layers)
        aux = combine([float(self.aux.cpu())], True)[0] / steps
        counts = torch.stack([self.assigned, self.dropped], dim=-1).cpu().double()  # (L, E, 2)
        counts = torch.tensor(combine(counts.reshape(-1).tolist(), False), dtype=torch.float64).view(L, E, 2)
        self.reset()
        assigned = counts[..., 0]
        share = assigned * E / assigned.sum(dim=1, keepdim=True).clamp(min=1.0)
        metrics = {"aux_loss": aux, "expert_load_max": float(share.max()), "expert_load_min": float(share.min()),
                   "expert_dropped": float(counts[..., 1].sum() / assigned.sum().clamp(min=1.0))}
        return metrics, counts


class RoutedModel(nn.Module):
    """A model as an objective calls it (the logits, `model(...)`'s signature), which asks the forward for the MoE
    routing (`return_routing=True`) and keeps the one of the last forward with gradient until `take`: the loop's
    way of reading what the forward returned without changing the objectives' calls. The model is a submodule, so
    what walks its modules (DPO's `adapters_disabled`) sees it as it is."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.routing: Tuple = ()

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits, routing = self.model(*args, return_routing=True, **kwargs)
        if torch.is_grad_enabled():  # the forward the objective differentiates, not a no-grad reference one
            self.routing = routing
        return logits

    def take(self) -> Tuple:
        """The routing of the last forward with gradient since the previous call (empty if none)."""
        routing, self.routing = self.routing, ()
        return routing


LOAD_FILE = "expert_load.csv"
LOAD_COLUMNS = ("step", "layer", "expert", "assigned", "dropped", "load")


def write_expert_load(folder: Path, step: int, layers: Sequence[int], counts: torch.Tensor) -> Path:
    """Append one log step's per-layer, per-expert counts to `folder/expert_load.csv` (the header first): the
    assignments (token, choice) of the real tokens over the steps since the previous log step, those dropped by
    capacity, and the load (the expert's share of its layer's assignments over an even share; 1 = balanced).
    `layer` is the block index."""
    path = Path(folder) / LOAD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    E = counts.size(1)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(LOAD_COLUMNS)
        for li, layer in enumerate(layers):
            total = max(float(counts[li, :, 0].sum()), 1.0)
            for e in range(E):
                a, d = float(counts[li, e, 0]), float(counts[li, e, 1])
                writer.writerow((step, layer, e, int(round(a)), int(round(d)), f"{a * E / total:.6g}"))
    return path
