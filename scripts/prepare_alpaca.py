"""Prepare the Alpaca instruction data (the cleaned 52k set) for finetuning.

    python scripts/prepare_alpaca.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/prepare_alpaca.py --data_file my_copy/alpaca_data_cleaned_archive.json   # offline

Writes train.pt, val.pt and meta.json to --destination_path (see `lit_gpt.data`)."""

from lit_gpt.prepare import make_prepare
from lit_gpt.utils import run_cli

# the flags, their defaults and their --help come from the "alpaca" entry of lit_gpt.prepare.DATASETS
prepare = make_prepare("alpaca")

if __name__ == "__main__":
    run_cli(prepare)
