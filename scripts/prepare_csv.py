"""Prepare your own instruction data from a CSV (or TSV) file for finetuning.

    python scripts/prepare_csv.py --data_file my_data.csv --destination_path data/mine \
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

The first line is a header naming the columns; the instruction, optional input and output columns are chosen with
--instruction_key / --input_key / --output_key. Bad rows (missing cells, too many cells, empty output, text that is
not UTF-8) are reported with their line numbers and skipped, or rejected with --on_bad_rows error."""

from lit_gpt.prepare import make_prepare
from lit_gpt.utils import run_cli

# the flags, their defaults and their --help come from the "csv" entry of lit_gpt.prepare.DATASETS
prepare = make_prepare("csv")

if __name__ == "__main__":
    run_cli(prepare)
