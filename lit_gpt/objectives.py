"""What a training step optimises: the objective of the one loop (`lit_gpt.training.fit`).

An `Objective` says what a batch holds, the loss of a micro-batch (a sum), the count that the step's loss is averaged
over, and what is logged beside the loss. The loop does the rest the same for every objective and backend: the
step's micro-batches are read first and their counts summed over all processes; each micro-batch's summed loss is
divided by that total, so the logged loss and the gradients are those of the mean over the whole step, however it
is split into micro-batches and devices.

* `Objective` itself is supervised finetuning's (every finetune recipe): the summed next-token cross-entropy of the labelled
  positions, averaged per target token. Exactly what the loop computed before objectives existed.
* `DPO` (direct preference optimisation, finetune/dpo.py and xla/finetune/dpo.py): a micro-batch of B preference
  pairs is one forward of 2B rows (the B chosen replies, then the B rejected ones, all after their prompt); the
  summed log-probability of each reply's tokens under the policy and under the reference model give TRL's
  `sigmoid`, `robust` (label smoothing), `hinge` or `ipo` loss per pair (the names and formulas of TRL's
  DPOTrainer), averaged per pair. The reference is either the same model with its LoRA adapters switched off (no
  second copy; one extra forward without gradient per micro-batch), or log-probabilities computed once before
  training (`precompute_reference`) and carried in the batch (any method; no extra forward during training).
  Logged: rewards of the chosen and the rejected replies (beta x the log-ratio to the reference), the reward
  accuracy (chosen above rejected) and margin, means over the step's pairs.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.batches import IGNORE_INDEX, Sample, collate
from lit_gpt.losses import cross_entropy_sum, loss_sum
from lit_gpt.utils import LitError



def has_target(labels: torch.Tensor, max_seq_length: int) -> bool:
    """Whether a sample keeps at least one target token once cropped to max_seq_length inputs."""
    return bool((labels[1 : max_seq_length + 1] != IGNORE_INDEX).any())


def pad_rows(batch: Dict[str, Any], rows: int) -> Dict[str, Any]:
    """Pad a batch to `rows` rows that count nothing (labels ignored), so that it splits over the devices."""
    missing = rows - batch["input_ids"].size(0)
    if missing <= 0:
        return batch
    pad = lambda t, value: torch.cat([t, t.new_full((missing, t.size(1)), value)])  # noqa: E731
    padded = {**batch, "input_ids": pad(batch["input_ids"], 0), "labels": pad(batch["labels"], IGNORE_INDEX)}
    for key in PACKED_KEYS:  # packed rows: padding rows are one padding "document" at positions 0
        if key in batch:
            padded[key] = pad(batch[key], 0)
    return padded


PACKED_KEYS = ("positions", "segments")
"""What a packed batch (`lit_gpt.packing.collate_packed`) adds to the model's inputs."""


