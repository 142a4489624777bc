"""LoRA finetuning: the base weights stay frozen; low-rank updates of the chosen linear layers train.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/alpaca
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.lora.safetensors --prompt "..."

QLoRA on a CUDA GPU (the frozen base weights in 4-bit NormalFloat through bitsandbytes, `pip install
bitsandbytes`; the LoRA matrices train in the precision's dtype):

    python finetune/lora.py --quantize bnb.nf4 --checkpoint_dir ... --data.data_dir data/alpaca

Only the LoRA matrices are saved (`lit_model.lora.safetensors`, with the LoRA settings needed to rebuild the model
in `lit_model.lora.json`; see `lit_gpt.weights`). `scripts/merge_lora.py` folds them into a standalone checkpoint.
"""

from functools import partial
from pathlib import Path
from typing import Literal, Optional, Union

import lightning as L
import torch

from lit_gpt import lora
from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.model import Block
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.quantize import check_quantize, quantize_model
from lit_gpt.recipes.finetune import (
    FinetuneRun, Precision, build_optimizer, fit, load_config, load_run_data, setup_fabric, setup_model,
)
from lit_gpt.runtime import Runtime, resolve_accelerator
from lit_gpt.training import Method
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

QLORA_CHOICES = ("bnb.nf4",)


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    out_dir: str = "out/lora/alpaca",
    precision: Optional[Precision] = None,
    devices: int = 1,
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    resume: Union[bool, Literal["auto"], str] = False,
    optimizer: Literal["adamw", "sgd"] = "adamw",
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    data: DataArgs = DataArgs(),
    train: TrainArgs = TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-4),
    eval: EvalArgs = EvalArgs(),
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    num_nodes: int = 1,
    quantize: Optional[str] = None,
) -> dict:
    """Finetune a model with LoRA on prepared instruction data.

    Args:
        checkpoint_dir: The base model (a converted lit checkpoint directory).
        out_dir: Where checkpoints (step-XXXXXX/, final/) and logs go:
            a folder, or an fsspec URL such as gs://bucket/run (needs gcsfs) or s3://bucket/run (needs s3fs).
        precision: "32-true", "bf16-true", "bf16-mixed", "16-true" or "16-mixed" (default: bf16-true on GPUs
            that support it, else 32-true).
        devices: How many devices (GPUs, or CPU processes) to train on.
        strategy: "auto" = FSDP on several GPUs, DDP on several CPU processes.
        resume: Continue from a checkpoint: a step directory, True (the newest in out_dir), or "auto" (the newest
            if there is one, else start fresh).
        optimizer: "adamw" or "sgd" (with momentum 0.9).
        lora_r: Rank of the updates.
        lora_alpha: The updates are scaled by alpha / r.
        lora_dropout: Dropout on the input of the updates.
        lora_query: Update the query projection (part of the fused qkv layer).
        lora_key: Update the key projection.
        lora_value: Update the value projection.
        lora_projection: Update the attention output projection.
        lora_mlp: Update the MLP's linear layers.
        lora_head: Update the output head.
        data: Where the prepared data is and how it is batched.
        train: Optimisation and checkpointing.
        eval: Validation.
        logger_name: "csv", "tensorboard" or "wandb" (under out_dir/logs; W&B: project from WANDB_PROJECT,
            offline with WANDB_MODE=offline).
        accelerator: "cpu", "cuda" or "auto" (a GPU when one is visible, else the CPU).
        num_nodes: Machines to train on, `devices` processes each (launched by torchrun or SLURM on every node).
        quantize: "bnb.nf4": QLoRA, the frozen base linear layers of the blocks in 4-bit NormalFloat (bitsandbytes,
            CUDA only). The saved LoRA weights merge into the unquantized base as usual.
    """
    train.validate(devices * num_nodes)
    if quantize is not None and train.compile:
        raise LitError("--train.compile is not supported with --quantize (QLoRA): drop one of the two")
    check_qlora(quantize, accelerator, strategy, devices * num_nodes)
    config = load_config(
        checkpoint_dir, lora.Config, lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        lora_query=lora_query, lora_key=lora_key, lora_value=lora_value, lora_projection=lora_projection,
        lora_mlp=lora_mlp, lora_head=lora_head,
    )
    fabric = setup_fabric(
        devices, precision, out_dir, logger_name, strategy, block_cls=Block, accelerator=accelerator,
        num_nodes=num_nodes, resume=resume,
    )
    run = FinetuneRun("lora", checkpoint_dir, out_dir, config, data, train, eval, resume, optimizer, quantize=quantize)
    return fabric.launch(main, run)


def check_qlora(quantize: Optional[str], accelerator: str, strategy: str, processes: int) -> None:
    """One line, before anything is loaded, for a --quantize that cannot run here."""
    if quantize is None:
        return
    check_quantize(quantize, torch.device(resolve_accelerator(accelerator)), torch.bfloat16, choices=QLORA_CHOICES)
    if processes > 1 and strategy != "ddp":
        raise LitError("--quantize does not combine with FSDP (4-bit weights are not sharded): add --strategy ddp")


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (the XLA recipes pass XLARuntime to the same loop)
    data = load_run_data(runtime, run)

    # the method: LoRA layers on the frozen base model; only the LoRA matrices train and are saved. QLoRA: the
    # frozen base weights become 4-bit ones, layer by layer, as they move to the GPU
    model, raw_model = setup_model(
        fabric, lambda: lora.GPT(run.config), run.checkpoint_dir, own_filter=lora.lora_filter,
        mark_trainable=lora.mark_only_lora_as_trainable,
        quantize=partial(quantize_model, mode=run.quantize, device=fabric.device) if run.quantize else None,
    )
    method = Method(name="lora", save_filter=finetuned_filter(raw_model), metadata=finetuned_metadata(raw_model))

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


if __name__ == "__main__":
    run_cli(setup)
