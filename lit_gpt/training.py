"""The finetuning loop of every recipe: `finetune/{full,lora,adapter,adapter_v2}.py` on CPU/CUDA and
`xla/finetune/{full,lora,adapter}.py` on XLA devices.

A recipe builds its model and says which parameters train, what gets saved and what a step optimises (a `Method`
with its objective, `lit_gpt.objectives`: supervised finetuning's cross-entropy, or DPO; the set-up steps are
`lit_gpt.recipes.finetune`); here are the warmup + cosine schedule, the data streams, and `fit` (gradient
accumulation, clipping, logging, validation with a generated sample, checkpoints, resuming, the final export).
What differs between backends is a Fabric strategy plus the runtime policy passed in (`lit_gpt.runtime.Runtime`
for CPU/CUDA, `lit_gpt.xla.runtime.XLARuntime`): how a batch is placed, where a graph is cut, how gradients
combine, how a checkpoint is stored, which generators exist. There is no second loop.

The logged training loss is the objective's mean over the whole optimizer step (all micro-batches and all devices),
on every backend: per target token for supervised finetuning, per preference pair for DPO; gradients are those of
that mean. A step's micro-batches are read first, their units (target tokens, pairs) counted on the host, and each
micro-batch's summed loss is divided by the step's total, so the result does not depend on how the step is split
into micro-batches and devices. A mixture-of-experts
model adds `router_aux_loss_coef` x the router's load-balancing loss to the objective (`lit_gpt.losses.MoETerms`);
`loss` stays the cross-entropy (comparable with dense runs), `aux_loss` and the experts' load are logged apart, and
the per-layer, per-expert counts go to `expert_load.csv` beside the logger's metrics.

Steps: every optimizer step consumes `global_batch_size` samples, on any number of devices; an epoch is
floor(samples / global_batch_size) steps (the tail, a different one each epoch, waits for the next epoch), so
`--train.epochs` gives the same steps, samples and losses on 1 CPU process, 1 XLA device or 8.

Checkpoints (`lit_gpt.checkpoints`). `out_dir/step-000010/` holds the trained weights, the optimizer, and the train
state (step, data position, every RNG of every process), next to the base model's config and tokenizer files and
the run's arguments (`finetune.json`); written under a temporary name and renamed when complete, so a killed run
never leaves a half checkpoint that `--resume auto` would pick. `out_dir/final/` holds the trained weights of the
run's last step without optimizer state, in the project's weights format (`lit_gpt.weights`, safetensors): the
deliverable that the generate recipes load, the same on every backend.
"""

import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Union

import lightning as L
import torch
import torch.nn as nn

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.checkpoints import resume_path, resume_run, run_files, step_dir
from lit_gpt.interrupts import on_interrupt, resume_command
from lit_gpt.heartbeat import Heartbeat
from lit_gpt.manifest import MANIFEST
from lit_gpt.data import IGNORE_INDEX, PreparedData, TrainBatches, val_batches
from lit_gpt.losses import MoETerms, labelled_rows, token_mask, write_expert_load
from lit_gpt.objectives import Objective
from lit_gpt.packing import collate_packed, pack_for_training
from lit_gpt.runtime import FINAL_DIR, Runtime
from lit_gpt.storage import location
from lit_gpt.utils import LitError



# ---------------------------------------------------------------------------------------------------------------
# What differs between methods
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Method:
    """The method-specific part of a finetuning run."""

    name: str
    """"full", "lora", "adapter", "adapter_v2"."""
    save_filter: Optional[Callable[[str, Any], bool]] = None
    """Which state-dict entries are saved (None: all, for full finetuning)."""
    metadata: Dict[str, Any] = field(default_factory=dict)
    """Saved with the step checkpoints and beside the final weights (for PEFT: `lit_gpt.peft.finetuned_metadata(model)`:
    the method and its config fields, e.g. lora_r)."""
    objective: Objective = field(default_factory=Objective)
    """What a step optimises (`lit_gpt.objectives`): supervised finetuning's cross-entropy, or DPO."""

    @property
    def trains_all(self) -> bool:
        return self.save_filter is None


