"""GRPO with verifiable rewards on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_prompts.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --data_file additions.jsonl --destination_path data/prompts
    python xla/finetune/grpo.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/prompts
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/grpo/prompts/final/lit_model.lora.safetensors --prompt "..."

finetune/grpo.py's run on XLA: the same objective (`lit_gpt.recipes.grpo.GRPO`), the same loop, XLA's runtime. Shapes
stay fixed so nothing compiles after warm-up: the prompts are right-padded to power-of-two buckets for the prefill,
the KV cache has one length (the longest prompt's bucket + `--grpo.max_new_tokens`), every row decodes to the same
columns, and the train rows (prompt + completion) are padded to power-of-two lengths with a fixed number of rows
(micro batch x group size) and completion columns (max_new_tokens). LoRA by default (the reference with adapters
off); `--method full` keeps a frozen copy of the base on the device as the reference when `--grpo.beta` > 0.
The flags are every XLA finetune recipe's (`lit_gpt.recipes.flags.XLA_FINETUNE`) plus the LoRA settings, `--method`,
`--grpo.*` and `--reward`.
"""

import sys
from pathlib import Path

from lit_gpt import lora
from lit_gpt.args import DataArgs, TrainArgs
from lit_gpt.model import GPT
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, load_run_data
from lit_gpt.recipes.flags import LORA
from lit_gpt.recipes.grpo import GRPO_FLAGS, attach, check, finish, reward_argv
from lit_gpt.recipes.xla_finetune import fit, load_model, xla_finetune_command
from lit_gpt.training import Method
from lit_gpt.utils import run_cli
from lit_gpt.xla.hosts import check_hosts_agree
from lit_gpt.xla.runtime import XLARuntime


def main(fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = XLARuntime(fabric)  # the one training loop, with XLA's placement, graph cuts and checkpoints
    data = load_run_data(runtime, run)  # prompts with their answers
    check_hosts_agree(run, data)  # every host: the same arguments, data, base weights and resume point

    # the method: LoRA on the frozen base (only the LoRA matrices train and are saved), or every weight
    if run.method == "lora":
        model = load_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir, own_filter=lora.lora_filter)
        lora.mark_only_lora_as_trainable(model)
        method = Method("lora", finetuned_filter(model), finetuned_metadata(model), run.objective)
    else:
        model = load_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
        method = Method("full", objective=run.objective)
    attach(run, model, fabric.device)  # the tokenizer; --method full with beta > 0: a frozen reference copy

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


setup = xla_finetune_command(
    "grpo", main, lora.Config, "Tune a model with GRPO on verifiable rewards on XLA devices (LoRA, or --method full).",
    own=LORA, tail=GRPO_FLAGS, check=check, finish=finish, out_dir="out/xla/grpo/prompts",
    data=DataArgs(data_dir=Path("data/prompts"), pad_pow2=True),
    train=TrainArgs(global_batch_size=4, micro_batch_size=1, learning_rate=1e-5, min_lr=1e-6, lr_warmup_steps=0),
)

if __name__ == "__main__":
    run_cli(setup, args=reward_argv(sys.argv[1:]))  # a repeated --reward adds a reward (not the last wins)
