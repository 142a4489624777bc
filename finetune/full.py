"""Full finetuning: every weight of the model trains.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/full.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/alpaca
    python generate/base.py --checkpoint_dir out/full/alpaca/final --prompt "..."

The result (`out_dir/final/`) is a complete checkpoint directory: lit_model.safetensors, lit_config.json and the
tokenizer (see `lit_gpt.weights` for the format). The flags are every CPU/CUDA finetune recipe's
(`lit_gpt.recipes.flags.FINETUNE`); `--help` lists them.
"""

import lightning as L

from lit_gpt.args import TrainArgs
from lit_gpt.model import GPT
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, finetune_command, fit, load_run_data, setup_model
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import run_cli


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (the XLA recipes pass XLARuntime to the same loop)
    data = load_run_data(runtime, run)  # checked before any weights are read

    # the method: the plain model, every parameter trains and is saved
    model, raw_model = setup_model(fabric, lambda: GPT(run.config), run.checkpoint_dir)
    method = Method(name="full")

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


setup = finetune_command(
    "full", main, None, "Finetune all weights of a model on prepared instruction data.",
    out_dir="out/full/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-5, min_lr=3e-6),
)

if __name__ == "__main__":
    run_cli(setup)
