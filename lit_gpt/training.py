"""The finetuning loop shared by `finetune/{full,lora,adapter,adapter_v2}.py` (and, for its device-agnostic parts,
by the XLA recipes).

A recipe builds its model and says which parameters train and what gets saved (a `Method`); everything else is
here: the Fabric set-up, loading the base weights, the optimizer and its warmup + cosine schedule, the data
streams, `fit` (gradient accumulation, clipping, logging, validation with a generated sample, checkpoints), and
resuming.

Checkpoints. `out_dir/step-000010/` holds `method.weights_file` = {"model": the trained weights only,
"optimizer": ..., "train_state": {"step", "data": (epoch, index), "rng": per-rank RNG states, ...}, plus the
method's metadata}, next to a copy of the base model's config and tokenizer files. It is written into
`out_dir/.step-000010.partial/` and renamed when complete, so a killed run never leaves a half checkpoint that
`--resume auto` would pick. `out_dir/final/` holds the trained weights without optimizer state: the deliverable
that the generate recipes load.
"""

import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Type, Union

import lightning as L
import torch
import torch.nn as nn

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.config import Config
from lit_gpt.data import IGNORE_INDEX, PreparedData, TrainBatches, count_cropped, load_prepared, val_batches
from lit_gpt.utils import LitError, check_checkpoint_dir, chunked_cross_entropy, load_state_dict, num_parameters

