"""The new user's path for each family added with its layer features (Qwen3, Gemma 2 and 3, Phi-3.5 / Phi-4-mini,
OLMo 2, SmolLM3) and each mixture of experts (Mixtral, Qwen3-MoE, gpt-oss): a tiny random model saved by
`transformers` in bf16 (as the Hub serves them) with SmolLM2's tokenizer files beside it, then the two commands of
the issues that found them missing,

    python scripts/convert_hf_checkpoint.py --checkpoint_dir <folder>
    python generate/base.py --checkpoint_dir <folder> --prompt_style raw --temperature 0

with default arguments otherwise (on the CPU: 32-true, so the bf16 weights compute in float32). The greedy text must
be the one transformers' `generate` gives for the same folder loaded in float32."""

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_hf import FAMILIES, build_hf_model  # noqa: E402
from variants import run_recipe  # noqa: E402

from lit_gpt.tokenizer import Tokenizer  # noqa: E402

PROMPT = "The capital of France is"
NEW_TOKENS = 10
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# one configuration per family; the parity tests (tests/test_model.py) cover the variants
USER_FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3.5-longrope", "olmo2", "smollm3",
                 "mixtral", "qwen3_moe", "gpt_oss"]  # and the mixtures of experts (tests/test_moe_parity.py)


@pytest.mark.parametrize("family", USER_FAMILIES)
@torch.no_grad()
def test_convert_and_generate_like_a_new_user(family, smollm2_dir, tmp_path, capsys):
    folder = tmp_path / family
    cls_name, kwargs = FAMILIES[family]
    FAMILIES[f"{family}-49152"] = (cls_name, dict(kwargs, vocab_size=49152))  # SmolLM2's vocabulary
    try:
        hf_model = build_hf_model(f"{family}-49152", seed=5)
    finally:
        del FAMILIES[f"{family}-49152"]
    with torch.no_grad():  # the special tokens never win greedy decoding (EOS would end it at once)
        hf_model.get_output_embeddings().weight[:17] = 0
        if hf_model.get_output_embeddings().bias is not None:
            hf_model.get_output_embeddings().bias[:17] = -10
    hf_model.to(torch.bfloat16).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, folder / name)

    run_recipe("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(folder))
    capsys.readouterr()
    run_recipe("generate/base.py", "--checkpoint_dir", str(folder), "--prompt", PROMPT, "--prompt_style", "raw",
               "--temperature", "0", "--max_new_tokens", str(NEW_TOKENS))
    printed = capsys.readouterr().out

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = Tokenizer(folder).encode(PROMPT).unsqueeze(0)
    out = reference.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    expected = Tokenizer(folder).decode(out[0])
    assert expected.startswith(PROMPT) and len(expected) > len(PROMPT) + 5
    assert expected in printed, (expected, printed)
