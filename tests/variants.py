"""Helpers of the model-variant tests (tests/test_adapter.py, test_adapter_v2.py, test_lora.py, test_merge_lora.py):
tiny lit configs of every family (registry configs shrunk, structural flags kept), random base models, the
variant built from them, and running a recipe in this process."""

import math
import runpy
import sys
from pathlib import Path
from typing import Any, Dict, Type

import torch

from lit_gpt.weights import find_weights, load_weights

from lit_gpt import GPT, Config
from lit_gpt.peft import save_finetuned
from tiny import write_checkpoint as write_base_checkpoint  # noqa: F401  (the variant tests' base checkpoints)

VOCAB = 128
SEQ = 12
ROOT = Path(__file__).resolve().parents[1]

# registry name -> what it covers; each is shrunk by `tiny_config` keeping the family's structural flags
FAMILIES = {
    "Llama-2-7b-hf": "llama, multi-head",
    "TinyLlama-1.1B-Chat-v1.0": "llama, GQA",
    "Llama-3.2-1B": "llama 3 rope scaling, GQA, tied embeddings",
    "Mistral-7B-v0.1": "sliding window (4 < SEQ)",
    "gemma-2b": "multi-query, head_size != n_embd / n_head, (1 + w) norm, scaled embeddings",
    "pythia-70m": "gpt_neox: parallel residual, partial rotary, biases",
    "falcon-7b": "multi-query, one shared norm",
    "falcon-40b": "GQA, parallel residual with two norms",
    "phi-2": "shared norm, lm_head bias, 0.4 rotary",
    "stablelm-2-1_6b": "qkv bias, LayerNorm + LLaMA MLP",
    "Qwen2.5-0.5B": "qkv bias, GQA, tied embeddings",
    "Qwen3-0.6B": "per-head q/k norms, head_size != n_embd / n_head",
    "gemma-2-2b": "post norms, soft-capping, query_pre_attn_scalar, alternating sliding/global layers",
    "gemma-3-4b-it": "q/k norms, local RoPE base on sliding layers, linear scaling on global ones",
    "Phi-3.5-mini-instruct": "LongRoPE (fused qkv / gate_up in HF)",
    "Phi-4-mini-instruct": "LongRoPE, 0.75 rotary, GQA, tied embeddings",
    "OLMo-2-1124-7B": "no pre-norms, post norms, q/k norms over all heads",
    "SmolLM3-3B": "a layer without RoPE, GQA, tied embeddings",
}


def tiny_config(name: str, config_cls: Type[Config] = Config, **variant: Any) -> Config:
    full = Config.from_name(name)
    if full.n_query_groups == full.n_head:
        groups = 4
    else:
        groups = 1 if full.n_query_groups == 1 else 2
    overrides: Dict[str, Any] = dict(
        block_size=64,
        vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_query_groups=groups,
        n_embd=64,
        head_size=32 if name.startswith("gemma") else 16,
        intermediate_size=128,
    )
    if full.sliding_window_size is not None:
        overrides["sliding_window_size"] = 4
    if full.rope_scaling:
        overrides["rope_scaling"] = dict(full.rope_scaling, original_max_seq_len=16)
        if full.rope_scaling.get("type") == "longrope":  # one factor per rotary frequency of the tiny head
            overrides["rope_scaling"].pop("factor", None)  # derived from the tiny context instead
            n = int(full.rotary_percentage * overrides["head_size"]) // 2
            for key in ("short_factor", "long_factor"):
                overrides["rope_scaling"][key] = full.rope_scaling[key][-n:]
    if full.layer_types:  # both kinds of layer
        overrides["layer_types"] = ["sliding_attention", "full_attention"]
    if full.layers_without_rope:
        overrides["layers_without_rope"] = [1]
    return config_cls.from_name(name, **{**overrides, **variant})


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Re-draw every parameter so that logits are O(1): norms near their identity, matrices N(0, 1/fan_in),
    vectors small but nonzero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=gen)
                if "norm" in module_name or "ln_f" in module_name:
                    identity = 0.0 if getattr(module, "unit_offset", False) or name == "bias" else 1.0
                    p.copy_(identity + 0.1 * noise)
                elif p.ndim == 1:
                    p.copy_(0.1 * noise)
                else:
                    p.copy_(noise / math.sqrt(p.shape[-1]))


def base_and_variant(name: str, module, **variant: Any):
    """A random base GPT and the variant built from it (base weights loaded, variant weights at their init)."""
    torch.manual_seed(0)
    base = GPT(tiny_config(name))
    randomize_(base)
    model = module.GPT(tiny_config(name, module.Config, **variant))
    result = model.load_state_dict(base.state_dict(), strict=False)
    assert not result.unexpected_keys
    # the base checkpoint covers exactly the base weights: what it misses is the variant's own parameters
    own = {n for n, _ in model.named_parameters(remove_duplicate=False) if model.peft_filter(n)}
    assert set(result.missing_keys) <= own and result.missing_keys
    return base.eval(), model.eval()


def tokens(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def cached_logits(model: GPT, idx: torch.Tensor, prefill: int = 5) -> torch.Tensor:
    """Logits of `idx` computed through the static KV cache: a prefill, then one token per step."""
    model.set_kv_cache(batch_size=idx.size(0), max_seq_length=idx.size(1) + 4)
    steps = [model(idx[:, :prefill], input_pos=torch.arange(prefill))]
    for t in range(prefill, idx.size(1)):
        steps.append(model(idx[:, t : t + 1], input_pos=torch.tensor([t])))
    model.clear_kv_cache()
    return torch.cat(steps, dim=1)


def randomize_own_(model: GPT, seed: int = 3) -> None:
    """Give the variant's own parameters (zero/identity at init) random values, as training would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if model.peft_filter(n):
                p.add_(0.5 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def run_recipe(relative_path: str, *args: str) -> None:
    """Run a recipe or script as `python <path> <args>` does, in this process (no second interpreter start)."""
    argv = sys.argv
    sys.argv = [str(ROOT / relative_path), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv


def greedy_text(model: GPT, checkpoint_dir: Path, prompt: str, max_new_tokens: int) -> str:
    """What a generate recipe prints for a raw prompt with --temperature 0: the prompt and its continuation."""
    from lit_gpt.generate import generate
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(checkpoint_dir)
    encoded = tokenizer.encode(prompt)
    new = generate(model.eval(), encoded, max_new_tokens, temperature=0.0, stop_ids=tokenizer.eos_id)
    return tokenizer.decode(encoded.tolist() + new.tolist())


def finetuned_on(base_dir: Path, module, path: Path, **variant: Any):
    """A variant of the checkpoint in `base_dir` with random (trained-like) own weights, saved to `path`."""
    model = module.GPT(module.Config.from_checkpoint(base_dir, **variant))
    model.load_state_dict(load_weights(find_weights(base_dir)), strict=False)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for n, p in model.named_parameters():
            if model.peft_filter(n) and "norm" not in n:
                # large: the tiny model's text must change
                p.add_(4.0 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    save_finetuned(model, path)
    return model