# ---------------------------------------------------------------------------------------------------------------
# Host numbers across processes (through Fabric's strategy: DDP/FSDP process groups, or XLA's)
# ---------------------------------------------------------------------------------------------------------------
def sum_over_processes(fabric: Any, values: Sequence[float]) -> List[float]:
    """Sum host numbers over the processes (one small collective; none with one process)."""
    if fabric.world_size == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if fabric.device.type == "cuda":  # NCCL reduces device tensors only
        t = t.to(fabric.device)
    return [float(v) for v in fabric.all_reduce(t, reduce_op="sum").cpu()]


def combine_processes(fabric: Any, runtime: Runtime, values: Sequence[float], mean: bool) -> List[float]:
    """Host numbers read from each process's device tensors, combined: DDP/FSDP processes hold their own shares
    (summed, or averaged with `mean`); under SPMD (XLA: `grad_scale` 1) every host already holds the global value."""
    if fabric.world_size == 1 or runtime.grad_scale == 1.0:
        return [float(v) for v in values]
    total = sum_over_processes(fabric, values)
    return [v / fabric.world_size for v in total] if mean else total


def gather_objects(fabric: Any, obj: Any) -> List[Any]:
    """`obj` of every process, in rank order."""
    if fabric.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: List[Any] = [None] * fabric.world_size
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------------------------------------------
def push_logs(fabric: Any) -> None:
    """Upload the loggers' files to a URL out_dir (after each checkpoint and at the end); nothing for a folder."""
    if fabric.global_rank != 0:
        return
    for logger in fabric.loggers:
        mirror = getattr(logger, "_lit_mirror", None)
        if mirror is not None:
            logger.save()  # what the logger buffered goes to its local files first
            mirror.push()


def _log_dir(fabric: Any) -> Optional[Path]:
    """The first logger's folder of this run (CSV, TensorBoard: logs/<name>/version_N, next to its metrics; W&B:
    its save_dir), local (a URL out_dir's logs go to a mirror that `push_logs` uploads); None without a logger."""
    for logger in fabric.loggers:
        folder = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        if folder:
            return Path(folder)
    return None


def uses_fsdp(fabric: L.Fabric) -> bool:
    from lightning.fabric.strategies import FSDPStrategy

    return isinstance(fabric.strategy, FSDPStrategy)


# ---------------------------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------------------------
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
    """This process's validation batches (a process may get none: the losses are summed over processes)."""
    max_seq_length: int
    prepared: PreparedData
    sample_prompt: Optional[torch.Tensor]
    """The prompt of the first validation sample (its masked prefix): generated from at each validation."""
    steps_per_epoch: int = 1
    rows: int = 1
    """Samples (pairs, for DPO) of every forward of this process (micro_batch_size x the devices it feeds)."""
    objective: Objective = field(default_factory=Objective)
    val_args: Dict[str, Any] = field(default_factory=dict)
    """How `val` was batched (`rebatch_val` builds it again after the samples changed, e.g. DPO's reference)."""

    def rebatch_val(self) -> None:
        """Collate the validation batches again from `prepared.val` (after the samples gained fields)."""
        self.val = val_batches(self.prepared.val, self.rows, self.max_seq_length, **self.val_args)