Precision = Literal["32-true", "bf16-true", "bf16-mixed", "16-true", "16-mixed"]
STEP_DIR = re.compile(r"^step-(\d+)$")
FINAL_DIR = "final"
COPIED_FILES = (
    "lit_config.json",
    "config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


# ---------------------------------------------------------------------------------------------------------------
# What differs between methods
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Method:
    """The method-specific part of a finetuning run."""

    name: str
    """"full", "lora", "adapter", "adapter_v2"."""
    weights_file: str
    """File name of the trained weights in each checkpoint directory (e.g. "lit_model.pth.lora")."""
    save_filter: Optional[Callable[[str, Any], bool]] = None
    """Which state-dict entries are saved (None: all, for full finetuning)."""
    metadata: Dict[str, Any] = field(default_factory=dict)
    """Saved beside "model" in the weights file (for PEFT: `lit_gpt.peft.finetuned_metadata(model)`)."""

    @property
    def trains_all(self) -> bool:
        return self.save_filter is None


# ---------------------------------------------------------------------------------------------------------------
# Fabric
# ---------------------------------------------------------------------------------------------------------------
def setup_fabric(
    devices: int,
    precision: Optional[str],
    out_dir: Path,
    logger_name: Literal["csv", "tensorboard"] = "csv",
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    block_cls: Optional[Type[nn.Module]] = None,
    accelerator: str = "auto",
) -> L.Fabric:
    """Fabric for the run: one device, or several with FSDP (sharding per `block_cls`) on GPUs and DDP on the CPU,
    where Fabric has no FSDP."""
    if devices < 1:
        raise LitError(f"--devices must be >= 1 (got {devices})")
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and devices > torch.cuda.device_count():
        raise LitError(f"--devices {devices} but only {torch.cuda.device_count()} GPU(s) are visible")
    if precision is None:
        precision = "bf16-true" if accelerator == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    if strategy == "auto":
        strategy = "fsdp" if devices > 1 and accelerator == "cuda" else ("ddp" if devices > 1 else "auto")
    if strategy == "fsdp":
        if accelerator != "cuda":
            raise LitError("FSDP needs GPUs (Lightning Fabric supports it on CUDA only): use --strategy ddp on the CPU")
        from lightning.fabric.strategies import FSDPStrategy

        strategy_obj: Any = FSDPStrategy(
            auto_wrap_policy={block_cls} if block_cls is not None else None,
            state_dict_type="full",  # one consolidated file, like the single-device runs write
            sharding_strategy="FULL_SHARD",
            limit_all_gathers=True,
            cpu_offload=False,
        )
    elif strategy == "ddp":
        from lightning.fabric.strategies import DDPStrategy

        # the rope and KV caches are buffers computed identically on every rank: broadcasting them each forward
        # would only cost time
        strategy_obj = DDPStrategy(broadcast_buffers=False)
    else:
        strategy_obj = "auto"
    logger = make_logger(out_dir, logger_name)
    if accelerator == "cuda":
        torch.set_float32_matmul_precision("high")
    return L.Fabric(
        accelerator=accelerator, devices=devices, strategy=strategy_obj, precision=precision, loggers=logger
    )


def make_logger(out_dir: Path, name: str) -> Any:
    """The CSV or TensorBoard logger under out_dir/logs (the GPU/CPU and the XLA recipes log alike)."""
    if name == "csv":
        from lightning.fabric.loggers import CSVLogger

        return CSVLogger(root_dir=Path(out_dir) / "logs", name="csv", flush_logs_every_n_steps=1)
    if name == "tensorboard":
        from lightning.fabric.loggers import TensorBoardLogger

        return TensorBoardLogger(root_dir=Path(out_dir) / "logs", name="tensorboard")
    raise LitError(f"--logger_name must be 'csv' or 'tensorboard', got {name!r}")


def uses_fsdp(fabric: L.Fabric) -> bool:
    from lightning.fabric.strategies import FSDPStrategy

    return isinstance(fabric.strategy, FSDPStrategy)


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------
def load_config(checkpoint_dir: Path, config_cls: Type[Config] = Config, **overrides: Any) -> Config:
    """The checkpoint's config as `config_cls` (a variant's Config for PEFT) with the method's settings."""
    check_checkpoint_dir(checkpoint_dir)
    try:
        return config_cls.from_checkpoint(checkpoint_dir, **overrides)
    except FileNotFoundError as e:
        raise LitError(str(e)) from e
    except (ValueError, TypeError) as e:
        raise LitError(f"invalid settings for {str(checkpoint_dir)!r}: {e}") from e


def load_base_weights(
    model: nn.Module, checkpoint_dir: Path, own_filter: Optional[Callable[[str, Any], bool]], assign: bool
) -> None:
    """Load the base `lit_model.pth` into `model` (not yet set up by Fabric). Only the method's own parameters
    may be missing from it. With `assign` (CPU), the parameters become the memory-mapped tensors of the file
    instead of copies of them: the frozen weights then exist once in memory."""
    path = check_checkpoint_dir(checkpoint_dir)
    state = load_state_dict(path)
    state = state.get("model", state)
    try:
        result = model.load_state_dict(state, strict=False, assign=assign)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise LitError(f"checkpoint {str(path)!r} does not match the model config ({first})") from e
    if result.unexpected_keys:
        raise LitError(f"checkpoint {str(path)!r} has weights the model lacks (e.g. {result.unexpected_keys[0]!r})")
    own = own_filter or (lambda k, v: False)
    missing = [k for k in result.missing_keys if not own(k, None)]
    if missing:
        raise LitError(f"checkpoint {str(path)!r} lacks {len(missing)} weights of the model (e.g. {missing[0]!r})")
    _initialize_unloaded(model, set(result.missing_keys))


def _initialize_unloaded(model: nn.Module, missing: set) -> None:
    """Initialise the modules whose own parameters all stayed out of the checkpoint (e.g. the adapter's prompt
    embedding): the model was built without running `nn.init` (Lightning's empty init), which leaves them
    uninitialised. The variants create parameters that share a module with base weights with plain tensor ops
    (`uniform_`, `zeros`), which empty init does not skip."""
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
        if names and all(n in missing for n in names) and hasattr(module, "reset_parameters"):
            module.reset_parameters()


def setup_model(
    fabric: L.Fabric,
    build: Callable[[], nn.Module],
    checkpoint_dir: Path,
    own_filter: Optional[Callable[[str, Any], bool]] = None,
    mark_trainable: Optional[Callable[[nn.Module], None]] = None,
) -> Tuple[nn.Module, nn.Module]:
    """Build the model, load the base weights, freeze what the method does not train (`mark_trainable`), and set
    it up with Fabric. `own_filter` names the method's own parameters, the only ones the base checkpoint lacks.
    Returns (the Fabric-wrapped model, the plain module)."""
    if uses_fsdp(fabric):
        # FSDP materialises (and shards) the meta-initialised model itself; the weights are loaded after sharding
        with fabric.init_module(empty_init=True):
            model = build()
        if mark_trainable is not None:
            mark_trainable(model)
        wrapped = fabric.setup_module(model)
        fabric.load_raw(check_checkpoint_dir(checkpoint_dir), wrapped, strict=own_filter is None)
        return wrapped, model
    # no random init of weights that the checkpoint overwrites: faster, and on the CPU (where the weights are
    # assigned from the memory-mapped file) the never-touched empty tensors never take memory
    with fabric.init_module(empty_init=True):
        model = build()
    load_base_weights(model, checkpoint_dir, own_filter, assign=fabric.device.type == "cpu")
    if mark_trainable is not None:
        mark_trainable(model)
    n_train, n_frozen = num_parameters(model, requires_grad=True), num_parameters(model, requires_grad=False)
    fabric.print(f"Parameters: {n_train:,} trainable, {n_frozen:,} frozen")
    if n_train == 0:
        raise LitError("the model has no trainable parameters: check the method's settings")
    return fabric.setup_module(model), model


# ---------------------------------------------------------------------------------------------------------------
# Optimizer and schedule
# ---------------------------------------------------------------------------------------------------------------
def build_optimizer(model: nn.Module, train: TrainArgs) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters. Norms, biases and other 1-D parameters get no weight decay."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    device = (decay or no_decay)[0].device
    # fused kernels on GPU/CPU; XLA and others take the default implementation
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        groups, lr=train.learning_rate, betas=(train.beta1, train.beta2), fused=fused or None
    )


