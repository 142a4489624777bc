"""A tiny checkpoint with a word-level tokenizer (~50 words: a 128-row embedding instead of SmolLM2's 49152) and
Alpaca rows over its words, for the XLA finetuning tests (fast runs, real recipes, real data preparation); the
same with the architecture of each dense family of the model file (`FAMILIES`, tests/xla/test_xla_families.py)."""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

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


# the dense families of the model file, each a named config shrunk to the tiny shape below, with its per-layer
# features kept and made to matter on `family_rows` (61 and 81 tokens): sliding windows of 4 tokens, a
# LongRoPE original context of 64 tokens (some sequences are longer: the long factors), soft-caps in the range of
# a random model's scores and logits
FAMILIES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    # one layer where every layer is alike (each family's XLA compilations are most of the tests' time)
    "qwen3": ("Qwen3-0.6B", dict(n_layer=1)),  # per-head q/k norms
    # alternating sliding / global layers, soft-capped scores and logits, query_pre_attn_scalar, post norms
    "gemma2": ("gemma-2-2b", dict(n_layer=2, sliding_window_size=4, attention_logit_softcapping=2.0,
                                  final_logit_softcapping=3.0)),
    # sliding / global layers with a local RoPE base and linear scaling on the global ones, per-head q/k norms
    "gemma3": ("gemma-3-4b-it", dict(n_layer=2, sliding_window_size=4,
                                     layer_types=["sliding_attention", "full_attention"])),
    # LongRoPE with partial rotary dims (0.75 of 16: 12, so 6 factors each), GQA, tied embeddings
    "phi4": ("Phi-4-mini-instruct", dict(n_layer=1, rope_scaling=dict(
        type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5], long_factor=[1.5, 2.0, 4.0, 8.0, 16.0, 32.0],
        original_max_seq_len=64))),
    "olmo2": ("OLMo-2-1124-7B", dict(n_layer=1)),  # post norms only, q/k norms over the whole projections
    "smollm3": ("SmolLM3-3B", dict(n_layer=2, layers_without_rope=[1])),  # a layer without RoPE (NoPE)
}
# the mixture-of-experts families (lit_gpt.moe), apart from `FAMILIES` (their own tests: tests/test_moe_*.py,
# tests/xla/test_xla_moe.py): 4 experts, 2 per token, each expert 32 wide. Qwen3-MoE keeps a dense first layer
# (mlp_only_layers); gpt-oss has sinks, biased experts with the clamped SwiGLU, top-k-then-softmax routing and
# alternating 4-token windows
MOE_FAMILIES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "mixtral": ("Mixtral-8x7B-v0.1", dict(n_layer=1, n_expert=4, n_expert_per_token=2, moe_intermediate_size=32)),
    "qwen3_moe": ("Qwen3-30B-A3B", dict(n_layer=2, n_expert=4, n_expert_per_token=2, moe_intermediate_size=32,
                                        moe_dense_layers=[0])),
    "gpt_oss": ("gpt-oss-20b", dict(n_layer=2, n_expert=4, n_expert_per_token=2, moe_intermediate_size=32,
                                    sliding_window_size=4)),
}
TINY_SHAPE = dict(n_embd=64, n_head=4, n_query_groups=2, head_size=16, intermediate_size=128, block_size=128)


def family_config(family: str, vocab_size: int) -> Any:
    """The tiny `Config` of one of `FAMILIES`."""
    from lit_gpt import Config

    name, overrides = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    config = Config.from_name(name, vocab_size=vocab_size, **TINY_SHAPE, **overrides)
    config.name = f"tiny-{family}"
    return config


def family_rows() -> List[dict]:
    """16 rows for two steps of 8 samples (--data.shuffle false, no validation split): 8 of 61 tokens, then 8 of 81.
    Each step's sequences sit on one side of the LongRoPE original context of `FAMILIES` (64) however they are
    padded (to the sample on the CPU, to a power of two on XLA, to the longest of 8 on 8 devices): LongRoPE picks
    its factors by a forward's length, so a step that mixed the two sides would not be the same computation on
    every backend. Step 1 uses the short factors, step 2 the long ones."""
    rows = []
    for i in range(16):
        n = 10 if i < 8 else 20
        ws = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
        rows.append({"instruction": GEN_PROMPT, "input": ws, "output": ws})
    return rows


def make_word_checkpoint(directory: Path, seed: int = 0, family: Optional[str] = None) -> Path:
    """A random tiny Llama-style checkpoint (or one of `FAMILIES`) whose tokenizer.json is a word-level vocabulary
    of the Alpaca template and the data's words (unknown words become <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lit_gpt.prompts import Alpaca
    from tiny import random_model, tiny_llama_config, write_checkpoint

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
    if family is None:
        config = tiny_llama_config(name="tiny-words", block_size=128, vocab_size=len(vocab))
    else:
        config = family_config(family, len(vocab))
    model = random_model(config, seed)
    if family is not None:
        with torch.no_grad():  # norm weights away from their init, so that every norm (q/k, post) matters
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name.split(".")[-2]:
                    p.add_(torch.randn_like(p) * 0.2)
                if name.endswith((".sinks", ".router.weight")):  # sinks away from 0; routers that really choose
                    p.normal_(0.0, 1.0)
    return write_checkpoint(model, directory)


def family_checkpoints(root: Path, families: List[str], rows: List[dict]) -> Path:
    """A word checkpoint per family in `root` (one tokenizer for all) and `rows` prepared once for all of them
    (root/data, no validation split), as the family tests on every backend use them."""
    import contextlib
    import importlib.util
    import io

    for family in families:
        make_word_checkpoint(root / family, family=family)
    (root / "rows.json").write_text(json.dumps(rows))
    spec = importlib.util.spec_from_file_location(
        "prepare_alpaca_words", Path(__file__).resolve().parents[1] / "scripts" / "prepare_alpaca.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):  # the same tokenizer for every family: one data folder
        module.prepare(checkpoint_dir=root / families[0], data_file=root / "rows.json", destination_path=root / "data",
                       val_split_fraction=0.0)
    return root
