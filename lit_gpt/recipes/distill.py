"""The distillation recipes' own steps (finetune/distill.py on CPU/CUDA, xla/finetune/distill.py on XLA devices).
Distillation is an objective of the one training loop (`lit_gpt.distill.Distill`, `lit_gpt.training.fit`), not a
second loop: what is here is only what a distillation run adds to a LoRA or full finetune on SFT data.

    run = finish(flags, run)                       # --method, --teacher_dir, --distill.* -> method and objective
    data = load_run_data(runtime, run)             # the SFT data (scripts/prepare_*.py), as finetune/lora.py reads it
    model ...                                      # the student: LoRA on the frozen base, or every weight
    attach_teacher(fabric, run)                    # the teacher, frozen, in the student's dtype, on the device
    fit(...)                                       # the loop; checkpoints, resume and export as for SFT
"""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Literal, Optional

from lit_gpt.distill import Distill, check_distill
from lit_gpt.peft import base_config
from lit_gpt.recipes.finetune import FinetuneRun, load_config
from lit_gpt.recipes.flags import Flag
from lit_gpt.utils import LitError


@dataclass
class DistillArgs:
    """Logit distillation (finetune/distill.py, xla/finetune/distill.py; `lit_gpt.distill`)."""

    loss: Literal["forward_kl", "jsd"] = "forward_kl"
    """"forward_kl": KL(teacher || student) per response token; "jsd": TRL GKD's generalised Jensen-Shannon
    divergence with --distill.beta."""
    beta: float = 0.5
    """For "jsd": TRL GKD's beta, the teacher's weight in the mixture (0: forward KL, 1: reverse KL)."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the divergence (not multiplied back by its square, as TRL)."""
    alpha: float = 0.5
    """The loss is alpha x distillation + (1 - alpha) x the SFT cross-entropy (torchtune's kd_ratio)."""


METHOD = Flag("method", Literal["lora", "full"], "lora",
              '"lora": LoRA adapters on the frozen base (the --lora_* flags); "full": every weight trains.')
TEACHER_DIR = Flag("teacher_dir", Optional[Path], None,
                   "The teacher: a converted lit checkpoint directory with the student's tokenizer (required).")
DISTILL_FLAG = Flag("distill", DistillArgs, DistillArgs(),
                    "The divergence (forward KL or TRL GKD's JSD), its temperature and its weight against SFT.")
DISTILL_FLAGS = [METHOD, TEACHER_DIR, DISTILL_FLAG]


def check(flags: Dict[str, Any]) -> None:
    """The distillation settings and the teacher against the student, before anything loads: one line each."""
    d: DistillArgs = flags["distill"]
    if flags["method"] not in ("lora", "full"):
        raise LitError(f"--method must be 'lora' or 'full', got {flags['method']!r}")
    check_distill(d.loss, d.beta, d.temperature, d.alpha)
    check_teacher(flags["teacher_dir"], flags["checkpoint_dir"], flags["train"].max_seq_length)


def check_teacher(teacher_dir: Optional[Path], checkpoint_dir: Path, max_seq_length: Optional[int]) -> None:
    """The teacher must be a checkpoint whose tokenizer is the student's (the same ids mean the same tokens) and whose
    context holds the rows the student trains on."""
    from lit_gpt.data import tokenizer_fingerprint
    from lit_gpt.weights import check_checkpoint_dir

    if teacher_dir is None:
        raise LitError("--teacher_dir is required: a converted checkpoint directory whose tokenizer is the student's")
    teacher_dir = Path(teacher_dir)
    check_checkpoint_dir(teacher_dir)
    teacher, student = load_config(teacher_dir), load_config(checkpoint_dir)
    same = tokenizer_fingerprint(teacher_dir) == tokenizer_fingerprint(checkpoint_dir)
    if not same and not same_vocabulary(teacher_dir, checkpoint_dir):
        raise LitError(
            f"the teacher {str(teacher_dir)!r} has another tokenizer than the student {str(checkpoint_dir)!r}"
            " (other tokens at the same ids): logit distillation needs one tokenizer; choose a teacher of the"
            " student's family")
    if teacher.vocab_size != student.vocab_size:  # heads padded to other widths (Qwen2.5 0.5B vs 7B): fine past
        tokens = token_count(checkpoint_dir)      # the tokenizer's last token, compared over the common columns
        if tokens is None or tokens > min(teacher.vocab_size, student.vocab_size):
            raise LitError(
                f"the teacher's head has {teacher.vocab_size} rows and the student's {student.vocab_size}, fewer than"
                f" the tokenizer's {tokens or 'unknown number of'} tokens: logit distillation needs one vocabulary;"
                " choose a teacher of the student's family")
    longest = min(max_seq_length or student.block_size, student.block_size)
    if teacher.block_size < longest:
        raise LitError(f"the teacher's context ({teacher.block_size} tokens) is shorter than the rows the student"
                       f" trains on (up to {longest}): pass --train.max_seq_length {teacher.block_size}")


