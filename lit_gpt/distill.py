"""Logit distillation: a student learns a teacher's next-token distributions on the responses of SFT data, mixed
with the SFT cross-entropy. An objective of the one training loop (`lit_gpt.training.fit`), used by
finetune/distill.py and xla/finetune/distill.py (their steps: `lit_gpt.recipes.distill`).

Per response token (the positions SFT learns: `labels != -100`), with the student's and the teacher's logits divided
by `temperature` and turned into log-probabilities s and t:

* `forward_kl`: KL(teacher || student) = sum_v p_t (log p_t - log p_s) (classic knowledge distillation; torchtune's
  ForwardKLLoss);
* `jsd`: TRL's generalised Jensen-Shannon divergence (`GKDTrainer.generalized_jsd_loss`, GKD, arXiv 2306.13649) with
  the mixture m = (1 - beta) p_s + beta p_t: beta KL(teacher || m) + (1 - beta) KL(student || m); TRL's end points:
  beta = 0 is KL(teacher || student) (forward), beta = 1 is KL(student || teacher) (reverse).

The step's loss is alpha x distill + (1 - alpha) x SFT cross-entropy, both means per response token of the step
(torchtune's kd_ratio convention: alpha = 1 distils only, alpha = 0 is SFT). Like TRL, the divergence is not
multiplied by temperature^2. Heads padded to different widths past the shared tokenizer's tokens (Qwen2.5's sizes)
are compared over their common columns (`vocab_size`); the cross-entropy is SFT's, over the student's whole head.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.batches import IGNORE_INDEX
from lit_gpt.objectives import Objective, documents
from lit_gpt.utils import LitError

LOSS_TYPES = ("forward_kl", "jsd")


def check_distill(loss: str, beta: float, temperature: float, alpha: float) -> None:
    """The distillation settings, one line for a bad one (before anything loads)."""
    if loss not in LOSS_TYPES:
        raise LitError(f"--distill.loss must be one of {', '.join(LOSS_TYPES)}, got {loss!r}")
    if not 0.0 <= beta <= 1.0:
        raise LitError(f"--distill.beta must be in [0, 1] (TRL's GKD beta: 0 forward KL, 1 reverse KL), got {beta}")
    if not temperature > 0:
        raise LitError(f"--distill.temperature must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise LitError(f"--distill.alpha must be in [0, 1] (the weight of the distillation loss; 1 - alpha: the SFT"
                       f" loss), got {alpha}")


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (...) float32 divergence per position, summed over the vocabulary: TRL's
    `generalized_jsd_loss` before its masking and reduction (same special cases at beta 0 and 1)."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    # F.kl_div(a, b, log_target=True) = exp(b) (b - a) = KL(b || a) per element (PyTorch's argument order)
    if beta == 0:
        div = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        div = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        mixture = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
        div = (beta * F.kl_div(mixture, t, reduction="none", log_target=True)
               + (1 - beta) * F.kl_div(mixture, s, reduction="none", log_target=True))
    return div.sum(dim=-1)


def distill_sums(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, loss: str,
                 beta: float, temperature: float, vocab_size: Optional[int] = None, chunk_rows: int = 512
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N, V) logits of N positions and their (N,) targets -> (summed divergence, summed cross-entropy) over the
    targets that are not -100, in float32 chunks of rows (the (rows, V) float32 copies never exist whole).
    `vocab_size`: the divergence over the first `vocab_size` columns of both (heads of different widths)."""
    beta = 0.0 if loss == "forward_kl" else beta
    div_parts, ce_parts = [], []
    for s, t, y in zip(student_logits.split(chunk_rows), teacher_logits.split(chunk_rows), targets.split(chunk_rows)):
        keep = (y != IGNORE_INDEX).float()
        cut_s, cut_t = (s[:, :vocab_size], t[:, :vocab_size]) if vocab_size else (s, t)
        div_parts.append((generalized_jsd(cut_s, cut_t, beta, temperature) * keep).sum())
        ce_parts.append(F.cross_entropy(s.float(), y, ignore_index=IGNORE_INDEX, reduction="sum"))
    return torch.stack(div_parts).sum(), torch.stack(ce_parts).sum()


@dataclass
class Distill(Objective):
    """Logit distillation from a frozen teacher, mixed with SFT (see the module docstring). The data, batches and
    units (response tokens) are SFT's; `teacher` (a GPT sharing the student's tokenizer, no gradient) is set by the
    recipe before training (`lit_gpt.recipes.distill.attach_teacher`)."""

    loss_type: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    alpha: float = 0.5
    teacher_fingerprint: Optional[str] = None
    teacher_dir: Optional[Any] = None
    """The teacher's checkpoint directory (its fingerprint is the setting a resumed run compares)."""
    teacher: Optional[nn.Module] = None
    vocab_size: Optional[int] = None
    """The columns the divergence compares when the two heads differ in width (None: the whole, equal heads)."""
    teacher_context: Callable[[], Any] = nullcontext
    """The precision's forward context for the teacher (Fabric's autocast for "-mixed"; the student's wrapper
    applies it to the student)."""

    name = "distill"
    stat_names = ("distill_loss", "sft_loss")
    extra_forwards = 1  # the teacher's forward without gradient (counted at the student's size for the MFU)

    def __post_init__(self) -> None:
        check_distill(self.loss_type, self.beta, self.temperature, self.alpha)

    def _teacher_logits(self, input_ids: torch.Tensor, rows: Optional[torch.Tensor], packed: Dict[str, Any]
                        ) -> torch.Tensor:
        if self.teacher is None:  # a recipe step was skipped: never a silent SFT run
            raise RuntimeError("the distillation objective has no teacher: call attach_teacher before training")
        with torch.no_grad(), self.teacher_context():
            if rows is not None:
                return self.teacher(input_ids, head_rows=rows, **packed)
            return self.teacher(input_ids, **packed)

    def _sums(self, model: nn.Module, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor]
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        input_ids, labels, *extra = inputs
        packed = documents(extra)
        if rows is not None:  # eager backends: the heads run on the response positions only
            student = model(input_ids, head_rows=rows, **packed)
            targets = labels.reshape(-1).index_select(0, rows)
        else:  # tracing backends (static shapes): every position, the prompts and padding masked by their labels
            student = model(input_ids, **packed)
            targets = labels.reshape(-1)
        teacher = self._teacher_logits(input_ids, rows, packed)
        student = student.reshape(-1, student.size(-1))
        teacher = teacher.reshape(-1, teacher.size(-1))
        return distill_sums(student, teacher, targets, self.loss_type, self.beta, self.temperature, self.vocab_size)

    def loss(self, model: nn.Module, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if rows is not None and rows.numel() == 0:  # nothing to learn in this micro-batch: a zero loss with a graph
            input_ids = inputs[0]
            zero = model(input_ids[:, :1]).sum() * 0.0
            return zero, torch.zeros(2, device=zero.device)
        div, ce = self._sums(model, inputs, rows)
        loss = self.alpha * div + (1.0 - self.alpha) * ce
        return loss, torch.stack([div.detach(), ce.detach()])

    @torch.no_grad()
    def eval_loss(self, model: nn.Module, inputs: Sequence[torch.Tensor]
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        div, ce = self._sums(model, inputs, None)
        return self.alpha * div + (1.0 - self.alpha) * ce, torch.stack([div, ce])

    def settings(self) -> Optional[Dict[str, Any]]:
        """What the run computes (finetune.json; a resumed run must match): the loss, its settings and the teacher."""
        return {"loss": self.loss_type, "beta": self.beta, "temperature": self.temperature, "alpha": self.alpha,
                "teacher": self.teacher_fingerprint}