def lr_at(step: int, total_steps: int, warmup_steps: int, max_lr: float, min_lr: float) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup over `warmup_steps` (capped at the run's
    length), then cosine decay from `max_lr` to `min_lr` at the last step."""
    warmup_steps = min(warmup_steps, total_steps)
    if step < warmup_steps:
        return max_lr * (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class RunData:
    train: TrainBatches
    val: List[Dict[str, Any]]
    max_seq_length: int
    prepared: PreparedData
    sample_prompt: Optional[torch.Tensor]
    """The prompt of the first validation sample (its masked prefix): generated from at each validation."""


def load_data(
    fabric: Any,
    data: DataArgs,
    train: TrainArgs,
    eval: EvalArgs,
    checkpoint_dir: Path,
    block_size: int,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> RunData:
    """Read the prepared data, pick the run's max_seq_length, and build this rank's train/val batches.

    max_seq_length is `--train.max_seq_length` if given (longer samples are cropped, and counted), else the
    longest sample; at most the model's context length."""
    rank = fabric.global_rank if rank is None else rank
    world_size = fabric.world_size if world_size is None else world_size
    prepared = load_prepared(data.data_dir, checkpoint_dir)
    if not prepared.train:
        raise LitError(f"{str(data.data_dir)!r} has no training samples")
    longest = max(s["input_ids"].numel() for s in prepared.train + prepared.val) - 1
    if train.max_seq_length is not None:
        if train.max_seq_length > block_size:
            raise LitError(
                f"--train.max_seq_length {train.max_seq_length} exceeds the model's context length {block_size}"
            )
        max_seq_length = min(train.max_seq_length, longest)
    else:
        max_seq_length = min(longest, block_size)
    cropped = count_cropped(prepared.train, max_seq_length) + count_cropped(prepared.val, max_seq_length)
    if cropped:
        print(f"note: {cropped} sample(s) are longer than max_seq_length {max_seq_length} and get cropped",
              file=sys.stderr) if rank == 0 else None
    pad = dict(pad_multiple=data.pad_multiple, pad_pow2=data.pad_pow2)
    batches = TrainBatches(
        prepared.train,
        train.micro_batch_size,
        max_seq_length,
        seed=train.seed,
        shuffle=data.shuffle,
        rank=rank,
        world_size=world_size,
        **pad,
    )
    val = val_batches(
        prepared.val,
        train.micro_batch_size,
        max_seq_length,
        max_iters=eval.max_iters,
        rank=rank,
        world_size=world_size,
        **pad,
    )
    sample_prompt = None
    if prepared.val:
        first = prepared.val[0]
        masked = (first["labels"] == IGNORE_INDEX).nonzero()
        # the prompt is the masked prefix; unmasked data (--mask_inputs false) has no marked prompt
        n_prompt = int(masked.max()) + 1 if masked.numel() and first["labels"][0] == IGNORE_INDEX else 0
        if n_prompt:
            sample_prompt = first["input_ids"][:n_prompt]
    return RunData(batches, val, max_seq_length, prepared, sample_prompt)


