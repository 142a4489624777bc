"""LLaMA-Adapter finetuning: the base weights stay frozen; learned prompt vectors and their gates train in the
attention layers from `adapter_start_layer` on.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/alpaca
    python generate/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --adapter_path out/adapter/alpaca/final/lit_model.adapter.safetensors --prompt "..."

Only the adapter weights are saved (`lit_model.adapter.safetensors`, with the adapter settings in
`lit_model.adapter.json`; see `lit_gpt.weights`).
"""

from pathlib import Path
from typing import Literal, Optional, Union

import lightning as L

from lit_gpt import adapter
from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.model import Block
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import (
    FinetuneRun, Precision, build_optimizer, fit, load_config, load_run_data, setup_fabric, setup_model,
)
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    out_dir: str = "out/adapter/alpaca",
    precision: Optional[Precision] = None,
    devices: int = 1,
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    resume: Union[bool, Literal["auto"], str] = False,
    optimizer: Literal["adamw", "sgd"] = "adamw",
    adapter_prompt_length: int = 10,
    adapter_start_layer: int = 2,
    data: DataArgs = DataArgs(),
    train: TrainArgs = TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-3, weight_decay=0.02),
    eval: EvalArgs = EvalArgs(),
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    num_nodes: int = 1,
) -> dict:
    """Finetune a model with LLaMA-Adapter on prepared instruction data.

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
        adapter_prompt_length: Learned prompt vectors per adapted layer.
        adapter_start_layer: The first layer that gets an adapter.
        data: Where the prepared data is and how it is batched.
        train: Optimisation and checkpointing.
        eval: Validation.
        logger_name: "csv", "tensorboard" or "wandb" (under out_dir/logs; W&B: project from WANDB_PROJECT,
            offline with WANDB_MODE=offline).
        accelerator: "cpu", "cuda" or "auto" (a GPU when one is visible, else the CPU).
        num_nodes: Machines to train on, `devices` processes each (launched by torchrun or SLURM on every node).
    """
    train.validate(devices * num_nodes)
    config = load_config(
        checkpoint_dir, adapter.Config,
        adapter_prompt_length=adapter_prompt_length, adapter_start_layer=adapter_start_layer,
    )
    fabric = setup_fabric(
        devices, precision, out_dir, logger_name, strategy, block_cls=Block, accelerator=accelerator,
        num_nodes=num_nodes, resume=resume,
    )
    run = FinetuneRun("adapter", checkpoint_dir, out_dir, config, data, train, eval, resume, optimizer)
    return fabric.launch(main, run)


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (the XLA recipes pass XLARuntime to the same loop)
    data = load_run_data(runtime, run)

    # the method: adapter prompts and gates on the frozen base model; only they train and are saved
    model, raw_model = setup_model(
        fabric, lambda: adapter.GPT(run.config), run.checkpoint_dir,
        own_filter=adapter.adapter_filter, mark_trainable=adapter.mark_only_adapter_as_trainable,
    )
    method = Method(name="adapter", save_filter=finetuned_filter(raw_model), metadata=finetuned_metadata(raw_model))

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


if __name__ == "__main__":
    run_cli(setup)
