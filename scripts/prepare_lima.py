"""Prepare LIMA (1k curated conversations, GAIR/lima on the Hugging Face Hub) for finetuning.

    HF_TOKEN=... python scripts/prepare_lima.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/prepare_lima.py --data_file my_copy/train.jsonl   # offline

LIMA is a gated dataset: accept its terms on the Hub and pass a token (--access_token or HF_TOKEN). Each record
holds "conversations", alternating user and assistant turns. By default only the first exchange of each is used;
with --include_multiturn_conversations every (user, assistant) pair becomes a sample, with the earlier turns of
its conversation as history in the prompt."""

from lit_gpt.prepare import make_prepare
from lit_gpt.utils import run_cli

# the flags, their defaults and their --help come from the "lima" entry of lit_gpt.prepare.DATASETS
prepare = make_prepare("lima")

if __name__ == "__main__":
    run_cli(prepare)
