"""Logit distillation on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python xla/finetune/distill.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --teacher_dir checkpoints/HuggingFaceTB/SmolLM2-360M-Instruct --data.data_dir data/alpaca
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/distill/alpaca/final/lit_model.lora.safetensors --prompt "..."

finetune/distill.py's run on XLA: the same objective (`lit_gpt.distill.Distill`), the same loop, XLA's runtime
(batches padded to power-of-two lengths, so the train step, the teacher's forward inside it, compiles once per
length bucket; sharded checkpoints, `--resume auto`, the final export loadable anywhere). The teacher is staged block
by block onto the devices and sharded over the mesh like the student, frozen. LoRA by default, or `--method full`.
The flags are every XLA finetune recipe's (`lit_gpt.recipes.flags.XLA_FINETUNE`) plus the LoRA settings, `--method`,
`--teacher_dir` and `--distill.*`.
"""

from lit_gpt import lora
from lit_gpt.args import TrainArgs
from lit_gpt.model import GPT
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.distill import DISTILL_FLAGS, attach_teacher, check, finish
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
    data = load_run_data(runtime, run)  # the SFT data
    check_hosts_agree(run, data)  # every host: the same arguments, data, base weights and resume point

    # the student: LoRA on the frozen base (only the LoRA matrices train and are saved), or every weight
    if run.method == "lora":
        model = load_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir, own_filter=lora.lora_filter)
        lora.mark_only_lora_as_trainable(model)
        method = Method("lora", finetuned_filter(model), finetuned_metadata(model), run.objective)
    else:
        model = load_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
        method = Method("full", objective=run.objective)
    attach_teacher(fabric, run, xla=True)  # the teacher: frozen, staged onto the devices and sharded

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


setup = xla_finetune_command(
    "distill", main, lora.Config, "Distil a teacher's logits into a student on XLA devices (LoRA, or --method full).",
    own=LORA, tail=DISTILL_FLAGS, check=check, finish=finish, out_dir="out/xla/distill/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-4),
)

if __name__ == "__main__":
    run_cli(setup)
