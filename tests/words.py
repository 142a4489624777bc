"""A tiny checkpoint with a word-level tokenizer (~50 words: a 128-row embedding instead of SmolLM2's 49152) and
Alpaca rows over its words, for the XLA finetuning tests (fast runs, real recipes, real data preparation)."""

import json
from pathlib import Path
from typing import List

import torch

GEN_PROMPT = "Repeat the words."
WORDS = "red green blue cat dog sun moon tree river stone bird fish".split()


def alpaca_rows() -> List[dict]:
    """44 rows in groups of growing length, kept in file order (--data.shuffle false): the batches pad to two
    different lengths, and every epoch (5 steps of 8 samples) sees the same batches, so logged losses compare."""
    rows = []
    for i in range(44):
        n = [1, 4, 10, 20][i * 4 // 44]
        ws = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
        rows.append({"instruction": GEN_PROMPT, "input": ws, "output": ws})
    return rows


def make_word_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A random tiny Llama-style checkpoint whose tokenizer.json is a word-level vocabulary of the Alpaca template
    and the data's words (unknown words become <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lit_gpt import GPT, Config
    from lit_gpt.prompts import Alpaca

    text = " ".join([Alpaca.header, Alpaca.header_with_input, Alpaca().apply(GEN_PROMPT, input="x"), *WORDS])
    specials = ["<unk>", "<s>", "</s>"]
    words = sorted({w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)})
    words += [f"<extra_{i}>" for i in range(-(len(specials) + len(words)) % 8)]  # a vocabulary that splits over 8
    vocab = {w: i for i, w in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    # every id the model can emit is a word the tokenizer decodes
    config = Config(name="tiny-words", block_size=128, vocab_size=len(vocab), n_layer=2, n_head=4, n_query_groups=2,
                    n_embd=64, intermediate_size=128, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    tie_embeddings=True)
    torch.manual_seed(seed)
    model = GPT(config)
    model.apply(model._init_weights)
    torch.save(model.state_dict(), directory / "lit_model.pth")
    config.save(directory)
    return directory
