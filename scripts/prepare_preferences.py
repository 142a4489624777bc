"""Prepare preference pairs (a prompt, a chosen and a rejected reply) for DPO (finetune/dpo.py).

    python scripts/prepare_preferences.py --data_file prefs.jsonl --destination_path data/prefs \
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

The file is a JSON array, JSON lines or a CSV file of rows {"prompt", "chosen", "rejected"}; or in the chat form
{"messages": [{"role", "content"}, ...] (the conversation up to the reply), "chosen", "rejected"}, where a reply is
a string or an assistant message; TRL's conversational preference datasets are read as they are (see
lit_gpt/preferences.py). The prompt is rendered with the checkpoint's prompt style and masked in the labels. Bad
rows (missing fields, wrong roles, empty or equal replies, a prompt too long for --max_seq_length) are reported with
their line numbers and skipped, or rejected with --on_bad_rows error."""

from lit_gpt.preferences import prepare_command
from lit_gpt.utils import run_cli

# the flags, their defaults and their --help come from lit_gpt.preferences.FLAGS
prepare = prepare_command()

if __name__ == "__main__":
    run_cli(prepare)
