"""Preference tuning with DPO (direct preference optimisation): the model learns to prefer the chosen reply of each
pair over the rejected one, relative to a reference model, with TRL's losses (`--dpo.loss sigmoid|robust|hinge|ipo`).

    python scripts/prepare_preferences.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --data_file prefs.jsonl --destination_path data/preferences
    python finetune/dpo.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/preferences
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/dpo/preferences/final/lit_model.lora.safetensors --prompt "..."

LoRA by default (the reference is the same model with its adapters switched off: no second copy of the weights);
`--method full` trains every weight against reference log-probabilities computed once before training
(`--dpo.reference precomputed`, kept in out_dir/reference_logps.pt). After supervised finetuning with LoRA, merge
first (`scripts/merge_lora.py`) and tune the merged checkpoint. DPO is an objective of the one training loop: batches,
checkpoints, `--resume auto`, logging and the final export are those of finetune/lora.py and full.py; `--train.*_batch_size`
count pairs. Logged beside the loss: rewards_chosen / rewards_rejected (beta x the log-ratio to the reference),
reward_accuracy and reward_margin, and their validation values.
The flags are every CPU/CUDA finetune recipe's (`lit_gpt.recipes.flags.FINETUNE`) plus the LoRA settings, `--method`
and `--dpo.*`.
"""

from pathlib import Path

import lightning as L

from lit_gpt import lora
from lit_gpt.args import DataArgs, TrainArgs
from lit_gpt.model import GPT
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.dpo import DPO_FLAGS, check, finish, with_reference
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, finetune_command, fit, load_run_data, setup_model
from lit_gpt.recipes.flags import LORA
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import run_cli


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (xla/finetune/dpo.py passes XLARuntime to the same loop)
    data = load_run_data(runtime, run)  # preference pairs, checked before any weights are read

    # the method: LoRA on the frozen base (only the LoRA matrices train and are saved), or every weight
    if run.method == "lora":
        model, raw_model = setup_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir,
                                       own_filter=lora.lora_filter, mark_trainable=lora.mark_only_lora_as_trainable)
        method = Method("lora", finetuned_filter(raw_model), finetuned_metadata(raw_model), run.objective)
    else:
        model, raw_model = setup_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
        method = Method("full", objective=run.objective)
    with_reference(runtime, model, data, run)  # --dpo.reference precomputed: one pass over the pairs, before training

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


setup = finetune_command(
    "dpo", main, lora.Config, "Tune a model on preference pairs with DPO (LoRA by default, or --method full).",
    own=LORA, tail=DPO_FLAGS, check=check, finish=finish, out_dir="out/dpo/preferences",
    data=DataArgs(data_dir=Path("data/preferences")), train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=5e-6, min_lr=5e-7, lr_warmup_steps=10),
)

if __name__ == "__main__":
    run_cli(setup)
