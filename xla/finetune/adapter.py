"""LLaMA-Adapter finetuning on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python xla/finetune/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python generate/adapter.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --adapter_path out/xla/adapter/alpaca/final/lit_model.adapter.safetensors --prompt_style alpaca --prompt "..."

The base weights stay frozen; the adapter prompts and gates train. Only the method differs from
xla/finetune/lora.py and full.py; the loop (lit_gpt/training.py, set up by lit_gpt/recipes/xla_finetune.py) writes sharded
checkpoints to out_dir/step-XXXXXX/ (`--resume auto` continues from the newest complete one) and, at the end,
out_dir/final/lit_model.adapter.safetensors: the same file finetune/adapter.py writes, loadable on any machine.
See xla/README.md for TPU VMs.
The flags are every XLA finetune recipe's (`lit_gpt.recipes.flags.XLA_FINETUNE`) plus the method's own (`ADAPTER`).
"""

from lit_gpt import adapter
from lit_gpt.args import TrainArgs
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, load_run_data
from lit_gpt.recipes.flags import ADAPTER
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

    # the method: adapter layers on the frozen base model; only the adapter weights train and are saved
    model = load_model(fabric, lambda: adapter.GPT(run.config), run.checkpoint_dir, own_filter=adapter.adapter_filter)
    adapter.mark_only_adapter_as_trainable(model)
    method = Method(name="adapter", save_filter=finetuned_filter(model), metadata=finetuned_metadata(model))

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


setup = xla_finetune_command(
    "adapter", main, adapter.Config,
    "Finetune a model with LLaMA-Adapter on prepared instruction data, on XLA devices.", own=ADAPTER, out_dir="out/xla/adapter/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-3),
)

if __name__ == "__main__":
    run_cli(setup)
