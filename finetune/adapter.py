"""LLaMA-Adapter finetuning: the base weights stay frozen; learned prompt vectors and their gates train in the
attention layers from `adapter_start_layer` on.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/alpaca
    python generate/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --adapter_path out/adapter/alpaca/final/lit_model.adapter.safetensors --prompt "..."

Only the adapter weights are saved (`lit_model.adapter.safetensors`, with the adapter settings in
`lit_model.adapter.json`; see `lit_gpt.weights`). The flags are every CPU/CUDA finetune recipe's
(`lit_gpt.recipes.flags.FINETUNE`) plus `--adapter_prompt_length` and `--adapter_start_layer`.
"""

import lightning as L

from lit_gpt import adapter
from lit_gpt.args import TrainArgs
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, finetune_command, fit, load_run_data, setup_model
from lit_gpt.recipes.flags import ADAPTER
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import run_cli


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (the XLA recipes pass XLARuntime to the same loop)
    data = load_run_data(runtime, run)  # checked before any weights are read

    # the method: adapter prompts and gates on the frozen base model; only they train and are saved
    model, raw_model = setup_model(
        fabric, lambda: adapter.GPT(run.config), run.checkpoint_dir,
        own_filter=adapter.adapter_filter, mark_trainable=adapter.mark_only_adapter_as_trainable,
    )
    method = Method(name="adapter", save_filter=finetuned_filter(raw_model), metadata=finetuned_metadata(raw_model))

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


setup = finetune_command(
    "adapter", main, adapter.Config, "Finetune a model with LLaMA-Adapter on prepared instruction data.", own=ADAPTER,
    out_dir="out/adapter/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-3, weight_decay=0.02),
)

if __name__ == "__main__":
    run_cli(setup)
