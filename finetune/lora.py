"""LoRA finetuning: the base weights stay frozen; low-rank updates of the chosen linear layers train.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python finetune/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data.data_dir data/alpaca
    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.lora.safetensors --prompt "..."

QLoRA on a CUDA GPU (the frozen base weights in 4-bit NormalFloat through bitsandbytes, `pip install
bitsandbytes`; the LoRA matrices train in the precision's dtype):

    python finetune/lora.py --quantize bnb.nf4 --checkpoint_dir ... --data.data_dir data/alpaca

gpt-oss with its experts frozen in MXFP4 (every device: the experts of a checkpoint converted from the Hub's MXFP4
weights packed back without loss after loading, 4.25 bits per weight, decoded per matmul; LoRA trains the attention
and whatever else the LoRA flags pick, not the experts):

    python finetune/lora.py --quantize mxfp4 --checkpoint_dir checkpoints/openai/gpt-oss-20b --data.data_dir ...

Mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss): `--lora_experts true` adds a rank-r update to every expert's
three linear layers; `--lora_mlp` adapts the dense MLP layers only, and the router stays frozen. The router's
load-balancing loss joins the objective with the checkpoint's `router_aux_loss_coef` (`--moe.router_aux_loss_coef`
sets another; it is logged as `aux_loss`, the per-expert load beside the metrics in `expert_load.csv`).

`--lora_init_from FILE` starts the LoRA matrices from a LoRA file instead of afresh: a run's
`lit_model.lora.safetensors`, or a Hugging Face PEFT adapter imported with `scripts/convert_hf_checkpoint.py
--peft_path` (tutorials/convert.md), so a community LoRA trains further here. Its base and r, alpha and adapted
layers must be the run's (one error line says which flags to pass).

Only the LoRA matrices are saved (`lit_model.lora.safetensors`, with the LoRA settings needed to rebuild the model
in `lit_model.lora.json`; see `lit_gpt.weights`). `scripts/merge_lora.py` folds them into a standalone checkpoint.
The flags are every CPU/CUDA finetune recipe's (`lit_gpt.recipes.flags.FINETUNE`) plus the LoRA settings,
`--lora_init_from` and `--quantize`.
"""

from functools import partial
from typing import Any, Dict

import lightning as L
import torch

from lit_gpt import lora
from lit_gpt.args import TrainArgs
from lit_gpt.peft import finetuned_filter, finetuned_metadata
from lit_gpt.quantize import check_quantize, quantize_model
from lit_gpt.recipes.finetune import (FinetuneRun, build_optimizer, check_mxfp4_lora, finetune_command, fit,
                                      load_run_data, lora_init_from, setup_model)
from lit_gpt.recipes.flags import LORA, LORA_INIT, QLORA
from lit_gpt.runtime import Runtime, resolve_accelerator
from lit_gpt.training import Method
from lit_gpt.utils import LitError, run_cli

QLORA_CHOICES = ("bnb.nf4", "mxfp4")


def main(fabric: L.Fabric, run: FinetuneRun) -> dict:
    fabric.seed_everything(run.train.seed)
    runtime = Runtime(fabric)  # CPU / CUDA (the XLA recipes pass XLARuntime to the same loop)
    data = load_run_data(runtime, run)  # checked before any weights are read

    # the method: LoRA layers on the frozen base model (starting afresh, or from --lora_init_from); only the LoRA
    # matrices train and are saved. QLoRA: the frozen base weights become 4-bit ones, layer by layer, as they move
    # to the GPU; mxfp4: the frozen experts are packed in MXFP4, projection by projection, onto the device
    model, raw_model = setup_model(
        fabric, lambda: lora.GPT(run.config), run.checkpoint_dir, own_filter=lora.lora_filter,
        mark_trainable=lora.mark_only_lora_as_trainable,
        quantize=partial(quantize_model, mode=run.quantize, device=fabric.device) if run.quantize else None,
        init_from=run.init_from,
    )
    method = Method(name="lora", save_filter=finetuned_filter(raw_model), metadata=finetuned_metadata(raw_model))

    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    return fit(fabric, runtime, model, raw_model, optimizer, data, method, run)


def check_qlora(flags: Dict[str, Any]) -> None:
    """One line, before anything is loaded, for a --quantize that cannot run here."""
    quantize = flags["quantize"]
    if quantize is None:
        return
    if flags["train"].compile:
        raise LitError("--train.compile is not supported with --quantize: drop one of the two")
    device = torch.device(resolve_accelerator(flags["accelerator"]))
    check_quantize(quantize, device, torch.bfloat16, choices=QLORA_CHOICES)
    if quantize == "mxfp4":
        check_mxfp4_lora(flags)
    if flags["devices"] * flags["num_nodes"] > 1 and flags["strategy"] != "ddp":
        raise LitError("--quantize does not combine with FSDP (4-bit weights are not sharded): add --strategy ddp")


setup = finetune_command(
    "lora", main, lora.Config, "Finetune a model with LoRA on prepared instruction data.", own=LORA,
    tail=[*LORA_INIT, *QLORA], check=check_qlora, finish=lora_init_from, out_dir="out/lora/alpaca",
    train=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-4),
)

if __name__ == "__main__":
    run_cli(setup)
