"""Full finetuning on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python xla/finetune/full.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python generate/base.py --checkpoint_dir out/xla/full/alpaca/final --prompt_style alpaca --prompt "..."

Every weight trains (parameters, gradients and optimizer state are sharded over the devices). Only the method
differs from xla/finetune/adapter.py and lora.py; the loop (lit_gpt/training.py, set up by
lit_gpt/recipes/xla_finetune.py) writes sharded checkpoints to out_dir/step-XXXXXX/ (`--resume auto` continues from
the newest complete one) and, at the end, the complete checkpoint folder out_dir/final/ (lit_model.safetensors,
streamed out of the shards, plus config and tokenizer): what finetune/full.py writes, loadable on any machine.
See xla/README.md for TPU VMs.
The flags are every XLA finetune recipe's (`lit_gpt.recipes.flags.XLA_FINETUNE`).
"""

from lit_gpt.args import TrainArgs
from lit_gpt.model import GPT
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, load_run_data
from lit_gpt.recipes.xla_finetune import fit, load_model, xla_finetune_command
from lit_gpt.training import Method
from lit_gpt.utils import run_cli
from lit_gpt.xla.hosts import check_hosts_agree
from lit_gpt.xla.runtime import XLARuntime


def main(fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = XLARuntime(fabric)  # the one training loop, with XLA's placement, graph cuts and checkpoints
    data = load_run_data(runtime, run)
    check_hosts_agree(run, data)  # every host: the same arguments, data, base weights and resume point

    # the method: the plain model, every parameter trains and is saved
    model = load_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
    method = Method(name="full")

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


setup = xla_finetune_command(
    "full", main, None, "Finetune all weights of a model on prepared instruction data, on XLA devices.",
    out_dir="out/xla/full/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-5, min_lr=3e-6),
)

if __name__ == "__main__":
    run_cli(setup)
