"""The finetuning loop on XLA devices, shared by xla/finetune/{adapter,lora,full}.py.

Everything that does not depend on the device comes from `lit_gpt.training` (the `Method`, the prepared data and
its resumable batches, the optimizer's parameter groups, the warmup + cosine schedule, the loss). What is
different here, and why:

* The graph. XLA traces each step and compiles every distinct graph once. Batches are padded to powers of two
  (`--data.pad_pow2`, on by default in the XLA recipes), the loss runs over the whole padded batch
  (`targets_only=False`: no data-dependent shapes), and `torch_xla.sync()` ends the graph after every micro-batch,
  so the train step compiles a few graphs per padded length instead of one per combination of the lengths of a
  step's micro-batches. Tensors that live across steps (the loss accumulator, the RoPE tables) are placed with
  an explicit sharding, so the first graph that uses them does not pick one that the second graph then sees as
  new. The compilations are counted and reported per padded length.
* Host reads. The loss is summed on the device and read every `log_interval` steps; the learning rate is a
  Python number that torch_xla passes as data, so the changing schedule does not recompile.
* Batches. `--train.micro_batch_size` is per device: a host feeds micro_batch_size x its devices rows per
  forward, and `shard_batch` splits them along the batch over the devices (FSDP over SPMD).
* Checkpoints. `out_dir/step-XXXXXX/` are sharded checkpoints (`lit_gpt.xla.checkpoint`: every host writes its
  own shards, atomically, with the trained weights, the optimizer state, the data position and the RNG states);
  `--resume auto` continues from the newest complete one. At the end the last one is consolidated into
  `out_dir/final/`, in the same format as the GPU/CPU recipes write (loadable by generate/*.py anywhere).
* Validation shows a sample generated with `lit_gpt.xla.generate` (compiled once, like the XLA generate recipes).
* MFU. Lightning's ThroughputMonitor asks the GCE metadata server for the TPU type (which fails off Google
  Cloud) and counts processes, not devices; `Throughput` is used with the chip's peak and the device count.
"""

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch
import torch.nn as nn

from lit_gpt import training
from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.data import IGNORE_INDEX
from lit_gpt.model import GPT
from lit_gpt.utils import LitError

# bf16 peak of one chip, FLOP/s (Google Cloud TPU documentation, "system architecture" pages)
TPU_PEAK_FLOPS = {"v2": 45e12, "v3": 123e12, "v4": 275e12, "v5litepod": 197e12, "v5e": 197e12, "v5p": 459e12,
                  "v6e": 918e12}


# ---------------------------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------------------------
def local_devices(fabric: Any) -> int:
    """Devices driven by this process (host)."""
    from lit_gpt.xla.strategy import get_strategy

    return get_strategy(fabric).num_devices // max(1, fabric.world_size)


def load_data(
    fabric: Any, data: DataArgs, train: TrainArgs, eval: EvalArgs, checkpoint_dir: Path, block_size: int
) -> training.RunData:
    """The prepared data as this host's batches of micro_batch_size x (its devices) rows."""
    per_host = dataclasses.replace(train, micro_batch_size=train.micro_batch_size * local_devices(fabric))
    return training.load_data(fabric, data, per_host, eval, checkpoint_dir, block_size)


def load_model(fabric: Any, build: Any, checkpoint_dir: Path) -> nn.Module:
    """`build()` (a GPT or a PEFT variant) with the base checkpoint loaded block by block onto the devices
    (`lit_gpt.xla.load_staged`); the variant's own new parameters are initialised by their modules."""
    from lit_gpt.utils import check_checkpoint_dir
    from lit_gpt.xla.loader import load_staged

    return load_staged(build, check_checkpoint_dir(checkpoint_dir), fabric)


