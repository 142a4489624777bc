"""Preference tuning with DPO on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_preferences.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --data_file prefs.jsonl --destination_path data/preferences
    python xla/finetune/dpo.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/preferences
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/dpo/preferences/final/lit_model.lora.safetensors --prompt "..."

finetune/dpo.py's run on XLA: the same objective (`lit_gpt.objectives.DPO`), the same loop, XLA's runtime (batches of
pairs padded to power-of-two lengths, so the train step compiles once per length bucket; sharded checkpoints,
`--resume auto`, the final export loadable anywhere). LoRA by default (the reference is the model with its adapters
switched off); `--method full` uses reference log-probabilities computed once before training.
The flags are every XLA finetune recipe's (`lit_gpt.recipes.flags.XLA_FINETUNE`) plus the LoRA settings, `--method`
and `--dpo.*`.
"""

from pathlib import Path

from lit_gpt import lora
from lit_gpt.args import DataArgs, TrainArgs
from lit_gpt.model import GPT
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.dpo import DPO_FLAGS, check, finish, with_reference
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, load_run_data
from lit_gpt.recipes.flags import LORA
from lit_gpt.recipes.xla_finetune import fit, load_model, xla_finetune_command
from lit_gpt.training import Method
from lit_gpt.utils import run_cli
from lit_gpt.xla.hosts import check_hosts_agree
from lit_gpt.xla.runtime import XLARuntime


def main(fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = XLARuntime(fabric)  # the one training loop, with XLA's placement, graph cuts and checkpoints
    data = load_run_data(runtime, run)  # preference pairs
    check_hosts_agree(run, data)  # every host: the same arguments, data, base weights and resume point

    # the method: LoRA on the frozen base (only the LoRA matrices train and are saved), or every weight
    if run.method == "lora":
        model = load_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir, own_filter=lora.lora_filter)
        lora.mark_only_lora_as_trainable(model)
        method = Method("lora", finetuned_filter(model), finetuned_metadata(model), run.objective)
    else:
        model = load_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
        method = Method("full", objective=run.objective)

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    with_reference(runtime, wrapped, data, run)  # --dpo.reference precomputed: one pass over the pairs, before training
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


setup = xla_finetune_command(
    "dpo", main, lora.Config, "Tune a model on preference pairs with DPO on XLA devices (LoRA, or --method full).",
    own=LORA, tail=DPO_FLAGS, check=check, finish=finish, out_dir="out/xla/dpo/preferences",
    data=DataArgs(data_dir=Path("data/preferences"), pad_pow2=True),
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=5e-6, min_lr=5e-7, lr_warmup_steps=10),
)

if __name__ == "__main__":
    run_cli(setup)