def load_data(
    runtime: Runtime,
    data: DataArgs,
    train: TrainArgs,
    eval: EvalArgs,
    checkpoint_dir: Path,
    block_size: int,
    objective: Optional[Objective] = None,
) -> RunData:
    """Read the prepared data, pick the run's max_seq_length, and build this process's train/val batches.

    max_seq_length is `--train.max_seq_length` if given (longer samples are cropped, and counted), else the
    longest sample; at most the model's context length. Samples that keep no target token once cropped are left
    out (they would teach nothing and, alone in a batch, divide by zero); when none is left the run stops.
    `objective` (default: supervised finetuning) says what a sample is and how samples form a batch (DPO: pairs,
    counted by `--train.*_batch_size` as one sample each)."""
    objective = objective or Objective()
    rank, processes = runtime.fabric.global_rank, runtime.fabric.world_size
    rows = train.micro_batch_size * runtime.local_devices
    prepared = objective.load(data.data_dir, checkpoint_dir)  # SFT: instruction data; DPO: preference pairs
    if not prepared.train:
        raise LitError(f"{str(data.data_dir)!r} has no training samples")
    longest = max(objective.length(s) for s in prepared.train + prepared.val)
    if train.max_seq_length is not None:
        if train.max_seq_length > block_size:
            raise LitError(
                f"--train.max_seq_length {train.max_seq_length} exceeds the model's context length {block_size}"
            )
        # packed rows are exactly max_seq_length long, whatever the samples' lengths
        max_seq_length = train.max_seq_length if data.packing else min(train.max_seq_length, longest)
    else:
        max_seq_length = min(longest, block_size)
    say = (lambda msg: print(msg, file=sys.stderr)) if rank == 0 else (lambda msg: None)
    cropped = sum(objective.cropped(s, max_seq_length) for s in prepared.train + prepared.val)
    if cropped:
        say(f"note: {cropped} sample(s) are longer than max_seq_length {max_seq_length} and get cropped")
    kept = [s for s in prepared.train if objective.keep(s, max_seq_length)]
    if not kept:
        raise LitError(
            f"no training sample keeps a target token within max_seq_length {max_seq_length} (the prompts fill it):"
            f" raise --train.max_seq_length (the longest sample has {longest} tokens) or shorten the prompts"
        )
    if len(kept) < len(prepared.train):
        say(f"note: {len(prepared.train) - len(kept)} training sample(s) have no target token within"
            f" max_seq_length {max_seq_length} and are left out")
    val_kept = [s for s in prepared.val if objective.keep(s, max_seq_length)]
    train_items, val_items, what = kept, val_kept, "usable samples"
    pad = dict(pad_multiple=data.pad_multiple, pad_pow2=data.pad_pow2, collate_fn=objective.collate)
    if data.packing:  # the items the batch sizes count are rows of samples
        train_items, val_items = pack_for_training(objective.name, kept, val_kept, max_seq_length, say)
        what, pad["collate_fn"] = "packed rows", collate_packed
    steps_per_epoch = len(train_items) // train.global_batch_size
    if steps_per_epoch == 0:
        raise LitError(
            f"the training set has {len(train_items)} {what}, fewer than --train.global_batch_size"
            f" ({train.global_batch_size}): lower the global batch size or add data"
        )
    if train.compile and not data.packing:
        if uses_fsdp(runtime.fabric):
            raise LitError("--train.compile works on one device or with --strategy ddp, not with FSDP")
        if data.pad_multiple == 1 and not data.pad_pow2:
            # every new batch length would compile the blocks again: a few power-of-two buckets instead
            pad["pad_pow2"] = True
            say("note: --train.compile pads each batch to a power-of-two length (--data.pad_multiple sets other"
                " buckets)")
    # whole optimizer steps only: every layout (1 process, 8 devices, ...) sees the same samples in each step
    batches = TrainBatches(
        train_items, rows, max_seq_length, seed=train.seed, shuffle=data.shuffle, rank=rank, world_size=processes,
        batches_per_epoch=steps_per_epoch * train.gradient_accumulation_iters(runtime.data_parallel_size), **pad,
        packed=data.packing,
    )
    val_args = dict(max_iters=eval.max_iters, rank=rank, world_size=processes, **pad)
    val = val_batches(val_items, rows, max_seq_length, **val_args)
    sample_prompt = None
    if prepared.val:
        first = prepared.val[0]
        masked = (first["labels"] == IGNORE_INDEX).nonzero()
        # the prompt is the masked prefix; unmasked data (--mask_inputs false) has no marked prompt
        n_prompt = int(masked.max()) + 1 if masked.numel() and first["labels"][0] == IGNORE_INDEX else 0
        if n_prompt:
            sample_prompt = first["input_ids"][:n_prompt]
    prepared = replace(prepared, train=kept, val=val_kept)
    return RunData(batches, val, max_seq_length, prepared, sample_prompt, steps_per_epoch, rows, objective, val_args)