def build_optimizer(model: nn.Module, train: TrainArgs, name: str = "adamw") -> torch.optim.Optimizer:
    """AdamW (default) or SGD with momentum over the trainable parameters, with the parameter groups of the GPU
    recipes (no weight decay on 1-D parameters)."""
    if name == "adamw":
        return training.build_optimizer(model, train)
    if name != "sgd":
        raise LitError(f"--optimizer must be 'adamw' or 'sgd', got {name!r}")
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.SGD([g for g in groups if g["params"]], lr=train.learning_rate, momentum=0.9)


def setup_fabric(
    devices: Union[int, str],
    precision: Optional[str],
    train: TrainArgs,
    out_dir: Path,
    logger_name: str = "csv",
    activation_checkpointing: bool = False,
    compile_cache_dir: Optional[Path] = None,
) -> Any:
    """Fabric for an XLA finetuning run (FSDP over SPMD on every device; bf16-true on TPUs, else 32-true, unless
    given), logging like the GPU/CPU recipes; `train` is checked against the number of devices."""
    from lit_gpt.xla.accelerator import default_precision, pjrt_device_count
    from lit_gpt.xla.strategy import make_fabric

    fabric = make_fabric(
        devices, default_precision(precision), activation_checkpointing=activation_checkpointing,
        compile_cache_dir=compile_cache_dir, loggers=training.make_logger(out_dir, logger_name),
    )
    train.validate(pjrt_device_count())
    return fabric


def peak_flops() -> Optional[float]:
    """bf16 FLOP/s of one device when it is a known TPU, else None (then MFU is not logged)."""
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return None
    try:
        from torch_xla._internal import tpu

        return TPU_PEAK_FLOPS.get(tpu.get_tpu_type().lower())
    except Exception:  # the TPU type comes from env vars or the metadata server; MFU is optional
        return None


