"""Prepare your own instruction data from a JSON file for finetuning.

    python scripts/prepare_json.py --data_file my_data.json --destination_path data/mine \
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

The file is a JSON array or JSON lines of objects with an instruction, an optional input and an output (field
names set with --instruction_key / --input_key / --output_key). Bad rows (missing fields, empty output, text that
is not UTF-8, unparseable lines) are reported with their line numbers and skipped, or rejected with
--on_bad_rows error."""

from lit_gpt.prepare import make_prepare
from lit_gpt.utils import run_cli

# the flags, their defaults and their --help come from the "json" entry of lit_gpt.prepare.DATASETS
prepare = make_prepare("json")

if __name__ == "__main__":
    run_cli(prepare)