# ---------------------------------------------------------------------------------------------------------------
# Validation (the loss functions are lit_gpt.losses)
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def validate(runtime: Runtime, model: nn.Module, batches: List[Dict[str, Any]], rows: int,
             objective: Optional[Objective] = None) -> Dict[str, float]:
    """The objective's mean loss per unit (SFT: cross-entropy per target token; DPO: loss per pair) over the
    validation batches of all processes, as {"val_loss": ..., "val_<stat>": ...}. Every process calls it, also one
    without batches: the sum over processes is a collective."""
    objective = objective or Objective()
    model.eval()
    n_stats = len(objective.stat_names)
    total = runtime.zeros((1 + n_stats,))
    count = 0
    for batch in batches:
        batch = objective.rollout(runtime, model, [objective.pad(batch, rows)], evaluate=True)[0]  # GRPO: greedy
        count += objective.count(batch)
        loss, stats = objective.eval_loss(model, runtime.place(objective.inputs(batch)))
        total += torch.cat([loss.float().reshape(1), stats.float()]) if stats is not None else loss.float().reshape(1)
        runtime.end_step()
    model.train()
    sums = sum_over_processes(runtime.fabric, total.cpu().tolist() + [count])
    count = sums[-1]
    out = {"val_loss": sums[0] / max(count, 1.0)}
    out.update({f"val_{k}": v for k, v in objective.metrics(sums[1:-1], count).items()}, **objective.logged("val_"))
    return out


