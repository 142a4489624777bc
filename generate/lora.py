"""Generate with a base checkpoint plus the LoRA weights that `finetune/lora.py` wrote.

    python generate/lora.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.lora.safetensors --prompt_style alpaca \\
        --prompt "What food do llamas eat?"

Flags and output as in `generate/base.py`, plus `--lora_path` and `--allow_other_base`. The LoRA updates are merged
into the weights after loading, in the --precision's dtype (then `--quantize` applies); `scripts/merge_lora.py`
writes such a merged checkpoint once and for all. `--lora_path` also takes a PEFT adapter imported with
`scripts/convert_hf_checkpoint.py --peft_path`.
"""

from pathlib import Path
from typing import Optional

import lightning as L
import torch

from lit_gpt import lora
from lit_gpt.peft import load_variant_model
from lit_gpt.recipes.flags import Flag
from lit_gpt.recipes.generate import ALLOW_OTHER_BASE, GenerationArgs, generate_command, run
from lit_gpt.runtime import param_dtype
from lit_gpt.utils import run_cli

LORA_PATH = Flag("lora_path", Path, Path("out/lora/alpaca/final/lit_model.lora.safetensors"),
                 "The LoRA weights written by finetune/lora.py (lit_model.lora.safetensors).")


def load(args: GenerationArgs, dtype: Optional[torch.dtype] = None) -> lora.GPT:
    model = load_variant_model(lora.GPT, lora.Config, args.checkpoint_dir, args.finetuned_path,
                              allow_other_base=args.allow_other_base)
    # fold B A into the weights (generation runs at base-model speed) in the precision's dtype: a bf16 base under
    # 32-true is cast first, else the merged weights would be rounded to bf16
    lora.merge_lora_weights(model, dtype=dtype)
    return model


def main(fabric: L.Fabric, args: GenerationArgs) -> None:
    dtype = param_dtype(fabric.strategy.precision.precision)
    # generate/base.py's steps, with this load
    run(fabric, args, lambda a: load(a, dtype), weights=("--lora_path", "finetune/lora.py"))


setup = generate_command("Generate `num_samples` continuations of a prompt with the LoRA-finetuned model.", main,
                         own=[LORA_PATH, ALLOW_OTHER_BASE])

if __name__ == "__main__":
    run_cli(setup)
