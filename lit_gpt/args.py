"""Argument groups shared by the finetune recipes (GPU/CPU and XLA).

jsonargparse turns each dataclass into a group of flags: `--train.micro_batch_size 4`, `--eval.interval 50`,
`--data.data_dir data/alpaca`. Keeping them here (instead of module-level globals in every recipe) makes every
hyperparameter settable from the command line and identical across methods.
"""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Literal, Optional, Union

from lit_gpt.utils import LitError


@dataclass
class TrainArgs:
    """Optimisation and checkpointing. Steps are optimizer steps (one step = `global_batch_size` samples)."""

    global_batch_size: int = 16
    """Samples per optimizer step, over all devices; micro-batches are accumulated to reach it. With --data.packing
    true: packed rows of max_seq_length tokens (as torchtune and MaxText count packed sequences)."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass on one device (with --data.packing true: packed rows)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps. When unset, `epochs` decides."""
    epochs: int = 1
    """Passes over the training set, used when `max_steps` is unset. An epoch is floor(samples / global_batch_size)
    optimizer steps on any number of devices (the few samples left over wait for the next epoch's shuffle)."""
    learning_rate: float = 3e-4
    """Peak learning rate, reached after the warmup."""
    min_lr: float = 6e-5
    """The cosine schedule decays from `learning_rate` to `min_lr` at the last step."""
    lr_warmup_steps: int = 100
    """Linear warmup from 0 over this many optimizer steps (capped at the run's length)."""
    weight_decay: float = 0.02
    """AdamW's decoupled weight decay (not applied to norms, biases and other 1-D parameters)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    max_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    max_seq_length: Optional[int] = None
    """Crop samples to this many tokens (default: the length the data was prepared with). With --data.packing true
    every row has exactly this many positions (default: the longest sample's)."""
    save_interval: Optional[int] = 1000
    """Write a resumable checkpoint every this many optimizer steps (and at the last step); None: only at the end."""
    log_interval: int = 1
    """Read the loss back from the device and log it every this many optimizer steps."""
    seed: int = 1337
    """Seeds the model's random parts (LoRA init, dropout) and the data shuffling."""
    compile: bool = False
    """torch.compile the transformer blocks (GPU/CPU recipes; XLA compiles whole steps already). Every block shares
    one graph per padded batch length, so batches are padded to power-of-two lengths (unless --data.pad_multiple
    sets other buckets) and the first step of each length compiles. One process or DDP (not FSDP, not QLoRA)."""

    def validate(self, devices: int) -> None:
        """Raise a LitError for settings that cannot work together."""
        if devices < 1:
            raise LitError(f"--devices (and --num_nodes) must be >= 1 (got {devices} devices in all)")
        for name in ("global_batch_size", "micro_batch_size", "epochs", "log_interval"):
            if getattr(self, name) < 1:
                raise LitError(f"--train.{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_steps is not None and self.max_steps < 1:
            raise LitError(f"--train.max_steps must be >= 1 (got {self.max_steps})")
        if self.save_interval is not None and self.save_interval < 1:
            raise LitError(f"--train.save_interval must be >= 1 or null (got {self.save_interval})")
        if self.global_batch_size % (self.micro_batch_size * devices):
            raise LitError(
                f"--train.global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size"
                f" ({self.micro_batch_size}) x devices ({devices})"
            )
        if self.min_lr > self.learning_rate:
            raise LitError(f"--train.min_lr ({self.min_lr}) is larger than --train.learning_rate ({self.learning_rate})")

    def gradient_accumulation_iters(self, devices: int) -> int:
        """Micro-batches per optimizer step on each device."""
        return self.global_batch_size // (self.micro_batch_size * devices)



@dataclass
class EvalArgs:
    """Validation during training."""

    interval: int = 100
    """Validate every this many optimizer steps."""
    max_iters: int = 100
    """Validation micro-batches in all, split over the devices (the whole validation set if it has fewer)."""
    max_new_tokens: int = 100
    """Tokens generated for the sample shown at each validation; 0 disables the sample."""
    initial_validation: bool = False
    """Validate before the first step (skipped when resuming)."""
    final_validation: bool = True
    """Validate after the last step."""


@dataclass
class DataArgs:
    """Where the prepared data lives (written by `scripts/prepare_*.py`) and how it is batched."""

    data_dir: Path = Path("data/alpaca")
    """Directory with train.pt, val.pt and meta.json: a local folder (a bucket URL is refused; copy it here first)."""
    shuffle: bool = True
    """Reshuffle the training set every epoch (deterministically from --train.seed)."""
    pad_multiple: int = 1
    """Pad each batch to a multiple of this length (1: the longest sample in the batch)."""
    pad_pow2: bool = False
    """Pad each batch to the next power of two (capped at max_seq_length): with XLA the train step then compiles
    once per bucket instead of once per batch length."""
    packing: bool = False
    """Pack samples into rows of exactly --train.max_seq_length tokens, each document attending to itself only
    with its own positions: the same loss and gradients as unpadded samples, without computing padding, and one
    train-step shape (one compilation on XLA). The batch sizes then count rows. Instruction data only (not DPO)."""


@dataclass
class MoEArgs:
    """Training settings of mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss; `lit_gpt.moe`). Given for a dense
    model they are refused (they would change nothing)."""

    capacity_factor: Union[float, Literal["config", "none"], None] = "config"
    """Where the capacity buffers run (see dispatch): tokens each expert takes per forward in training, as a
    multiple of an even share (N tokens x k experts per token / n_expert); assignments beyond it are dropped (the
    token keeps its other experts and the residual) and counted in the logged `expert_dropped`. "config": the checkpoint's moe_capacity_factor (2.0 unless its
    lit_config.json says otherwise); "none" (or null): never drop. Evaluation and generation never drop."""
    dispatch: Literal["auto", "capacity"] = "auto"
    """How the experts get their tokens in training. "auto": grouped by expert on the CPU and CUDA (exact: nothing
    is dropped, capacity_factor unused), capacity buffers of static size where the step is a traced graph (XLA,
    --train.compile). "capacity": the buffers everywhere, so a CPU or GPU run drops what an XLA run drops."""
    router_aux_loss_coef: Optional[float] = None
    """Weight of the router's load-balancing loss (transformers' `router_aux_loss_coef`; logged as `aux_loss`,
    apart from `loss`). None: the checkpoint's (Mixtral 0.02, Qwen3-MoE 0.001, gpt-oss 0.9); 0 switches it off."""

    def given(self) -> bool:
        return self.capacity_factor != "config" or self.router_aux_loss_coef is not None or self.dispatch != "auto"

    def apply(self, config: Any) -> Any:
        """`config` with these settings (a copy; the same object when nothing is given). A LitError for settings on
        a dense model or out of range."""
        if not self.given():
            return config
        if not getattr(config, "n_expert", 0):
            raise LitError("--moe.capacity_factor, --moe.dispatch and --moe.router_aux_loss_coef apply to"
                           f" mixture-of-experts models; {getattr(config, 'name', 'this model')!r} is dense: leave them out")
        changes: Dict[str, Any] = {}
        if self.capacity_factor != "config":
            factor = None if self.capacity_factor in (None, "none") else float(self.capacity_factor)
            if factor is not None and not factor > 0:
                raise LitError(f'--moe.capacity_factor must be > 0, "none" or "config" (got {self.capacity_factor})')
            changes["moe_capacity_factor"] = factor
        if self.dispatch != "auto":
            if self.dispatch != "capacity":
                raise LitError(f'--moe.dispatch must be "auto" or "capacity" (got {self.dispatch!r})')
            changes["moe_dispatch"] = "capacity"
        if self.router_aux_loss_coef is not None:
            if not self.router_aux_loss_coef >= 0:
                raise LitError(f"--moe.router_aux_loss_coef must be >= 0 (got {self.router_aux_loss_coef})")
            changes["router_aux_loss_coef"] = float(self.router_aux_loss_coef)
        return replace(config, **changes)


@dataclass
class DPOArgs:
    """Direct preference optimisation (finetune/dpo.py, xla/finetune/dpo.py; `lit_gpt.objectives.DPO`): TRL's
    DPOTrainer settings under TRL's names."""

    beta: float = 0.1
    """How far the policy may move from the reference (higher: closer). For "ipo", the regulariser tau."""
    loss: Literal["sigmoid", "robust", "hinge", "ipo"] = "sigmoid"
    """"sigmoid": DPO; "robust": DPO with label_smoothing as the chance that a pair's label is flipped; "hinge": SLiC;
    "ipo": IPO (log-ratios averaged over each reply's tokens, as TRL does)."""
    label_smoothing: float = 0.0
    """For "robust" only: the assumed fraction of flipped labels, in [0, 0.5)."""
    reference: Literal["auto", "adapters_off", "precomputed"] = "auto"
    """The reference model. "adapters_off" (LoRA): the model with its adapters switched off (no second copy; one
    extra forward without gradient per micro-batch). "precomputed": log-probabilities of every pair under the base
    model computed once before training (one forward pass over the data; kept in out_dir/reference_logps.pt for
    resuming). "auto": adapters_off for LoRA, precomputed for full finetuning."""

    def resolve(self, method: str) -> str:
        """The reference used for `method` ("lora" or "full"); a LitError for adapters_off without adapters."""
        if self.reference == "auto":
            return "adapters_off" if method == "lora" else "precomputed"
        if self.reference == "adapters_off" and method != "lora":
            raise LitError("--dpo.reference adapters_off needs LoRA adapters (--method lora): full finetuning changes"
                           " the base weights themselves; use --dpo.reference precomputed")
        return self.reference
