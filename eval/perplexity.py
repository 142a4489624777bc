"""Perplexity of a checkpoint on a text: a base model, a full finetune, or a base with LoRA or adapter weights.

    python eval/perplexity.py --data_path my_text.txt --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M
    python eval/perplexity.py --data_path docs.jsonl --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.lora.safetensors --window 1024 --stride 512 --batch_size 4
    python eval/perplexity.py --data_path my_text.txt --checkpoint_dir out/full/alpaca/final     # a full finetune
    PJRT_DEVICE=CPU python eval/perplexity.py --data_path my_text.txt --accelerator xla         # on XLA (or a TPU)

`--data_path`: a .txt file (the whole file is one text) or a .json / .jsonl file of rows with a "text" field (each
row its own document: no window crosses two rows). The text is cut into windows of `--window` tokens (default:
the model's context) every `--stride` tokens (default: the window), transformers' strided sliding window; each
window scores the tokens no earlier window reached, and the result is the exact token-weighted perplexity
exp(total NLL / tokens scored) (see lit_gpt/perplexity.py). Smaller strides give each token more context (a lower
perplexity) at more forwards.

Output: a progress bar over the windows (stderr), a table (model, data, tokens scored, nll/token, perplexity) on
stdout, and the results as JSON in `--out_dir`/perplexity.json; by default next to what was evaluated, in an eval/
folder: beside the finetuned weights file, else in the checkpoint folder. On XLA every batch has one shape (the
window, the batch size rounded up to the devices), so the forward compiles once. Bad input (a missing file, no text,
rows without "text", --stride > --window, --window beyond the model's context) is one `error:` line, and nothing is
written.
"""

import sys
from pathlib import Path
from typing import Any, List, Optional

from lit_gpt.recipes.evaluate import EVAL_FLAGS, load_eval_model, perplexity_request, run_perplexity
from lit_gpt.recipes.flags import Flag, command, values
from lit_gpt.utils import run_cli

FLAGS: List[Flag] = [
    Flag("data_path", Optional[Path], None,
         'The text: a .txt file (one document), or a .json / .jsonl file of rows with a "text" field (one document\n'
         "each; windows never cross rows)."),
    *EVAL_FLAGS,
    Flag("window", Optional[int], None, "Tokens per window (per forward): default and at most the model's context."),
    Flag("stride", Optional[int], None,
         "Tokens between the starts of two windows (default: the window; at most the window). Each window scores the\n"
         "tokens no earlier window reached, with the rest of it as context."),
    Flag("batch_size", int, 1, "Windows per forward."),
    Flag("out_dir", Optional[Path], None,
         "Where perplexity.json goes (default: an eval/ folder beside the finetuned weights file, else in the\n"
         "checkpoint folder)."),
]


def main(**flags: Any) -> None:
    model_flags = values(flags, EVAL_FLAGS)
    request = perplexity_request(**{k: v for k, v in flags.items() if k != "allow_other_base"})  # checks, no weights
    loaded = load_eval_model(**model_flags)
    print("Prompt style: raw (perplexity scores the text as it is, no template)", file=sys.stderr)
    run_perplexity(loaded, request)  # progress bar, table, results JSON


setup = command("Perplexity of a checkpoint (base, LoRA, adapter or full finetune) on a text or JSON file.", FLAGS,
                main)

if __name__ == "__main__":
    run_cli(setup)
