"""LoRA finetuning on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python xla/finetune/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/lora/alpaca/final/lit_model.lora.safetensors --prompt_style alpaca --prompt "..."

The base weights stay frozen; low-rank updates of the chosen linear layers train. Only the method differs from
xla/finetune/adapter.py and full.py; the loop (lit_gpt/training.py, with lit_gpt/recipes/xla_finetune.py) writes sharded checkpoints to
out_dir/step-XXXXXX/ (`--resume auto` continues from the newest complete one) and, at the end,
out_dir/final/lit_model.lora.safetensors: the same file finetune/lora.py writes, loadable on any machine.
See xla/README.md for TPU VMs.
"""

from pathlib import Path
from typing import Literal, Optional, Union

from lit_gpt import lora
from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, load_config, load_run_data
from lit_gpt.recipes.xla_finetune import fit, load_model, setup_fabric
from lit_gpt.training import Method
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli
from lit_gpt.xla.runtime import XLARuntime


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    out_dir: str = "out/xla/lora/alpaca",
    precision: Optional[str] = None,
    devices: Union[int, str] = "auto",
    resume: Union[bool, Literal["auto"], str] = False,
    activation_checkpointing: bool = False,
    scan_layers: Union[bool, Literal["auto"]] = "auto",
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
    data: DataArgs = DataArgs(pad_pow2=True),
    train: TrainArgs = TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-4, lr_warmup_steps=20),
    eval: EvalArgs = EvalArgs(),
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    compile_cache_dir: Optional[Path] = None,
    xla_metrics: bool = False,
    accelerator: str = "auto",
) -> dict:
    """Finetune a model with LoRA on prepared instruction data, on XLA devices.

    Args:
        checkpoint_dir: The base model (a converted lit checkpoint directory).
        out_dir: Where sharded checkpoints (step-XXXXXX/), the final LoRA weights (final/) and logs go:
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
        lora_r: Rank of the updates.
        lora_alpha: The updates are scaled by alpha / r.
        lora_dropout: Dropout on the input of the updates.
        lora_query: Update the query projection (part of the fused qkv layer).
        lora_key: Update the key projection.
        lora_value: Update the value projection.
        lora_projection: Update the attention output projection.
        lora_mlp: Update the MLP's linear layers.
        lora_head: Update the output head.
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
    config = load_config(
        checkpoint_dir, lora.Config, lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        lora_query=lora_query, lora_key=lora_key, lora_value=lora_value, lora_projection=lora_projection,
        lora_mlp=lora_mlp, lora_head=lora_head,
    )
    fabric = setup_fabric(devices, precision, train, out_dir, logger_name, activation_checkpointing,
                          compile_cache_dir, resume=resume, accelerator=accelerator, scan_layers=scan_layers)
    run = FinetuneRun("lora", checkpoint_dir, out_dir, config, data, train, eval, resume, optimizer, platform="xla",
                      options={"xla_metrics": xla_metrics})
    return fabric.launch(main, run)


def main(fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = XLARuntime(fabric)  # the one training loop, with XLA's placement, graph cuts and checkpoints
    data = load_run_data(runtime, run)

    # the method: LoRA layers on the frozen base model; only the LoRA matrices train and are saved
    model = load_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir, own_filter=lora.lora_filter)
    lora.mark_only_lora_as_trainable(model)
    method = Method(name="lora", save_filter=finetuned_filter(model), metadata=finetuned_metadata(model))

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


if __name__ == "__main__":
    run_cli(setup)