# ---------------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------------
def _device_zeros(n: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    from lit_gpt.xla.generate import to_device

    return to_device(torch.zeros(n, dtype=torch.float32), device)


def pad_rows(batch: Dict[str, Any], rows: int) -> Dict[str, Any]:
    """Pad a batch to `rows` rows that count nothing (labels ignored), so that it splits over the devices."""
    missing = rows - batch["input_ids"].size(0)
    if missing <= 0:
        return batch
    pad = lambda t, value: torch.cat([t, t.new_full((missing, t.size(1)), value)])  # noqa: E731
    return {**batch, "input_ids": pad(batch["input_ids"], 0), "labels": pad(batch["labels"], IGNORE_INDEX)}


@torch.no_grad()
def validate(fabric: Any, model: nn.Module, batches: List[Dict[str, Any]], rows: int) -> float:
    """Mean cross-entropy per target token over the validation batches; one host read at the end."""
    import torch_xla

    from lit_gpt.xla.strategy import shard_batch

    model.eval()
    total = _device_zeros((2,), fabric.device)
    for batch in batches:
        batch = pad_rows(batch, rows)
        input_ids, labels = shard_batch(fabric, (batch["input_ids"], batch["labels"]))
        logits = model(input_ids)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total += torch.stack([loss, (labels != IGNORE_INDEX).sum().float()])
        torch_xla.sync()
    model.train()
    loss_sum, count = total.cpu().tolist()
    if fabric.world_size > 1:  # each host validated its own batches (the host sums travel over gloo)
        loss_sum, count = fabric.all_reduce(torch.tensor([loss_sum, count], dtype=torch.float64), reduce_op="sum")
    return float(loss_sum) / max(float(count), 1.0)


def generate_sample(model: nn.Module, gpt: GPT, prompt: torch.Tensor, tokenizer: Any, max_new_tokens: int) -> str:
    """Greedy continuation of the first validation prompt, with the XLA generation code (greedy: no random numbers
    are drawn, so a resumed run stays identical to an uninterrupted one)."""
    from lit_gpt.xla.generate import generate

    max_new_tokens = min(max_new_tokens, gpt.config.block_size - prompt.numel())
    if max_new_tokens <= 0:
        return ""
    try:
        result = generate(model, prompt, max_new_tokens, temperature=0.0, stop_ids=tokenizer.stop_ids)
    finally:
        model.train()
    return tokenizer.decode(result.tokens, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------
def save_step(fabric: Any, directory: Path, model: nn.Module, optimizer: Any, method: training.Method,
              checkpoint_dir: Path, train_state: Dict[str, Any], run_config: Optional[Dict[str, Any]]) -> Path:
    """A resumable sharded checkpoint (atomic: `lit_gpt.xla.checkpoint.save_sharded`), with the base model's
    config and tokenizer files next to the shards."""
    state = {"model": model, "optimizer": optimizer, "train_state": train_state, **method.metadata}
    filters = {"model": method.save_filter} if method.save_filter is not None else None
    fabric.save(directory, state, filter=filters)
    if fabric.global_rank == 0:
        training.copy_model_files(checkpoint_dir, directory)
        if run_config is not None:
            import json

            (directory / "finetune.json").write_text(json.dumps(run_config, indent=2, default=str) + "\n")
    fabric.barrier()
    return directory


def export_final(fabric: Any, step_checkpoint: Path, out_dir: Path, method: training.Method,
                 checkpoint_dir: Path) -> Path:
    """Consolidate the trained weights of a sharded checkpoint into `out_dir/final/{method.weights_file}`, the file
    the GPU/CPU recipes write (`lit_gpt.xla.checkpoint.consolidate`: a plain state dict for full finetuning, the
    `lit_gpt.peft` format when the checkpoint records a PEFT method), streamed tensor by tensor. Host 0 does it;
    the other hosts' shards must be in the same (shared) directory."""
    from lit_gpt.xla.checkpoint import consolidate

    final = out_dir / training.FINAL_DIR
    path = final / method.weights_file
    if fabric.global_rank == 0:
        final.mkdir(parents=True, exist_ok=True)
        consolidate(step_checkpoint, path, key="model")
        training.copy_model_files(checkpoint_dir, final)
    fabric.barrier()
    return path


def _resume_path(resume: Union[bool, str, Path], out_dir: Path) -> Optional[Path]:
    """--resume: False = start fresh; "auto" = the newest complete checkpoint in out_dir if any; True = the newest,
    which must exist; a path = that checkpoint directory."""
    from lit_gpt.xla.checkpoint import check_complete, latest_checkpoint

    if resume is False or resume is None or resume == "false":
        return None
    if resume in (True, "auto", "true"):
        found = latest_checkpoint(out_dir, pattern="step-*")
        if found is None and resume != "auto":
            raise LitError(f"--resume: no complete checkpoint in {str(out_dir)!r}; use --resume auto to start fresh")
        return found
    path = Path(resume)
    if not path.is_dir():
        raise LitError(f"--resume {str(path)!r} is not a checkpoint directory (out_dir/step-XXXXXX)")
    check_complete(path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------
def fit(
    fabric: Any,
    model: nn.Module,
    gpt: GPT,
    optimizer: Any,
    data: training.RunData,
    method: training.Method,
    *,
    checkpoint_dir: Path,
    out_dir: Path,
    train: TrainArgs,
    eval: EvalArgs,
    resume: Union[bool, Literal["auto"], Path] = False,
    run_config: Optional[Dict[str, Any]] = None,
    xla_metrics: bool = False,
) -> Dict[str, Any]:
    """Train for `train.max_steps` (or `train.epochs`) optimizer steps; validate every `eval.interval` steps;
    write a sharded checkpoint every `train.save_interval` steps and at the last step; consolidate the last one
    into `out_dir/final/`. Returns a summary (steps, losses, tokens/s, MFU, compilations)."""
    import torch_xla
    from lightning.fabric.utilities.throughput import Throughput
    from tqdm import tqdm

    from lit_gpt.generate import bucket_length
    from lit_gpt.tokenizer import Tokenizer
    from lit_gpt.xla.diagnostics import compile_count, metrics_report
    from lit_gpt.xla.generate import cache_length, set_rope_length
    from lit_gpt.xla.strategy import get_strategy, shard_batch

    if getattr(train, "compile", False):
        raise LitError("--train.compile (torch.compile) is for the GPU/CPU recipes: XLA compiles every step already")
    out_dir = Path(out_dir)
    n_devices = get_strategy(fabric).num_devices
    rows = train.micro_batch_size * local_devices(fabric)  # rows per forward on this host
    accum = train.gradient_accumulation_iters(n_devices)
    total_steps = train.total_steps(data.train.batches_per_epoch, fabric.world_size)
    # only the validation sample needs the tokenizer (and a benchmark's random checkpoint has none)
    tokenizer = Tokenizer(checkpoint_dir) if data.sample_prompt is not None and eval.max_new_tokens > 0 else None
    device = fabric.device

    # one RoPE table for training and for the validation samples, placed once (see lit_gpt.xla.generate)
    rope = data.max_seq_length
    if data.sample_prompt is not None and eval.max_new_tokens > 0:
        new = max(1, min(eval.max_new_tokens, gpt.config.block_size - data.sample_prompt.numel()))
        rope = max(rope, cache_length(bucket_length(data.sample_prompt.numel(), gpt.config.block_size), new,
                                      gpt.config.block_size))
    set_rope_length(gpt, min(rope, gpt.config.block_size))

    step = 0
    resume_from = _resume_path(resume, out_dir)
    if resume_from is not None:
        state: Dict[str, Any] = {"model": model, "optimizer": optimizer, "train_state": None}
        fabric.load(resume_from, state, strict=False)  # strict=False: PEFT checkpoints hold the trained weights only
        if not isinstance(state["train_state"], dict):
            raise LitError(f"{str(resume_from)!r} holds no training state: resume from an out_dir/step-XXXXXX one")
        step = int(state["train_state"]["step"])
        data.train.load_state_dict(state["train_state"]["data"])
        fabric.print(f"Resumed from {resume_from} at step {step} (epoch {data.train.epoch}, batch {data.train.index})")
    if step >= total_steps:
        fabric.print(f"Nothing to do: the checkpoint is at step {step} of {total_steps}")
    elif step == 0 and eval.initial_validation and data.val:
        fabric.print(f"initial validation loss {validate(fabric, model, data.val, rows):.4f}")

    flops_per_token = gpt.config.flops_per_token(data.max_seq_length) * (3 if method.trains_all else 2)
    throughput = Throughput(available_flops=peak_flops(), world_size=n_devices,
                            window_size=max(2, min(50, total_steps // max(1, train.log_interval))))
    running_loss = _device_zeros((), device)  # summed on the device, read only at log steps
    running_n = 0
    train_time = 0.0
    samples = tokens = padded_tokens = logged_padded = 0
    step_compiles: Dict[int, int] = {}  # padded length -> graphs compiled in steps that used it
    other_compiles = 0
    summary: Dict[str, Any] = {"steps": step, "train_loss": None, "val_loss": None, "first_step": step + 1}
    bar = tqdm(total=total_steps, initial=step, desc="finetune", disable=fabric.global_rank != 0, dynamic_ncols=True,
               file=sys.stdout)
    model.train()
    while step < total_steps:
        t0 = time.perf_counter()
        c0 = compile_count()
        padded_before = padded_tokens
        training.set_lr(optimizer, training.lr_at(step, total_steps, train.lr_warmup_steps, train.learning_rate,
                                                  train.min_lr))
        lengths = set()
        for micro in range(accum):
            batch = next(data.train)
            lengths.add(batch["input_ids"].size(1))
            input_ids, labels = shard_batch(fabric, (batch["input_ids"], batch["labels"]))
            loss = training.loss_fn(model, input_ids, labels, targets_only=False)
            fabric.backward(loss / accum)
            running_loss += loss.detach()
            running_n += 1
            samples += input_ids.size(0)
            tokens += batch["n_tokens"]
            padded_tokens += input_ids.numel()
            if micro < accum - 1:
                torch_xla.sync()  # one graph per micro-batch: a few graphs per padded length, not per combination
        if train.max_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=train.max_norm)
        optimizer.step()  # the strategy ends the step's graph here (torch_xla.sync)
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % train.log_interval == 0 or step == total_steps:
            loss_value = float(running_loss.cpu()) / running_n  # the only host read of the loss (waits for the step)
            running_loss, running_n = _device_zeros((), device), 0
        step_time = time.perf_counter() - t0
        train_time += step_time
        new_compiles = compile_count() - c0
        # wall time per step; it includes the device's work only on steps that read the loss (log_interval)
        summary.setdefault("step_times", []).append((step_time, new_compiles, padded_tokens - padded_before))
        for length in lengths:  # a step with several lengths is charged to its longest
            step_compiles.setdefault(length, 0)
        step_compiles[max(lengths)] += new_compiles
        bar.update(1)

        if step % train.log_interval == 0 or step == total_steps:
            # Throughput wants per-device counts: this host's counts x hosts / devices
            per_device = lambda n: n * fabric.world_size // n_devices  # noqa: E731
            throughput.update(time=train_time, batches=step, samples=max(step, per_device(samples)),
                              lengths=max(per_device(samples), per_device(padded_tokens)),
                              flops=int(flops_per_token * per_device(padded_tokens - logged_padded)))
            logged_padded = padded_tokens
            metrics = {"loss": loss_value, "lr": optimizer.param_groups[0]["lr"], "step": step,
                       "epoch": data.train.epoch, "tokens": tokens * fabric.world_size,
                       "tokens_per_sec": tokens * fabric.world_size / max(train_time, 1e-9)}
            metrics.update(throughput.compute())
            fabric.log_dict(metrics, step=step)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{metrics['lr']:.2e}",
                            tok_s=f"{metrics['tokens_per_sec']:.0f}")
            summary.update(train_loss=loss_value, tokens_per_sec=metrics["tokens_per_sec"],
                           mfu=metrics.get("device/mfu"))

        c1 = compile_count()
        if data.val and (step % eval.interval == 0 or (step == total_steps and eval.final_validation)):
            val_loss = validate(fabric, model, data.val, rows)
            fabric.log_dict({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, step=step)
            summary["val_loss"] = val_loss
            text = ""
            if data.sample_prompt is not None and eval.max_new_tokens > 0:
                text = generate_sample(model, gpt, data.sample_prompt, tokenizer, eval.max_new_tokens)
            if fabric.global_rank == 0:
                bar.write(f"step {step}: val loss {val_loss:.4f}" + (f" | sample: {text!r}" if text else ""))

        if (train.save_interval is not None and step % train.save_interval == 0) or step == total_steps:
            train_state = {"step": step, "data": data.train.state_dict(), "total_steps": total_steps}
            path = save_step(fabric, training.step_dir(out_dir, step), model, optimizer, method, checkpoint_dir,
                             train_state, run_config)
            bar.write(f"saved {path}") if fabric.global_rank == 0 else None
        other_compiles += compile_count() - c1
    bar.close()
    summary["steps"] = step

    last = _resume_path("auto", out_dir)
    if last is not None:
        final = export_final(fabric, last, out_dir, method, checkpoint_dir)
        fabric.print(f"Saved the {method.name} weights to {final}")
        summary["final"] = final
    n_step = sum(step_compiles.values())
    summary.update(train_compiles=n_step, padded_lengths=sorted(step_compiles), other_compiles=other_compiles)
    fabric.print(
        f"XLA compilations: train step {n_step} for {len(step_compiles)} padded length(s)"
        f" {sorted(step_compiles)} (per length: {dict(sorted(step_compiles.items()))}); validation, sample"
        f" generation and checkpoints {other_compiles}"
    )
    if summary.get("tokens_per_sec") is not None:
        mfu = summary.get("mfu")
        fabric.print(f"Throughput: {summary['tokens_per_sec']:.1f} tokens/s" +
                     (f", MFU {mfu * 100:.1f}%" if mfu is not None else " (MFU: peak FLOP/s unknown for this device)"))
    if xla_metrics:
        fabric.print(metrics_report())
    return summary