def same_vocabulary(a: Path, b: Path) -> bool:
    """Whether two checkpoints' tokenizer.json files map the same tokens to the same ids (files that differ in
    bytes only, e.g. saved by another version, still teach a student)."""
    from tokenizers import Tokenizer

    files = [Path(a) / "tokenizer.json", Path(b) / "tokenizer.json"]
    if not all(f.is_file() for f in files):
        return False
    try:
        vocab_a, vocab_b = (Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files)
    except Exception:  # an unreadable tokenizer is not the same one
        return False
    return vocab_a == vocab_b


def token_count(checkpoint_dir: Path) -> Optional[int]:
    """The tokens of a checkpoint's tokenizer.json (added tokens included), or None without one."""
    from tokenizers import Tokenizer

    path = Path(checkpoint_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True) if path.is_file() else None


def finish(flags: Dict[str, Any], run: FinetuneRun) -> FinetuneRun:
    """The run with the chosen method (a full finetune's config without the LoRA fields: its export is a plain
    checkpoint) and the distillation objective (recording the teacher's fingerprint: a resumed run must have the
    same teacher)."""
    from lit_gpt.fingerprint import fingerprint

    d: DistillArgs = flags["distill"]
    method = flags["method"]
    objective = Distill(loss_type=d.loss, beta=d.beta, temperature=d.temperature, alpha=d.alpha,
                        teacher_fingerprint=fingerprint(flags["teacher_dir"]), teacher_dir=Path(flags["teacher_dir"]))
    config = run.config if method == "lora" else base_config(run.config)
    return replace(run, method=method, config=config, objective=objective)


def attach_teacher(fabric: Any, run: FinetuneRun, xla: bool = False) -> None:
    """The teacher, loaded frozen (no gradient, eval mode) in the student's parameter dtype on the device, with the
    precision's forward context (autocast for "-mixed", as the student's wrapper has). On the CPU its weights are the
    memory-mapped file's; on XLA they are staged block by block onto the devices and sharded like the student's.
    Every process holds the whole teacher (under CUDA FSDP too)."""
    from lit_gpt.model import GPT

    objective = run.objective
    if not isinstance(objective, Distill):
        return
    teacher_dir = objective.teacher_dir
    config = load_config(teacher_dir)
    if xla:
        from lit_gpt.recipes.xla_finetune import load_model

        teacher = load_model(fabric, lambda: GPT(config), teacher_dir)
    else:
        from lightning.fabric.utilities.init import _EmptyInit

        from lit_gpt.recipes.finetune import load_base_weights
        from lit_gpt.runtime import param_dtype
        from lit_gpt.utils import cast_floating

        with _EmptyInit(enabled=True):  # no random init of weights the checkpoint overwrites (as setup_model)
            teacher = GPT(config)
        load_base_weights(teacher, teacher_dir, None, assign=fabric.device.type == "cpu")
        cast_floating(teacher, param_dtype(str(fabric.strategy.precision.precision)))
        teacher = teacher.to(fabric.device)
        objective.teacher_context = fabric.autocast
    if config.vocab_size != run.config.vocab_size:  # heads of other widths: their common columns
        objective.vocab_size = min(config.vocab_size, run.config.vocab_size)
    teacher.requires_grad_(False)
    teacher.eval()
    objective.teacher = teacher
    n = sum(p.numel() for p in teacher.parameters())
    fabric.print(f"Teacher: {n:,} parameters from {str(teacher_dir)!r}, {objective.loss_type}"
                 f"{f' (beta {objective.beta})' if objective.loss_type == 'jsd' else ''}, temperature"
                 f" {objective.temperature}, alpha {objective.alpha}")
