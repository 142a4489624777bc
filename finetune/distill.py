"""Logit distillation: a student learns a teacher's next-token distributions on the responses of SFT data (forward
KL, or TRL GKD's generalised JSD: `--distill.loss forward_kl|jsd`), mixed with the SFT cross-entropy.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/distill.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --teacher_dir checkpoints/HuggingFaceTB/SmolLM2-360M-Instruct --data.data_dir data/alpaca
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/distill/alpaca/final/lit_model.lora.safetensors --prompt "..."

The student is --checkpoint_dir: LoRA by default, `--method full` trains every weight. The teacher (--teacher_dir, a
converted checkpoint with the student's tokenizer; another tokenizer is refused in one line) is frozen and run
without gradient on every micro-batch, in the student's precision: its logits are computed on the fly. The loss per
response token is alpha x divergence + (1 - alpha) x cross-entropy (`--distill.alpha`, torchtune's kd_ratio); the
divergence is TRL's `GKDTrainer.generalized_jsd_loss` (beta 0 of it for forward_kl) at `--distill.temperature`.
Distillation is an objective of the one training loop: batches, checkpoints, `--resume auto`, logging and the final
export are those of finetune/lora.py and full.py. Logged beside the loss: distill_loss and sft_loss (means per
response token; with temperature 1 and forward_kl, val_distill_loss is the held-out KL(teacher || student)).
The flags are every CPU/CUDA finetune recipe's (`lit_gpt.recipes.flags.FINETUNE`) plus the LoRA settings, `--method`,
`--teacher_dir` and `--distill.*`.
"""

import lightning as L

from lit_gpt import lora
from lit_gpt.args import TrainArgs
from lit_gpt.model import GPT
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.distill import DISTILL_FLAGS, attach_teacher, check, finish
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, finetune_command, fit, load_run_data, setup_model
from lit_gpt.recipes.flags import LORA
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import run_cli


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (xla/finetune/distill.py passes XLARuntime to the same loop)
    data = load_run_data(runtime, run)  # the SFT data, checked before any weights are read

    # the student: LoRA on the frozen base (only the LoRA matrices train and are saved), or every weight
    if run.method == "lora":
        model, raw_model = setup_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir,
                                       own_filter=lora.lora_filter, mark_trainable=lora.mark_only_lora_as_trainable)
        method = Method("lora", finetuned_filter(raw_model), finetuned_metadata(raw_model), run.objective)
    else:
        model, raw_model = setup_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
        method = Method("full", objective=run.objective)
    attach_teacher(fabric, run)  # the teacher: frozen, in the student's dtype, on the device

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


setup = finetune_command(
    "distill", main, lora.Config, "Distil a teacher's logits into a student on SFT data (LoRA, or --method full).",
    own=LORA, tail=DISTILL_FLAGS, check=check, finish=finish, out_dir="out/distill/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-4),
)

if __name__ == "__main__":
    run_cli(setup)
