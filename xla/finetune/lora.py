"""LoRA finetuning on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), FSDP over SPMD on all devices.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python xla/finetune/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/xla/lora/alpaca/final/lit_model.lora.safetensors --prompt_style alpaca --prompt "..."

The base weights stay frozen; low-rank updates of the chosen linear layers train. Only the method differs from
xla/finetune/adapter.py and full.py; the loop (lit_gpt/training.py, set up by lit_gpt/recipes/xla_finetune.py) writes sharded
checkpoints to out_dir/step-XXXXXX/ (`--resume auto` continues from the newest complete one) and, at the end,
out_dir/final/lit_model.lora.safetensors: the same file finetune/lora.py writes, loadable on any machine.
`--lora_init_from FILE` starts the LoRA matrices from a LoRA file (a run's, or a PEFT adapter imported with
scripts/convert_hf_checkpoint.py --peft_path), as in finetune/lora.py.
See xla/README.md for TPU VMs.
The flags are every XLA finetune recipe's (`lit_gpt.recipes.flags.XLA_FINETUNE`) plus the method's own (`LORA`,
`LORA_INIT`, and `--quantize mxfp4`: gpt-oss's experts frozen packed in MXFP4, as finetune/lora.py's).
"""

from lit_gpt import lora
from lit_gpt.args import TrainArgs
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.recipes.finetune import FinetuneRun, build_optimizer, check_mxfp4_lora, load_run_data, lora_init_from
from lit_gpt.recipes.flags import LORA, LORA_INIT, XLA_QLORA
from lit_gpt.recipes.xla_finetune import fit, load_model, xla_finetune_command
from lit_gpt.training import Method
from lit_gpt.utils import LitError, run_cli
from lit_gpt.xla.hosts import check_hosts_agree
from lit_gpt.xla.runtime import XLARuntime


def main(fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = XLARuntime(fabric)  # the one training loop, with XLA's placement, graph cuts and checkpoints
    data = load_run_data(runtime, run)
    check_hosts_agree(run, data)  # every host: the same arguments, data, base weights and resume point

    # the method: LoRA layers on the frozen base model (starting afresh, or from --lora_init_from); only the LoRA
    # matrices train and are saved
    model = load_model(fabric, lambda: lora.GPT(run.config), run.checkpoint_dir, own_filter=lora.lora_filter,
                       init_from=run.init_from, quantize=run.quantize)  # mxfp4: the experts placed packed, frozen
    if run.quantize:
        import sys

        from lit_gpt.mxfp4 import packed_bytes

        fabric.print(f"Experts kept packed in MXFP4, frozen: {packed_bytes(model):,} bytes", file=sys.stderr)
    lora.mark_only_lora_as_trainable(model)
    method = Method(name="lora", save_filter=finetuned_filter(model), metadata=finetuned_metadata(model))

    wrapped, opt = fabric.setup(model, build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, wrapped, model, opt, data, method, run)


def check_quantize(flags) -> None:
    """--quantize: mxfp4 only (gpt-oss's experts kept packed; bitsandbytes' nf4 is a CUDA kernel), one line before
    anything is loaded; with it the blocks run as a loop (--scan_layers auto: false)."""
    quantize = flags["quantize"]
    if quantize is None:
        return
    if quantize != "mxfp4":
        raise LitError(f"--quantize {quantize} is not available on XLA: use mxfp4 (gpt-oss's experts) or run without"
                       " --quantize (bnb.nf4 runs on CUDA with finetune/lora.py)")
    check_mxfp4_lora(flags)
    # the packed experts are buffers of each block, which torch_xla's scan does not carry: the blocks run as a loop
    if flags["scan_layers"] is True:
        raise LitError("--scan_layers true does not combine with --quantize mxfp4 (torch_xla's scan takes the blocks'"
                       " parameters, not their packed experts): use --scan_layers auto or false")
    flags["scan_layers"] = False  # "auto": the loop


setup = xla_finetune_command(
    "lora", main, lora.Config, "Finetune a model with LoRA on prepared instruction data, on XLA devices.",
    own=LORA, tail=[*LORA_INIT, *XLA_QLORA], check=check_quantize, finish=lora_init_from, out_dir="out/xla/lora/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-4),
)

if __name__ == "__main__":
    run_cli(setup)
