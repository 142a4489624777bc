"""LLaMA-Adapter v2 finetuning: the base weights stay frozen; the adapter prompts and gates (from
`adapter_start_layer` on), a scale and bias on every linear layer, and the norms train.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/adapter_v2.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/alpaca
    python generate/adapter_v2.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --adapter_path out/adapter_v2/alpaca/final/lit_model.adapter_v2.safetensors --prompt "..."

Only those weights are saved (`lit_model.adapter_v2.safetensors`, with the adapter settings in
`lit_model.adapter_v2.json`; see `lit_gpt.weights`). The flags are finetune/adapter.py's.
"""

import lightning as L

from lit_gpt import adapter_v2
from lit_gpt.args import TrainArgs
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, finetune_command, fit, load_run_data, setup_model
from lit_gpt.recipes.flags import ADAPTER
from lit_gpt.runtime import Runtime
from lit_gpt.training import Method
from lit_gpt.utils import run_cli


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)
    data = load_run_data(runtime, run)

    # the method: adapter prompts, gates, linear scales/biases and norms on the frozen base model train and are saved
    model, raw_model = setup_model(fabric, lambda: adapter_v2.GPT(run.config), run.checkpoint_dir,
                                   own_filter=adapter_v2.adapter_v2_filter,
                                   mark_trainable=adapter_v2.mark_only_adapter_v2_as_trainable)
    method = Method("adapter_v2", save_filter=finetuned_filter(raw_model), metadata=finetuned_metadata(raw_model))
    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


setup = finetune_command(
    "adapter_v2", main, adapter_v2.Config, "Finetune a model with LLaMA-Adapter v2 on prepared instruction data.",
    own=ADAPTER, out_dir="out/adapter_v2/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-3, weight_decay=0.02),
)

if __name__ == "__main__":
    run_cli(setup)
