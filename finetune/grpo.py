"""Reinforcement learning with verifiable rewards (GRPO): for each prompt the model samples a group of completions,
reward functions score them, and the model is pushed toward the completions that scored above their group's mean
(TRL's GRPOTrainer losses: `--grpo.loss grpo|dr_grpo|dapo`).

    python scripts/prepare_prompts.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --data_file additions.jsonl --destination_path data/prompts
    python finetune/grpo.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/prompts \\
        --grpo.group_size 8 --grpo.max_new_tokens 16 --reward answer_match --reward number_only=0.5
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/grpo/prompts/final/lit_model.lora.safetensors --prompt "..."

LoRA by default (with `--grpo.beta` > 0 the reference is the same model with its adapters switched off); `--method
full` trains every weight (the reference: a frozen copy of the base). Each step generates with the one generation
loop (`--grpo.temperature`, `--grpo.top_p`, `--grpo.max_new_tokens`), scores with `--reward` (built in:
answer_match, number_only; or module:function), and trains on the group-relative advantages. `--train.*_batch_size`
count prompts (each brings `--grpo.group_size` completions). Logged per step beside the loss: the mean and std reward
per function, KL to the reference, clip fraction, completion length, generation time; validation: the held-out
prompts' greedy rewards (`val_reward`). GRPO is an objective of the one training loop: checkpoints, `--resume auto`,
logging and the final export are those of finetune/lora.py and full.py.
The flags are every CPU/CUDA finetune recipe's (`lit_gpt.recipes.flags.FINETUNE`) plus the LoRA settings, `--method`,
`--grpo.*` and `--reward`.
"""

import sys
from pathlib import Path

import lightning as L

from lit_gpt import lora
from lit_gpt.args import DataArgs, TrainArgs
from lit_gpt.model import GPT
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, finetune_command, fit, load_run_data, setup_model
from lit_gpt.recipes.flags import LORA
from lit_gpt.recipes.grpo import GRPO_FLAGS, attach, check, finish, reward_argv
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import run_cli


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (xla/finetune/grpo.py passes XLARuntime to the same loop)
    data = load_run_data(runtime, run)  # prompts with their answers, checked before any weights are read

    # the method: LoRA on the frozen base (only the LoRA matrices train and are saved), or every weight
    if run.method == "lora":
        model, raw_model = setup_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir,
                                       own_filter=lora.lora_filter, mark_trainable=lora.mark_only_lora_as_trainable)
        method = Method("lora", finetuned_filter(raw_model), finetuned_metadata(raw_model), run.objective)
    else:
        model, raw_model = setup_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
        method = Method("full", objective=run.objective)
    attach(run, raw_model)  # the tokenizer for the rewards; --method full with beta > 0: a frozen reference copy

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


setup = finetune_command(
    "grpo", main, lora.Config, "Tune a model with GRPO on verifiable rewards (LoRA by default, or --method full).",
    own=LORA, tail=GRPO_FLAGS, check=check, finish=finish, out_dir="out/grpo/prompts",
    data=DataArgs(data_dir=Path("data/prompts")),
    train=TrainArgs(global_batch_size=4, micro_batch_size=1, learning_rate=1e-5, min_lr=1e-6, lr_warmup_steps=0),
)

if __name__ == "__main__":
    run_cli(setup, args=reward_argv(sys.argv[1:]))  # a repeated --reward adds a reward (not the last wins)
