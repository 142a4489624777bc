"""Full finetuning on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python xla/finetune/full.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python generate/base.py --checkpoint_dir out/xla/full/alpaca/final --prompt_style alpaca --prompt "..."

Every weight trains (parameters, gradients and optimizer state are sharded over the devices). Only the method
differs from xla/finetune/adapter.py and lora.py; the loop (lit_gpt/training.py, with lit_gpt/recipes/xla_finetune.py) writes sharded checkpoints
to out_dir/step-XXXXXX/ (`--resume auto` continues from the newest complete one) and, at the end, the complete
checkpoint folder out_dir/final/ (lit_model.safetensors, streamed out of the shards, plus config and tokenizer): what
finetune/full.py writes, loadable on any machine.
See xla/README.md for TPU VMs.
"""

from pathlib import Path
from typing import Literal, Optional, Union

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.model import GPT
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, load_config, load_run_data
from lit_gpt.recipes.xla_finetune import fit, load_model, setup_fabric
from lit_gpt.training import Method
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli
from lit_gpt.xla.runtime import XLARuntime


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    out_dir: str = "out/xla/full/alpaca",
    precision: Optional[str] = None,
    devices: Union[int, str] = "auto",
    resume: Union[bool, Literal["auto"], str] = False,
    activation_checkpointing: bool = False,
    scan_layers: Union[bool, Literal["auto"]] = "auto",
    optimizer: Literal["adamw", "sgd"] = "adamw",
    data: DataArgs = DataArgs(pad_pow2=True),
    train: TrainArgs = TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-5, min_lr=3e-6,
                                lr_warmup_steps=20),
    eval: EvalArgs = EvalArgs(),
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    compile_cache_dir: Optional[Path] = None,
    xla_metrics: bool = False,
    accelerator: str = "auto",
) -> dict:
    """Finetune all weights of a model on prepared instruction data, on XLA devices.

    Args:
        checkpoint_dir: The base model (a converted lit checkpoint directory).
        out_dir: Where sharded checkpoints (step-XXXXXX/), the final model (final/) and logs go:
            a folder, or an fsspec URL such as gs://bucket/run (needs gcsfs) or s3://bucket/run (needs s3fs).
        precision: "32-true", "bf16-true" or "bf16-mixed" (default: bf16-true on TPUs, else 32-true).
        devices: "auto" (all devices of the XLA runtime) or their number: the SPMD mesh spans all of them.
        resume: Continue from a checkpoint: a step directory, True (the newest complete one in out_dir), or "auto"
            (the newest if there is one, else start fresh).
        activation_checkpointing: Recompute each block's activations in the backward pass (less memory, ~1/3
            more compute).
        scan_layers: Run the blocks as one scanned layer (torch_xla's scan): the train step compiles in about the
            same time at any depth; steady steps are slower on XLA:CPU. "auto": from 32 blocks on (see
            bench/xla_scan.py), where jax and flax are installed (torch_xla's scan needs them under SPMD).
        optimizer: "adamw" or "sgd" (with momentum 0.9).
        data: Where the prepared data is and how it is batched (pad_pow2: batches padded to powers of two, so
            the train step compiles once per length bucket).
        train: Optimisation and checkpointing (micro_batch_size is per device).
        eval: Validation.
        logger_name: "csv", "tensorboard" or "wandb" (under out_dir/logs; W&B: project from WANDB_PROJECT,
            offline with WANDB_MODE=offline).
        compile_cache_dir: Persistent XLA compilation cache: a second run skips compiling (TPU/GPU).
        xla_metrics: Print torch_xla's metrics report (compilations, transfers, timings) at the end.
        accelerator: The PJRT device: "auto" (the TPU when there is one, else the CPU), "tpu", "cpu" or "cuda".
    """
    config = load_config(checkpoint_dir)
    fabric = setup_fabric(devices, precision, train, out_dir, logger_name, activation_checkpointing,
                          compile_cache_dir, resume=resume, accelerator=accelerator, scan_layers=scan_layers)
    run = FinetuneRun("full", checkpoint_dir, out_dir, config, data, train, eval, resume, optimizer, platform="xla",
                      options={"xla_metrics": xla_metrics})
    return fabric.launch(main, run)


def main(fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = XLARuntime(fabric)  # the one training loop, with XLA's placement, graph cuts and checkpoints
    data = load_run_data(runtime, run)

    # the method: the plain model, every parameter trains and is saved
    model = load_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
    method = Method(name="full")

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


if __name__ == "__main__":
    run_cli(setup)