# ---------------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------------
def loss_fn(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, targets_only: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy over the unmasked labels.

    With `targets_only` the vocabulary projection (the largest matmul of a small model) runs only on the positions
    that have a label, row by row: not on the masked prompts nor on the padding. That makes the shape
    data-dependent: the XLA recipes pass False."""
    if targets_only:
        flat_labels = labels.reshape(-1)
        rows = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)
        if rows.numel() < flat_labels.numel():
            if rows.numel() == 0:  # nothing to learn in this batch: a zero loss that still has a graph
                return model(input_ids[:, :1]).sum() * 0.0
            logits = model(input_ids, head_rows=rows)
            return chunked_cross_entropy(logits, flat_labels.index_select(0, rows))
    return chunked_cross_entropy(model(input_ids), labels)


@torch.no_grad()
def validate(fabric: L.Fabric, model: nn.Module, batches: List[Dict[str, Any]]) -> float:
    """Mean cross-entropy per target token over the validation batches of all ranks."""
    model.eval()
    total = torch.zeros(2, device=fabric.device, dtype=torch.float64)
    for batch in batches:
        input_ids, labels = fabric.to_device((batch["input_ids"], batch["labels"]))
        logits = model(input_ids)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total += torch.stack([loss.double(), (labels != IGNORE_INDEX).sum().double()])
    total = fabric.all_reduce(total, reduce_op="sum")
    model.train()
    return float(total[0] / total[1].clamp(min=1))


@torch.no_grad()
def generate_sample(
    model: nn.Module, raw_model: nn.Module, prompt: torch.Tensor, tokenizer: Any, max_new_tokens: int,
    max_seq_length: int, device: torch.device,
) -> str:
    """Greedy continuation of `prompt` (greedy: it draws no random numbers, so resumed runs stay identical)."""
    from lit_gpt.generate import generate

    block_size = raw_model.config.block_size
    max_new_tokens = min(max_new_tokens, block_size - prompt.numel())
    if max_new_tokens <= 0:
        return ""
    model.eval()
    try:
        out = generate(model, prompt.to(device), max_new_tokens, temperature=0.0, stop_ids=tokenizer.stop_ids)
    finally:
        raw_model.clear_kv_cache()
        raw_model.max_seq_length = max_seq_length  # the KV cache resized the RoPE cache for generation
        model.train()
    return tokenizer.decode(out, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------
def step_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step-{step:06d}"


def find_resume_checkpoint(out_dir: Path, weights_file: str) -> Optional[Path]:
    """The newest complete checkpoint directory under `out_dir` (partial ones have another name)."""
    best: Optional[Tuple[int, Path]] = None
    if Path(out_dir).is_dir():
        for d in Path(out_dir).iterdir():
            m = STEP_DIR.match(d.name)
            if m and (d / weights_file).is_file() and (best is None or int(m.group(1)) > best[0]):
                best = (int(m.group(1)), d)
    return None if best is None else best[1]


def copy_model_files(checkpoint_dir: Path, destination: Path) -> None:
    """The base config and tokenizer next to the weights: a checkpoint directory is then self-describing."""
    for name in COPIED_FILES:
        src = Path(checkpoint_dir) / name
        if src.is_file():
            shutil.copy2(src, destination / name)


def _rng_states(fabric: L.Fabric) -> torch.Tensor:
    """(world_size, n) CPU RNG states of all ranks (dropout differs per rank; each resumes its own)."""
    state = torch.get_rng_state()
    if fabric.world_size == 1:
        return state.unsqueeze(0)
    gathered = fabric.all_gather(fabric.to_device(state))
    return gathered.cpu()


def save_checkpoint(
    fabric: L.Fabric,
    directory: Path,
    model: nn.Module,
    method: Method,
    checkpoint_dir: Path,
    optimizer: Optional[torch.optim.Optimizer] = None,
    train_state: Optional[Dict[str, Any]] = None,
    run_config: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write the trained weights (and, for resuming, optimizer + train state) to `directory`, atomically: into
    `.{name}.partial` first, renamed when every rank is done."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.partial")
    if fabric.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    fabric.barrier()
    state: Dict[str, Any] = {"model": model, **method.metadata}
    if optimizer is not None:
        state["optimizer"] = optimizer
    if train_state is not None:
        state["train_state"] = train_state
    filters = {"model": method.save_filter} if method.save_filter is not None else None
    fabric.save(tmp / method.weights_file, state, filter=filters)
    if fabric.global_rank == 0:
        copy_model_files(checkpoint_dir, tmp)
        if run_config is not None:
            (tmp / "finetune.json").write_text(json.dumps(run_config, indent=2, default=str) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    fabric.barrier()
    return directory


def load_checkpoint_state(
    fabric: L.Fabric, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, method: Method
) -> Dict[str, Any]:
    """Restore model weights and optimizer from a step checkpoint; return its train state."""
    path = Path(path)
    file = path / method.weights_file if path.is_dir() else path
    if not file.is_file():
        raise LitError(f"no {method.weights_file} in {str(path)!r}: pass a step-XXXXXX directory of a {method.name} run")
    state: Dict[str, Any] = {"model": model, "optimizer": optimizer, "train_state": None}
    try:
        rest = fabric.load(file, state, strict=False, weights_only=True)
    except (RuntimeError, KeyError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LitError(f"cannot resume from {str(file)!r} ({first})") from e
    if state["train_state"] is None:
        raise LitError(f"{str(file)!r} holds no training state (a final checkpoint?): resume from a step-XXXXXX one")
    if "method" in rest and method.metadata.get("method") not in (None, rest["method"]):
        raise LitError(f"{str(file)!r} was written by a {rest['method']} run, not {method.name}")
    return state["train_state"]


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------
def fit(
    fabric: L.Fabric,
    model: nn.Module,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: RunData,
    method: Method,
    *,
    checkpoint_dir: Path,
    out_dir: Path,
    train: TrainArgs,
    eval: EvalArgs,
    resume: Union[bool, Literal["auto"], Path] = False,
    run_config: Optional[Dict[str, Any]] = None,
    targets_only: bool = True,
) -> Dict[str, Any]:
    """Train until `train.max_steps` (or `train.epochs`) optimizer steps, validating every `eval.interval` steps
    and checkpointing every `train.save_interval` steps and at the end; then write `out_dir/final`.
    Returns a summary (steps, last train/val loss, tokens/s)."""
    from lightning.fabric.utilities.throughput import ThroughputMonitor
    from tqdm import tqdm

    from lit_gpt.tokenizer import Tokenizer

    out_dir = Path(out_dir)
    world = fabric.world_size
    accum = train.gradient_accumulation_iters(world)
    total_steps = train.total_steps(data.train.batches_per_epoch, world)
    tokenizer = Tokenizer(checkpoint_dir)
    raw_model.max_seq_length = data.max_seq_length

    step = 0
    resume_from = _resume_path(resume, out_dir, method)
    if resume_from is not None:
        train_state = load_checkpoint_state(fabric, resume_from, model, optimizer, method)
        step = int(train_state["step"])
        data.train.load_state_dict(train_state["data"])
        rng = train_state["rng"]
        if rng.size(0) != world:
            raise LitError(f"{str(resume_from)!r} was written by {rng.size(0)} processes: resume with --devices {rng.size(0)}")
        torch.set_rng_state(rng[fabric.global_rank].clone())
        fabric.print(f"Resumed from {resume_from} at step {step} (epoch {data.train.epoch}, batch {data.train.index})")
    else:
        # dropout masks differ per rank (the model itself was built from the same seed on every rank)
        torch.manual_seed(train.seed + fabric.global_rank)
    if step >= total_steps:
        fabric.print(f"Nothing to do: the checkpoint is at step {step} of {total_steps}")
    elif step == 0 and eval.initial_validation and data.val:
        val_loss = validate(fabric, model, data.val)
        fabric.log_dict({"val_loss": val_loss, "step": 0}, step=0)
        fabric.print(f"initial validation loss {val_loss:.4f}")

    start_step = step  # the throughput counters start at this run's first step
    config = raw_model.config
    flops_per_token = config.flops_per_token(data.max_seq_length) * (3 if method.trains_all else 2)
    # MFU is reported where Lightning knows the device's peak FLOPs (GPUs/TPUs, not CPUs)
    monitor = ThroughputMonitor(fabric, window_size=max(2, min(50, total_steps // max(1, train.log_interval))))
    running_loss = torch.zeros((), device=fabric.device)  # summed on the device, read only at log steps
    running_n = 0
    train_time = 0.0
    samples = tokens = padded_tokens = logged_padded_tokens = 0
    summary: Dict[str, Any] = {"steps": step, "train_loss": None, "val_loss": None}
    bar = tqdm(total=total_steps, initial=step, desc=f"finetune {method.name}", disable=fabric.global_rank != 0,
               dynamic_ncols=True, file=sys.stdout)
    model.train()
    while step < total_steps:
        t0 = time.perf_counter()
        set_lr(optimizer, lr_at(step, total_steps, train.lr_warmup_steps, train.learning_rate, train.min_lr))
        for micro in range(accum):
            batch = next(data.train)
            input_ids, labels = fabric.to_device((batch["input_ids"], batch["labels"]))
            # only the last micro-batch of a step synchronises gradients across ranks
            with fabric.no_backward_sync(model, enabled=micro < accum - 1):
                loss = loss_fn(model, input_ids, labels, targets_only)
                fabric.backward(loss / accum)
            running_loss += loss.detach()
            running_n += 1
            samples += input_ids.size(0)
            tokens += batch["n_tokens"]
            padded_tokens += input_ids.numel()
        if train.max_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=train.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        train_time += time.perf_counter() - t0
        bar.update(1)

        if step % train.log_interval == 0 or step == total_steps:
            mean_loss = fabric.all_reduce(running_loss / running_n, reduce_op="mean")
            loss_value = float(mean_loss)  # the only host read of the loss
            running_loss.zero_()
            running_n = 0
            monitor.update(time=train_time, batches=step - start_step, samples=samples, lengths=padded_tokens,
                           flops=int(flops_per_token * (padded_tokens - logged_padded_tokens)))
            logged_padded_tokens = padded_tokens
            metrics = {"loss": loss_value, "lr": optimizer.param_groups[0]["lr"], "step": step,
                       "epoch": data.train.epoch, "tokens": tokens * world,
                       "tokens_per_sec": tokens * world / max(train_time, 1e-9)}
            metrics.update(monitor.compute())
            fabric.log_dict(metrics, step=step)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{metrics['lr']:.2e}", tok_s=f"{metrics['tokens_per_sec']:.0f}")
            summary.update(train_loss=loss_value, tokens_per_sec=metrics["tokens_per_sec"])

        if data.val and (step % eval.interval == 0 or (step == total_steps and eval.final_validation)):
            val_loss = validate(fabric, model, data.val)
            fabric.log_dict({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, step=step)
            summary["val_loss"] = val_loss
            text = ""
            if data.sample_prompt is not None and eval.max_new_tokens > 0:
                text = generate_sample(model, raw_model, data.sample_prompt, tokenizer, eval.max_new_tokens,
                                       data.max_seq_length, fabric.device)
            if fabric.global_rank == 0:
                bar.write(f"step {step}: val loss {val_loss:.4f}" + (f" | sample: {text!r}" if text else ""))

        if (train.save_interval is not None and step % train.save_interval == 0) or step == total_steps:
            train_state = {"step": step, "data": data.train.state_dict(), "rng": _rng_states(fabric),
                           "total_steps": total_steps}
            path = save_checkpoint(fabric, step_dir(out_dir, step), model, method, checkpoint_dir, optimizer,
                                   train_state, run_config)
            bar.write(f"saved {path}") if fabric.global_rank == 0 else None
    bar.close()
    summary["steps"] = step
    final = save_checkpoint(fabric, out_dir / FINAL_DIR, model, method, checkpoint_dir, run_config=run_config)
    fabric.print(f"Saved the {method.name} weights to {final / method.weights_file}")
    if fabric.device.type == "cuda":
        fabric.print(f"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")
    return summary


def _resume_path(resume: Union[bool, str, Path], out_dir: Path, method: Method) -> Optional[Path]:
    """`--resume`: False = start fresh; "auto" = the newest checkpoint in out_dir if any; True = the newest one,
    which must exist; a path = that checkpoint."""
    if resume is False or resume is None or resume == "false":
        return None
    if resume in (True, "auto", "true"):
        found = find_resume_checkpoint(out_dir, method.weights_file)
        if found is None and resume != "auto":
            raise LitError(f"--resume: no complete checkpoint in {str(out_dir)!r}; use --resume auto to start fresh")
        return found
    path = Path(resume)
    if not path.exists():
        raise LitError(f"--resume {str(path)!r} does not exist")
    return path


def run_config(**kwargs: Any) -> Dict[str, Any]:
    """The recipe's arguments as JSON-friendly data (written to finetune.json next to the weights)."""
    out = {}
    for k, v in kwargs.items():
        out[k] = asdict(v) if hasattr(v, "__dataclass_fields__") else v
    return out