def documents(extra: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The model's keyword arguments for packed rows (`positions`, `segments`) from `Objective.inputs`' tail."""
    return dict(zip(PACKED_KEYS, extra))


class Objective:
    """Supervised finetuning's objective, and the interface of every objective (see the module docstring)."""

    name = "sft"
    unit = "target token"
    stat_names: Tuple[str, ...] = ()
    """What `loss` returns beside the summed loss (sums over the micro-batch's units), logged as means."""
    extra_forwards = 0
    """Forwards without gradient per training forward (DPO's reference with adapters off: 1), for the MFU."""

    def load(self, data_dir: Any, checkpoint_dir: Any = None) -> Any:
        """The prepared data (`lit_gpt.data.PreparedData`), checked for this objective (one line when it cannot
        train on it)."""
        from lit_gpt.data import load_prepared

        return load_prepared(data_dir, checkpoint_dir)

    def length(self, sample: Sample) -> int:
        """The inputs a sample needs (its longest row)."""
        return sample["input_ids"].numel() - 1

    def cropped(self, sample: Sample, max_seq_length: int) -> bool:
        return self.length(sample) > max_seq_length

    def keep(self, sample: Sample, max_seq_length: int) -> bool:
        """Whether a sample still teaches something once cropped (samples that do not are left out)."""
        return has_target(sample["labels"], max_seq_length)

    def collate(self, samples: Sequence[Sample], max_seq_length: int, pad_multiple: int = 1,
                pad_pow2: bool = False) -> Dict[str, Any]:
        return collate(samples, max_seq_length, pad_multiple, pad_pow2)

    def pad(self, batch: Dict[str, Any], rows: int) -> Dict[str, Any]:
        """The batch padded to the rows of one forward (`rows` samples) with rows that count nothing."""
        return pad_rows(batch, rows)

    def count(self, batch: Dict[str, Any]) -> int:
        """The units of a (host) batch that the step's loss is averaged over."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def inputs(self, batch: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
        """The host tensors that go to the device (packed rows: also their positions and document ids)."""
        return (batch["input_ids"], batch["labels"], *(batch[k] for k in PACKED_KEYS if k in batch))

    def loss(self, model: nn.Module, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(summed loss, summed stats or None) of one micro-batch. `rows`: the flat indices of the labelled positions
        (`lit_gpt.losses.labelled_rows`, on the device) where the backend computes the head on those only."""
        input_ids, labels, *packed = inputs
        return loss_sum(model, input_ids, labels, targets_only=rows is not None, rows=rows,
                        **documents(packed)), None

    @torch.no_grad()
    def eval_loss(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The validation loss of one batch (no gradient), summed like `loss`."""
        input_ids, labels, *packed = inputs
        return cross_entropy_sum(model(input_ids, **documents(packed)), labels), None

    def metrics(self, stats: Sequence[float], count: float) -> Dict[str, float]:
        """Logged means from summed stats over `count` units."""
        return {name: value / max(count, 1.0) for name, value in zip(self.stat_names, stats)}

    def settings(self) -> Optional[Dict[str, Any]]:
        """What the objective computes, recorded in finetune.json (a resumed run must match); None for SFT."""
        return None

    def rollout(self, runtime: Any, model: nn.Module, batches: List[Dict[str, Any]], evaluate: bool = False
                ) -> List[Dict[str, Any]]:
        """The step's (or a validation) batches before they are counted: unchanged here; GRPO
        (`lit_gpt.recipes.grpo`) samples and scores completions of their prompts."""
        return batches

    def logged(self, prefix: str = "") -> Dict[str, float]:
        """Host values logged beside the loss since the last call (GRPO: rewards, lengths, times); none here."""
        return {}



# ---------------------------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------------------------
LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
REFERENCES = ("auto", "adapters_off", "precomputed")


def sequence_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   rows: Optional[torch.Tensor] = None, chunk_rows: int = 1024) -> torch.Tensor:
    """(R,) float32: the summed log-probability of each row's labelled tokens. With `rows` (flat indices of the
    labelled positions) the head runs on those positions only; else on all (static shapes: XLA)."""
    R, T = labels.shape
    if rows is not None:
        logits = model(input_ids, head_rows=rows)  # (n, V)
        targets = labels.reshape(-1).index_select(0, rows)
        tok = torch.cat([-F.cross_entropy(lc.float(), tc, reduction="none")
                         for lc, tc in zip(logits.split(chunk_rows), targets.split(chunk_rows))])
        return torch.zeros(R, dtype=torch.float32, device=tok.device).index_add(0, rows // T, tok)
    logits = model(input_ids).reshape(R * T, -1)
    flat = labels.reshape(-1)
    tok = torch.cat([-F.cross_entropy(lc.float(), tc, ignore_index=IGNORE_INDEX, reduction="none")
                     for lc, tc in zip(logits.split(chunk_rows), flat.split(chunk_rows))])
    return tok.view(R, T).sum(dim=1)


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, loss_type: str, beta: float, label_smoothing: float = 0.0,
               chosen_tokens: Optional[torch.Tensor] = None, rejected_tokens: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: (loss, chosen reward, rejected reward), TRL's DPOTrainer formulas (trl 1.16, `_compute_loss`).
    `ipo` averages the log-ratios over each reply's tokens (`chosen_tokens`, `rejected_tokens`), as TRL does."""
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "robust":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * delta)
                  + label_smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        ipo_delta = (chosen_ratio / chosen_tokens.clamp(min=1.0)) - (rejected_ratio / rejected_tokens.clamp(min=1.0))
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        raise LitError(f"--dpo.loss must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


@dataclass
class DPO(Objective):
    """Direct preference optimisation (see the module docstring). `reference`: "adapters_off" (the LoRA model with
    its adapters switched off, `lit_gpt.lora.adapters_disabled`) or "precomputed" (the batch carries the reference
    log-probabilities, `precompute_reference`)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "precomputed"

    name = "dpo"
    unit = "pair"
    stat_names = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")

    def __post_init__(self) -> None:
        check_dpo(self.beta, self.loss_type, self.label_smoothing, self.reference)

    @property
    def extra_forwards(self) -> int:  # type: ignore[override]
        return 1 if self.reference == "adapters_off" else 0

    def load(self, data_dir: Any, checkpoint_dir: Any = None) -> Any:
        """Pairs prepared by scripts/prepare_preferences.py (instruction data is refused in one line)."""
        from lit_gpt.preferences import load_preferences

        return load_preferences(data_dir, checkpoint_dir)

    def length(self, sample: Sample) -> int:
        return max(sample["input_ids"].numel(), sample["rejected_input_ids"].numel()) - 1

    def keep(self, sample: Sample, max_seq_length: int) -> bool:
        return has_target(sample["labels"], max_seq_length) and has_target(sample["rejected_labels"], max_seq_length)

    def collate(self, samples: Sequence[Sample], max_seq_length: int, pad_multiple: int = 1,
                pad_pow2: bool = False) -> Dict[str, Any]:
        """One batch of 2B rows: the chosen replies, then the rejected ones (padded to one length); `weights` (B,)
        marks the real pairs; `ref` (2B,) the precomputed reference log-probabilities where the samples carry them."""
        rejected = [{"input_ids": s["rejected_input_ids"], "labels": s["rejected_labels"]} for s in samples]
        batch = collate([*samples, *rejected], max_seq_length, pad_multiple, pad_pow2)
        batch["weights"] = torch.ones(len(samples))
        if self.reference == "precomputed" and all("ref_logps" in s for s in samples):
            ref = torch.stack([s["ref_logps"] for s in samples]).float()  # (B, 2)
            batch["ref"] = torch.cat([ref[:, 0], ref[:, 1]])
        return batch

    def pad(self, batch: Dict[str, Any], rows: int) -> Dict[str, Any]:
        """`rows` pairs (2 x rows rows): padding pairs have no label and weight 0, so they add nothing."""
        pairs = batch["weights"].numel()
        missing = rows - pairs
        if missing <= 0:
            return batch
        halves = lambda t, value: [t[:pairs], t.new_full((missing, *t.shape[1:]), value),  # noqa: E731
                                   t[pairs:], t.new_full((missing, *t.shape[1:]), value)]
        out = {**batch, "input_ids": torch.cat(halves(batch["input_ids"], 0)),
               "labels": torch.cat(halves(batch["labels"], IGNORE_INDEX)),
               "weights": torch.cat([batch["weights"], batch["weights"].new_zeros(missing)])}
        if "ref" in batch:
            out["ref"] = torch.cat(halves(batch["ref"], 0.0))
        return out

    def count(self, batch: Dict[str, Any]) -> int:
        return int(batch["weights"].sum())

    def inputs(self, batch: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
        ref = batch.get("ref")
        if self.reference == "precomputed" and ref is None:  # a recipe step was skipped: never a silent fallback
            raise RuntimeError("the batch has no reference log-probabilities: call with_reference before training")
        return (batch["input_ids"], batch["labels"], batch["weights"]) + ((ref,) if ref is not None else ())

    def _terms(self, policy: torch.Tensor, inputs: Sequence[torch.Tensor], model: nn.Module,
               rows: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        input_ids, labels, weights = inputs[:3]
        if len(inputs) > 3:
            ref = inputs[3]
        else:
            from lit_gpt.lora import adapters_disabled

            with torch.no_grad(), adapters_disabled(model):
                ref = sequence_logps(model, input_ids, labels, rows)
        B = weights.numel()
        tokens = (labels != IGNORE_INDEX).sum(dim=1).float()
        losses, chosen_r, rejected_r = dpo_losses(
            policy[:B], policy[B:], ref[:B], ref[B:], self.loss_type, self.beta, self.label_smoothing,
            tokens[:B], tokens[B:])
        w = weights.to(losses.dtype)
        stats = torch.stack([(chosen_r * w).sum(), (rejected_r * w).sum(), ((chosen_r > rejected_r).float() * w).sum(),
                             ((chosen_r - rejected_r) * w).sum()])
        return (losses * w).sum(), stats

    def loss(self, model: nn.Module, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        policy = sequence_logps(model, inputs[0], inputs[1], rows)
        return self._terms(policy, inputs, model, rows)

    @torch.no_grad()
    def eval_loss(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self._terms(sequence_logps(model, inputs[0], inputs[1]), inputs, model, None)

    def settings(self) -> Optional[Dict[str, Any]]:
        return {"beta": self.beta, "loss": self.loss_type, "label_smoothing": self.label_smoothing,
                "reference": self.reference}


def check_dpo(beta: float, loss_type: str, label_smoothing: float, reference: str) -> None:
    """The DPO settings, one line for a bad one (before anything loads)."""
    if loss_type not in LOSS_TYPES:
        raise LitError(f"--dpo.loss must be one of {', '.join(LOSS_TYPES)} (TRL's names), got {loss_type!r}")
    if not beta > 0:
        raise LitError(f"--dpo.beta must be > 0, got {beta}")
    if label_smoothing and loss_type != "robust":
        raise LitError(f"--dpo.label_smoothing applies to --dpo.loss robust (TRL's robust DPO), not {loss_type!r}:"
                       " set --dpo.loss robust, or leave label_smoothing at 0")
    if not 0 <= label_smoothing < 0.5:
        raise LitError(f"--dpo.label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if reference not in REFERENCES:
        raise LitError(f"--dpo.reference must be one of {', '.join(REFERENCES)}, got {reference!r}")


def split_pass(compute: Callable[[int, int], List[Any]], n: int, rows: int, rank: int = 0, world_size: int = 1,
               gather: Optional[Callable[[Any], List[Any]]] = None) -> Tuple[List[Any], int]:
    """One pass over `n` items computed once across the processes: (the values of all n items in order, how many
    this process computed). `compute(start, stop)` returns the values of items start..stop-1, a chunk of `rows`
    consecutive items: chunk k is computed by process k % world_size (the chunks are those of one process, so each
    value equals the one-process value: the same rows in the same forward), then `gather(obj)` (every process's
    `obj` in rank order, e.g. `lit_gpt.training.gather_objects`) hands every process all values. Every process
    runs the same number of chunks (one with fewer computes its first chunk again and drops it), so a backend that
    steps processes in lockstep keeps them so. Used by DPO's precomputed reference; a teacher pass can use it too."""
    starts = list(range(0, n, rows))
    mine = starts[rank::world_size]
    most = -(-len(starts) // world_size) if starts else 0
    computed: Dict[int, List[Any]] = {}
    for j in range(most):
        start = mine[j] if j < len(mine) else (mine or starts)[0]
        values = list(compute(start, min(start + rows, n)))
        if j < len(mine):
            computed[start] = values
    count = sum(len(v) for v in computed.values())
    if world_size > 1:
        if gather is None:
            raise ValueError("split_pass over several processes needs `gather`")
        for other in gather(computed):
            computed.update(other)
    return [v for start in sorted(computed) for v in computed[start]], count


@torch.no_grad()
def reference_logps(model: nn.Module, objective: DPO, samples: Sequence[Sample], rows: int, max_seq_length: int,
                    place: Any, end_step: Any, pad_multiple: int = 1, pad_pow2: bool = False,
                    progress: Any = None, targets_only: bool = False, rank: int = 0, world_size: int = 1,
                    gather: Optional[Callable[[Any], List[Any]]] = None) -> List[torch.Tensor]:
    """The reference log-probabilities (chosen, rejected) of every sample: the model as it is (before training),
    without dropout, `rows` pairs per forward; the chunks of `rows` pairs are split over `world_size` processes and
    gathered (`split_pass`); `progress(k)` after each forward of k pairs. `place` puts host tensors on the device;
    `end_step` ends a graph. `targets_only` (eager backends): the head runs on the replies' positions only, as in
    the training step."""
    from lit_gpt.losses import labelled_rows

    from lit_gpt.lora import adapters_disabled

    plain = DPO(objective.beta, objective.loss_type, objective.label_smoothing, reference="adapters_off")

    def chunk(start: int, stop: int) -> List[torch.Tensor]:
        group = samples[start:stop]
        batch = plain.pad(plain.collate(group, max_seq_length, pad_multiple, pad_pow2), rows)
        input_ids, labels = place((batch["input_ids"], batch["labels"]))
        head_rows = labelled_rows(batch["labels"]) if targets_only else None
        head_rows = place(head_rows) if head_rows is not None else None
        with adapters_disabled(model):  # the base model (a LoRA model's adapters may have been loaded)
            logps = sequence_logps(model, input_ids, labels, head_rows)
        end_step()
        logps = logps.float().cpu()
        if progress is not None:
            progress(len(group))
        return [torch.stack([logps[j], logps[rows + j]]) for j in range(len(group))]

    was_training = model.training
    model.eval()
    try:
        return split_pass(chunk, len(samples), rows, rank, world_size, gather)[0]
    finally:
        model.train(was_training)
