"""Full finetuning: every weight of the model trains.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/full.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/alpaca
    python generate/base.py --checkpoint_dir out/full/alpaca/final --prompt "..."

The result (`out_dir/final/`) is a complete checkpoint directory: lit_model.safetensors, lit_config.json and the
tokenizer (see `lit_gpt.weights` for the format).
"""

from pathlib import Path
from typing import Literal, Optional, Union

import lightning as L

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.model import GPT, Block
from lit_gpt.recipes.finetune import (
    FinetuneRun, Precision, build_optimizer, fit, load_config, load_run_data, setup_fabric, setup_model,
)
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    out_dir: str = "out/full/alpaca",
    precision: Optional[Precision] = None,
    devices: int = 1,
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    resume: Union[bool, Literal["auto"], str] = False,
    optimizer: Literal["adamw", "sgd"] = "adamw",
    data: DataArgs = DataArgs(),
    train: TrainArgs = TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-5, min_lr=3e-6),
    eval: EvalArgs = EvalArgs(),
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    num_nodes: int = 1,
) -> dict:
    """Finetune all weights of a model on prepared instruction data.

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
        data: Where the prepared data is and how it is batched.
        train: Optimisation and checkpointing.
        eval: Validation.
        logger_name: "csv", "tensorboard" or "wandb" (under out_dir/logs; W&B: project from WANDB_PROJECT,
            offline with WANDB_MODE=offline).
        accelerator: "cpu", "cuda" or "auto" (a GPU when one is visible, else the CPU).
        num_nodes: Machines to train on, `devices` processes each (launched by torchrun or SLURM on every node).
    """
    train.validate(devices * num_nodes)
    config = load_config(checkpoint_dir)
    fabric = setup_fabric(
        devices, precision, out_dir, logger_name, strategy, block_cls=Block, accelerator=accelerator,
        num_nodes=num_nodes, resume=resume,
    )
    run = FinetuneRun("full", checkpoint_dir, out_dir, config, data, train, eval, resume, optimizer)
    return fabric.launch(main, run)


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (the XLA recipes pass XLARuntime to the same loop)
    data = load_run_data(runtime, run)

    # the method: the plain model, every parameter trains and is saved
    model, raw_model = setup_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
    method = Method(name="full")

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


if __name__ == "__main__":
    run_cli(setup)