def generate_sample(
    runtime: Runtime, model: nn.Module, gpt: nn.Module, prompt: torch.Tensor, tokenizer: Any, max_new_tokens: int
) -> str:
    """Greedy continuation of `prompt` with the one generation loop (greedy: it draws no random numbers, so a
    resumed run stays identical to an uninterrupted one)."""
    from lit_gpt.generate import timed_generate

    max_new_tokens = min(max_new_tokens, gpt.config.block_size - prompt.numel())
    if max_new_tokens <= 0:
        return ""
    model.eval()
    try:
        with torch.no_grad():
            result = timed_generate(model, prompt, max_new_tokens, runtime, temperature=0.0,
                                    stop_ids=tokenizer.stop_ids)
    finally:
        model.train()
    return tokenizer.decode(result.tokens, skip_special_tokens=True)


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
    runtime: Optional[Runtime] = None,
    allow_other_base: bool = False, allow_other_data: bool = False,  # resume on another base / other prepared data
) -> Dict[str, Any]:
    """Train for `train.max_steps` optimizer steps (or `train.epochs` epochs), validating every `eval.interval` steps
    and checkpointing every `train.save_interval` steps and at the last step; then export the last step's trained
    weights to `out_dir/final`. Returns a summary (steps, per-step losses, last val loss, throughput, MFU,
    compilations). `run_config["base"]` (the base model's record, `lit_gpt.fingerprint`) goes with every checkpoint
    and the export; a resumed run must have the same base unless `allow_other_base`."""
    from tqdm import tqdm

    from lit_gpt.tokenizer import Tokenizer

    runtime = runtime or Runtime(fabric)
    objective = method.objective  # what a step optimises: SFT's cross-entropy, DPO (lit_gpt.objectives)
    out_dir = location(out_dir)
    if train.compile:
        runtime.compile_blocks(raw_model)
    if run_config is not None and method.metadata.get("config"):
        run_config = {**run_config, "method_config": method.metadata["config"]}  # e.g. lora_r: part of the run
    accum = train.gradient_accumulation_iters(runtime.data_parallel_size)
    total_steps = train.max_steps if train.max_steps is not None else train.epochs * data.steps_per_epoch
    # only the validation sample needs the tokenizer (and a benchmark's random checkpoint has none)
    sampling = data.sample_prompt is not None and eval.max_new_tokens > 0
    tokenizer = Tokenizer(checkpoint_dir) if sampling else None
    # one RoPE table for training and for the validation samples, set explicitly, once (never inside forward):
    # on a tracing backend a table that changed length would change every graph that uses it
    block_size = raw_model.config.block_size
    rope = data.max_seq_length
    if sampling:
        n = data.sample_prompt.numel()
        new = max(1, min(eval.max_new_tokens, block_size - n))
        rope = max(rope, runtime.cache_length(runtime.prompt_bucket(n, block_size), n, new, block_size))
    runtime.set_rope(raw_model, min(rope, block_size))
    filters = {"model": method.save_filter} if method.save_filter is not None else None
    write_files = run_files(checkpoint_dir, run_config)
    if run_config is not None:
        # the run's arguments beside its metrics (TensorBoard: hparams; W&B: the run config; Fabric's CSV logger
        # has no place for them: finetune.json in every checkpoint folder holds them); a resumed run logs a new
        # version and records them again
        for logger in fabric.loggers:
            try:
                logger.log_hyperparams(json.loads(json.dumps(run_config, default=str)))
            except NotImplementedError:
                pass
    has_val = bool(data.prepared.val)  # the same on every process, also one that got no validation batch

    step = 0
    last_saved: Optional[Path] = None
    resume_from = resume_path(runtime, resume, out_dir)
    if resume_from is not None:
        train_state = resume_run(runtime, resume_from, model, optimizer, method, data, run_config, allow_other_base,
                                 allow_other_data)
        step = int(train_state["step"])
        last_saved = resume_from
        fabric.print(f"Resumed from {resume_from} at step {step} (epoch {data.train.epoch}, batch {data.train.index})")
    else:
        # dropout masks differ per process (the model itself was built from the same seed on every process)
        runtime.seed(train.seed + fabric.global_rank)
    if step >= total_steps:
        fabric.print(f"Nothing to do: the checkpoint is at step {step} of {total_steps}")
    elif step == 0 and eval.initial_validation and has_val:
        val_metrics = validate(runtime, model, data.val, data.rows, objective)
        fabric.log_dict({**val_metrics, "step": 0}, step=0)
        fabric.print(f"initial validation loss {val_metrics['val_loss']:.4f}" + _stats_text(val_metrics, "val_"))

    # forward + backward (+ the weights' gradients when all train) + the objective's own forwards (DPO's reference)
    flops_per_token = raw_model.config.flops_per_token(data.max_seq_length) * (
        (3 if method.trains_all else 2) + objective.extra_forwards)
    peak = runtime.peak_flops()
    running_loss = runtime.zeros(())  # the steps' mean losses, summed on the device, read at log steps only
    running_stats = runtime.zeros((len(objective.stat_names),)) if objective.stat_names else None
    # mixture of experts: the router's load-balancing loss in the objective, its value and the experts' load logged
    moe = MoETerms.of(raw_model, accum, runtime.zeros, model)  # the objective calls `moe.forward` (the routing)
    running_steps = running_moe = 0
    # throughput: steady steps (no compilation, not the run's first step) apart from the others
    steady = {"time": 0.0, "tokens": 0, "padded": 0, "steps": 0}
    warmup = {"time": 0.0, "steps": 0}
    step_compiles: Dict[int, int] = {}  # padded length -> graphs compiled in steps that used it
    other_compiles = 0
    tokens_seen = padded_seen = 0
    train_time = 0.0
    summary: Dict[str, Any] = {"steps": step, "first_step": step + 1, "losses": {}, "train_loss": None,
                               "val_loss": None, "total_steps": total_steps}
    what = method.name if objective.name == "sft" else f"{objective.name} {method.name}"  # e.g. "dpo lora"
    bar = tqdm(total=total_steps, initial=step, desc=f"finetune {what}", disable=fabric.global_rank != 0,
               dynamic_ncols=True, file=sys.stdout)
    model.train()
    first_step_of_run = True
    heartbeat = Heartbeat(out_dir, fabric.global_rank)  # (step, time, host): a babysitter sees progress or a hang
    heartbeat(step)

    def interrupted(signal_name: str) -> str:
        where = f"interrupted by {signal_name} at step {step} of {total_steps}"
        # this step's save may have been committed just before the signal came, before `last_saved` was set
        saved = step_dir(out_dir, step) if step and (step_dir(out_dir, step) / MANIFEST).is_file() else last_saved
        if saved is None:
            return f"{where}, before any checkpoint was saved; start again with: {resume_command()}"
        return f"{where}; the last complete checkpoint is {saved}; resume with: {resume_command()}"

    with on_interrupt(interrupted, quiet=fabric.global_rank != 0):
        while step < total_steps:
            t0 = time.perf_counter()
            c0 = runtime.compile_count()
            set_lr(optimizer, lr_at(step, total_steps, train.lr_warmup_steps, train.learning_rate, train.min_lr))
            # the whole step's micro-batches first: the loss is divided by the step's target count over all processes
            batches = objective.rollout(runtime, model, [objective.pad(next(data.train), data.rows) for _ in range(accum)])
            # the units the step's loss is averaged over (target tokens; DPO: pairs), over all processes
            step_units = sum_over_processes(fabric, [sum(objective.count(b) for b in batches)])[0]
            scale = runtime.scalar(runtime.grad_scale / step_units)
            mean_scale = runtime.scalar(1.0 / step_units)
            for micro, batch in enumerate(batches):
                last = micro == accum - 1
                # the labelled positions from the host copy: no device-to-host wait inside the step
                # (None: every position has a label, so the head runs on all of them and nothing is selected)
                rows = labelled_rows(batch["labels"]) if runtime.targets_only else None
                inputs = runtime.place(objective.inputs(batch))
                rows = runtime.place(rows) if rows is not None else None
                with runtime.backward_sync(model, last):
                    loss, stats = objective.loss(model if moe is None else moe.forward, inputs, rows)
                    total = loss * scale
                    if moe is not None:
                        aux = moe.micro_batch(runtime.place(token_mask(batch["labels"])))
                        total = total if aux is None else total + aux
                    fabric.backward(total)
                running_loss += loss.detach().float() * mean_scale
                if stats is not None:
                    running_stats += stats.detach().float() * mean_scale
                runtime.end_micro_batch(last)
            if train.max_norm is not None:
                # error_if_nonfinite=False: no host read of the norm inside the step
                fabric.clip_gradients(model, optimizer, max_norm=train.max_norm, error_if_nonfinite=False)
            optimizer.step()  # on XLA the strategy ends the step's graph here
            optimizer.zero_grad(set_to_none=True)
            step += 1
            running_steps += 1
            running_moe += 1
            n_tokens = sum(b["n_tokens"] for b in batches) * fabric.world_size
            n_padded = sum(b["input_ids"].numel() for b in batches) * fabric.world_size
            tokens_seen += n_tokens
            padded_seen += n_padded

            loss_value = None
            if step % train.log_interval == 0 or step == total_steps:
                # the only host read of the loss (on async backends it waits for the step)
                read = [float(running_loss.cpu())] + (running_stats.cpu().tolist() if running_stats is not None else [])
                read = [v / running_steps for v in sum_over_processes(fabric, read)]
                loss_value, stat_values = read[0], dict(zip(objective.stat_names, read[1:]))
                running_loss = runtime.zeros(())
                running_stats = runtime.zeros((len(objective.stat_names),)) if objective.stat_names else None
                running_steps = 0
            step_time = time.perf_counter() - t0
            train_time += step_time
            new_compiles = runtime.compile_count() - c0
            summary.setdefault("step_times", []).append((step_time, new_compiles, n_padded // fabric.world_size))
            length = max(b["input_ids"].size(1) for b in batches)
            step_compiles[length] = step_compiles.get(length, 0) + new_compiles
            if first_step_of_run or new_compiles:
                warmup["time"] += step_time
                warmup["steps"] += 1
            else:
                steady["time"] += step_time
                steady["tokens"] += n_tokens
                steady["padded"] += n_padded
                steady["steps"] += 1
            first_step_of_run = False
            bar.update(1)
            heartbeat(step)

            if loss_value is not None:
                summary["losses"][step] = loss_value
                metrics: Dict[str, Any] = {"loss": loss_value, **stat_values, "lr": optimizer.param_groups[0]["lr"],
                                           "step": step,
                                           "epoch": data.train.epoch, "tokens": tokens_seen, "step_time": step_time,
                                           # cumulative, named like Lightning's ThroughputMonitor columns
                                           "time": train_time, "lengths": padded_seen}
                if steady["time"] > 0:
                    metrics["tokens_per_sec"] = steady["tokens"] / steady["time"]
                    metrics["padded_tokens_per_sec"] = steady["padded"] / steady["time"]
                    if peak:
                        metrics["mfu"] = flops_per_token * metrics["padded_tokens_per_sec"] / (
                            peak * runtime.data_parallel_size)
                if runtime.compiles_graphs:
                    metrics["compiles"] = new_compiles
                if moe is not None:
                    combine = lambda v, mean: combine_processes(fabric, runtime, v, mean)  # noqa: E731
                    moe_metrics, load = moe.read(running_moe, combine)
                    metrics.update(moe_metrics)
                    running_moe = 0
                fabric.log_dict({**metrics, **objective.logged()}, step=step)  # GRPO: + rewards, lengths, times
                if moe is not None and fabric.global_rank == 0 and _log_dir(fabric) is not None:
                    write_expert_load(_log_dir(fabric), step, moe.layers, load)  # beside the logger's metrics
                postfix = {"loss": f"{loss_value:.4f}", "lr": f"{metrics['lr']:.2e}"}
                if "reward_accuracy" in stat_values:
                    postfix["reward_acc"] = f"{stat_values['reward_accuracy']:.2f}"
                if "tokens_per_sec" in metrics:
                    postfix["steady_tok_s"] = f"{metrics['tokens_per_sec']:.0f}"
                bar.set_postfix(postfix)
                summary.update(stat_values)  # DPO: the last logged rewards and reward accuracy
                summary.update(train_loss=loss_value, tokens_per_sec=metrics.get("tokens_per_sec"),
                               mfu=metrics.get("mfu"))

            c1 = runtime.compile_count()
            if has_val and (step % eval.interval == 0 or (step == total_steps and eval.final_validation)):
                val_metrics = validate(runtime, model, data.val, data.rows, objective)
                val_loss = val_metrics["val_loss"]
                if not objective.stat_names:  # perplexity is exp(cross-entropy per token): SFT only
                    val_metrics["val_ppl"] = math.exp(min(val_loss, 50))
                fabric.log_dict(val_metrics, step=step)
                summary["val_loss"] = val_loss
                summary.update({k: v for k, v in val_metrics.items() if k != "val_ppl"})
                text = generate_sample(runtime, model, raw_model, data.sample_prompt, tokenizer,
                                       eval.max_new_tokens) if sampling else ""
                if fabric.global_rank == 0:
                    bar.write(f"step {step}: val loss {val_loss:.4f}" + _stats_text(val_metrics, "val_")
                              + (f" | sample: {text!r}" if text else ""))

            if (train.save_interval is not None and step % train.save_interval == 0) or step == total_steps:
                rng = runtime.rng_state()
                train_state = {"step": step, "data": data.train.state_dict(), "total_steps": total_steps, "rows": data.rows,
                               "rng": gather_objects(fabric, rng)}
                state = {"model": model, "optimizer": optimizer, "train_state": train_state, **method.metadata}
                push_logs(fabric)  # a URL out_dir's logs reach the bucket before the step they lead to is committed
                last_saved = runtime.save_step(step_dir(out_dir, step), state, filters, write_files)
                # go on from the saved generator state, like a run resumed from this checkpoint: saving may advance a
                # backend's generator (XLA advances its seed at every graph cut, and a save cuts the graph)
                runtime.set_rng_state(rng)
                bar.write(f"saved {last_saved}") if fabric.global_rank == 0 else None
            other_compiles += runtime.compile_count() - c1
        bar.close()
        summary["steps"] = step

        if last_saved is not None:
            final = runtime.export_final(last_saved, out_dir / FINAL_DIR, model, method.name, method.save_filter,
                                         method.metadata.get("config", {}), write_files,
                                         base=(run_config or {}).get("base"))
            fabric.print(f"Saved the {method.name} weights of step {step} to {final}")
            summary["final"] = final
    _report(fabric, runtime, summary, steady, warmup, step_compiles, other_compiles, flops_per_token, peak)
    push_logs(fabric)
    return summary


def _stats_text(metrics: Dict[str, float], prefix: str) -> str:
    """`, reward accuracy 0.75, reward margin 0.12` for an objective's logged means (nothing for SFT)."""
    shown = [(k[len(prefix):], v) for k, v in metrics.items() if k.startswith(prefix) and k not in (
        f"{prefix}loss", f"{prefix}ppl")]
    return "".join(f", {k.replace('_', ' ')} {v:.4f}" for k, v in shown)


def _report(fabric: Any, runtime: Runtime, summary: Dict[str, Any], steady: Dict[str, Any], warmup: Dict[str, Any],
            step_compiles: Dict[int, int], other_compiles: int, flops_per_token: float, peak: Optional[float]) -> None:
    """The closing lines: steady throughput (compilation and warm-up steps apart) with MFU, compilations, memory."""
    if runtime.compiles_graphs:
        n_step = sum(step_compiles.values())
        summary.update(train_compiles=n_step, padded_lengths=sorted(step_compiles), other_compiles=other_compiles)
        what = "XLA" if runtime.name == "xla" else "torch.compile (blocks)"
        fabric.print(
            f"{what} compilations: train step {n_step} for {len(step_compiles)} padded length(s)"
            f" {sorted(step_compiles)} (per length: {dict(sorted(step_compiles.items()))}); validation, sample"
            f" generation and checkpoints {other_compiles}"
        )
    if steady["steps"]:
        rate = steady["tokens"] / steady["time"]
        padded = steady["padded"] / steady["time"]
        mfu = flops_per_token * padded / (peak * runtime.data_parallel_size) if peak else None
        summary.update(tokens_per_sec=rate, padded_tokens_per_sec=padded, mfu=mfu, steady_steps=steady["steps"])
        fabric.print(
            f"Throughput: {rate:.1f} tokens/s ({padded:.1f} with padding) over {steady['steps']} steady step(s);"
            f" {warmup['steps']} first or compiling step(s) took {warmup['time']:.1f} s apart"
            + (f"; MFU {mfu * 100:.1f}%" if mfu is not None else "; MFU: peak FLOP/s unknown for this device")
        )
    else:
        fabric.print(f"Throughput: no steady step to measure ({warmup['steps']} first or compiling step(s),"
                     f" {warmup['time']:.1f} s)")
    report = runtime.memory_report()
    if report is not None:
        fabric.print(report)


