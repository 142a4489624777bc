"""Prepare Databricks' Dolly 15k instruction data for finetuning.

    python scripts/prepare_dolly.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/prepare_dolly.py --data_file my_copy/databricks-dolly-15k.jsonl   # offline

Dolly's fields are instruction, context (optional, used as the input block) and response."""

from lit_gpt.prepare import make_prepare
from lit_gpt.utils import run_cli

# the flags, their defaults and their --help come from the "dolly" entry of lit_gpt.prepare.DATASETS
prepare = make_prepare("dolly")

if __name__ == "__main__":
    run_cli(prepare)
