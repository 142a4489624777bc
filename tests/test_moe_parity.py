"""Mixtures of experts (Mixtral, Qwen3-MoE, gpt-oss) against transformers: tiny random models saved by
`save_pretrained` (tests/tiny_hf.py `MOE_FAMILIES`), converted by the production converter, give transformers'
logits (fp32, 1e-4) and its greedy tokens through the KV cache with every dispatch; gpt-oss's MXFP4 expert weights
decode bit for bit as transformers decodes them, and a Hub-style MXFP4 folder converts to the model transformers
loads from it; the named configs equal what their Hub config.json gives; what the model does not implement is
refused in one line by scripts/convert_hf_checkpoint.py. (The HF -> lit -> HF round trip of these families runs in
tests/test_convert.py, the bare logits and cache in tests/test_model.py, the new user's path in
tests/test_families.py: all take `FAMILIES`.)"""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_hf import MOE_FAMILIES, SEQ, VOCAB, build_hf_model  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from variants import run_recipe  # noqa: E402

from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.convert import convert_hf_checkpoint, convert_lit_checkpoint  # noqa: E402
from lit_gpt.generate import generate  # noqa: E402
from lit_gpt.moe import MoE, route  # noqa: E402
from lit_gpt.mxfp4 import FP4_VALUES, dequantize_mxfp4  # noqa: E402
from lit_gpt.weights import find_weights, load_weights  # noqa: E402

DISPATCHES = ["auto", "grouped", "gather", "capacity", "dropless", "dense"]
PROMPT_LEN, NEW_TOKENS = 7, 8  # a prompt longer than gpt-oss's window (4)


def lit_model(checkpoint_dir: Path, **overrides) -> GPT:
    model = GPT(Config.from_checkpoint(checkpoint_dir, **overrides))
    model.load_state_dict(load_weights(find_weights(checkpoint_dir)))
    return model.eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF model, converted folder, prompt, HF's greedy tokens), built once per family."""
    cache = {}

    def get(family):
        if family not in cache:
            hf_model = build_hf_model(family, seed=3)
            folder = tmp_path_factory.mktemp("moe") / family
            hf_model.save_pretrained(folder)
            convert_hf_checkpoint(folder)
            prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                out = hf_model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                        pad_token_id=0)
            cache[family] = (hf_model, folder, prompt, out[0, PROMPT_LEN:])
        return cache[family]

    return get


@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
@torch.no_grad()
def test_logits_and_greedy_tokens_equal_transformers_with_every_dispatch(family, dispatch, converted):
    hf_model, folder, prompt, hf_tokens = converted(family)
    model = lit_model(folder, moe_dispatch=dispatch)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = hf_model(idx).logits
    assert expected.std() > 0.3  # logits large enough to show errors
    chosen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: chosen.append(route(m.router(a[0].reshape(-1, a[0].size(-1))),
                                                                          m.routing_kind, m.k, m.norm_topk_prob)[2]))
             for m in model.modules() if isinstance(m, MoE)]
    torch.testing.assert_close(model(idx), expected, atol=1e-4, rtol=0)
    for h in hooks:
        h.remove()
    assert chosen and len(chosen) == sum(model.config.is_moe_layer(i) for i in range(model.config.n_layer))
    for experts in chosen:  # the routers really choose: several experts, and several combinations, per layer
        assert experts.unique().numel() >= 3 and experts.sort(dim=-1).values.unique(dim=0).size(0) >= 3

    tokens = generate(model, prompt[0], NEW_TOKENS, temperature=0.0)  # prefill, then one token at a time
    assert torch.equal(tokens, hf_tokens), (tokens, hf_tokens)


def _swap_gate_up(model):
    for m in model.modules():
        if isinstance(m, MoE):
            w1, w2 = m.experts.fc_1.weight, m.experts.fc_2.weight
            w1.data, w2.data = w2.data.clone(), w1.data.clone()


# a model off in one detail of these families must fail the parity above (the tests can fail)
@pytest.mark.parametrize("family, overrides, mutate", [
    ("mixtral", {"moe_norm_topk_prob": False}, None),
    ("mixtral", {}, _swap_gate_up),
    ("qwen3_moe", {"moe_dense_layers": []}, "skip-load"),
    ("qwen3_moe-sparse-step", {"moe_norm_topk_prob": True}, None),
    ("gpt_oss", {"attention_sinks": False}, "skip-load"),
    ("gpt_oss", {"swiglu_limit": 7.0}, None),
    # (softmax over all, top k, renormalised, is the same as gpt-oss's softmax over the top k logits: not renormalised)
    ("gpt_oss", {"moe_routing": "softmax_topk", "moe_norm_topk_prob": False}, None),
    ("gpt_oss", {"sliding_window_size": None, "layer_types": None}, None),
])
@torch.no_grad()
def test_a_model_off_in_one_detail_fails_the_parity(family, overrides, mutate, converted):
    hf_model, folder, _, _ = converted(family)
    if mutate == "skip-load":  # the weights no longer fit this config: load what does
        model = GPT(Config.from_checkpoint(folder, **overrides))
        model.load_state_dict(load_weights(find_weights(folder)), strict=False)
        model.eval()
    else:
        model = lit_model(folder, **overrides)
        if mutate is not None:
            mutate(model)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    assert (model(idx) - hf_model(idx).logits).abs().max() > 1e-2


@pytest.mark.parametrize("family", MOE_FAMILIES)
@torch.no_grad()
def test_bf16_folder_converts_and_matches_transformers(family, tmp_path):
    """The Hub serves bf16: converted as it is (bf16 weights), computed in float32 like transformers in float32."""
    folder = tmp_path / family
    build_hf_model(family, seed=4).to(torch.bfloat16).save_pretrained(folder)
    convert_hf_checkpoint(folder)
    state = load_weights(find_weights(folder))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lit_model(folder)(idx), reference(idx).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@torch.no_grad()
def test_transformers_in_memory_fused_expert_names_convert_alike(family, tmp_path):
    """A folder written with transformers 5's in-memory names (`mlp.experts.gate_up_proj`, `mlp.gate`) converts to
    the same lit weights as the Hub's per-expert layout."""
    hf_model = build_hf_model(family)
    hub, fused = tmp_path / "hub", tmp_path / "fused"
    hf_model.save_pretrained(hub)
    fused.mkdir()
    shutil.copy(hub / "config.json", fused / "config.json")
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(fused / "model.safetensors"))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in load_file(fused / "model.safetensors"))
    convert_hf_checkpoint(hub)
    convert_hf_checkpoint(fused)
    a, b = load_weights(find_weights(hub)), load_weights(find_weights(fused))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ MXFP4
def quantize_mxfp4(w: torch.Tensor):
    """float (..., K) -> MXFP4 blocks (..., K/32, 16) uint8 and scales (..., K/32) uint8 (E8M0): the scale is the
    smallest power of two that brings the group's largest magnitude to 6, values round to the nearest E2M1 code;
    two codes per byte, the even element in the low nibble."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    q = g / torch.exp2(e).unsqueeze(-1)
    codes = (q.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e + 127).to(torch.uint8)


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, torch.int16), (torch.float32, torch.int32)])
def test_mxfp4_decoder_equals_transformers_bit_for_bit(dtype, bits):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=gen) * torch.logspace(-6, 2, 40).view(1, 40, 1)  # scales 2**-26 .. 2**5
    w[0, 0] = 0.0  # an all-zero group
    blocks, scales = quantize_mxfp4(w)
    # and every byte and a wide range of exponents, as a checkpoint may hold them
    raw_blocks = torch.randint(0, 256, (2, 16, 4, 16), generator=gen, dtype=torch.uint8)
    raw_scales = torch.randint(60, 200, (2, 16, 4), generator=gen, dtype=torch.uint8)
    for b, s in ((blocks, scales), (raw_blocks, raw_scales)):
        ours = dequantize_mxfp4(b, s, dtype)
        theirs = convert_moe_packed_tensors(b.clone(), s.clone(), dtype=dtype).transpose(1, 2)  # (E, in, out)
        assert ours.shape == theirs.shape and ours.dtype == dtype
        assert torch.equal(ours.view(bits), theirs.contiguous().view(bits))
    # a fair quantizer: within half a code step (at most a third of the group's largest magnitude) of the weights
    err = (dequantize_mxfp4(blocks, scales, torch.float32) - w).abs().reshape(3, 40, 3, 32).amax(-1)
    assert (err <= w.abs().reshape(3, 40, 3, 32).amax(-1) / 3).all()


def write_mxfp4_folder(hf_model, folder: Path) -> None:
    """`hf_model` as the Hub's gpt-oss folders are: its experts' two weights as MXFP4 `_blocks` / `_scales` (the
    blocks in one shard, the scales in another) and `quantization_config: mxfp4` in config.json."""
    hf_model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    scales = {}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[f"{name}_blocks"], scales[f"{name}_scales"] = quantize_mxfp4(state.pop(name).transpose(1, 2))
    shards = {"model-00001-of-00002.safetensors": state, "model-00002-of-00002.safetensors": scales}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, t in shards.items() for k in t}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


@torch.no_grad()
def test_mxfp4_gpt_oss_folder_converts_dequantized_and_exports_bf16(tmp_path):
    folder = tmp_path / "gpt-oss-mxfp4"
    write_mxfp4_folder(build_hf_model("gpt_oss", seed=1), folder)
    # the reference: transformers' own loading of the folder, dequantized (its decoder and its layout)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    convert_hf_checkpoint(folder)
    state = load_weights(find_weights(folder))
    # kept packed on disk (tests/test_moe_mxfp4.py), decoded on loading to the checkpoint's float dtype (exactly)
    assert state["transformer.h.0.mlp.experts.fc_1.weight"].dtype == torch.float32
    assert state["transformer.h.0.attn.qkv.weight"].dtype == torch.float32  # the rest as the folder has it
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = reference(idx).logits
    torch.testing.assert_close(lit_model(folder)(idx), expected, atol=1e-4, rtol=0)

    # back to HF: the fused bf16 layout, no quantization_config, and transformers loads it
    out = convert_lit_checkpoint(folder, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    exported = load_file(out / "model.safetensors")
    assert "quantization_config" not in config and not any(k.endswith(("_blocks", "_scales")) for k in exported)
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32  # the checkpoint's dtype
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    torch.testing.assert_close(reloaded(idx).logits, expected, atol=1e-4, rtol=0)


# ------------------------------------------------------------------ named configs
# the Hub's config.json of each (Mixtral 8x7B v0.1, Qwen3-30B-A3B and -235B-A22B, gpt-oss-20b and -120b),
# keys that change nothing here (dtype, token ids, versions) left out
_MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
}
_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936,
}
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
HUB_CONFIGS = {
    "Mixtral-8x7B-v0.1": _MIXTRAL_8X7B,
    "Qwen3-30B-A3B": _QWEN3_MOE,
    "Qwen3-235B-A22B": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, max_window_layers=94,
                            moe_intermediate_size=1536, num_attention_heads=64, num_hidden_layers=94),
    "gpt-oss-20b": _GPT_OSS,
    "gpt-oss-120b": dict(_GPT_OSS, layer_types=["sliding_attention", "full_attention"] * 18, num_hidden_layers=36,
                         num_local_experts=128),
}


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_named_config_equals_its_hub_config_json(name):
    named = Config.from_name(name)
    assert Config.from_hf_config(HUB_CONFIGS[name], name=name, hf_config=named.hf_config) == named
    # and what the export writes reads back the same
    from lit_gpt.hf_write import hf_config_dict

    assert Config.from_hf_config(hf_config_dict(named), name=name, hf_config=named.hf_config) == named


@pytest.mark.parametrize("model_type, cls_name", [
    ("mixtral", "MixtralConfig"), ("qwen3_moe", "Qwen3MoeConfig"), ("gpt_oss", "GptOssConfig")])
def test_keys_a_config_json_leaves_out_mean_transformers_defaults(model_type, cls_name):
    full = getattr(transformers, cls_name)().to_dict()
    assert Config.from_hf_config({"model_type": model_type}) == Config.from_hf_config(full)


@pytest.mark.parametrize("name, overrides, line", [
    ("Mixtral-8x7B-v0.1", {"hf_model_type": "mistral"}, "mixtures of experts and attention sinks need mixtral"),
    ("Mixtral-8x7B-v0.1", {"moe_dense_layers": [0]}, "every layer a mixture of experts"),
    ("Mixtral-8x7B-v0.1", {"moe_norm_topk_prob": False}, "renormalised top-k weights"),
    ("Qwen3-30B-A3B", {"moe_bias": True}, "router and expert biases exactly for gpt_oss"),
    ("gpt-oss-20b", {"moe_activation": "silu"}, "moe_activation 'silu'"),
    ("gpt-oss-20b", {"attention_sinks": False}, "attention sinks and float norm weights exactly for gpt_oss"),
])
def test_export_refuses_what_the_hub_family_cannot_express(name, overrides, line):
    from lit_gpt.hf_write import hf_config_dict
    from lit_gpt.utils import LitError

    with pytest.raises(LitError, match="this config cannot be exported as HF") as e:
        hf_config_dict(Config.from_name(name, **overrides))
    assert line in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ refused in one line
def _config_edit(**changes):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _drop_tensors(*suffixes):
    def edit(folder: Path) -> None:
        for path in folder.glob("model*.safetensors"):
            state = load_file(path)
            save_file({k: v for k, v in state.items() if not k.endswith(suffixes)}, str(path),
                      metadata={"format": "pt"})
    return edit


BAD_INPUT = [
    ("mixtral", _config_edit(router_jitter_noise=0.1), "mixtral router_jitter_noise 0.1 is not implemented"),
    ("mixtral", _config_edit(hidden_act="gelu"), "Unsupported hidden_act 'gelu' for mixtral"),
    ("mixtral", _config_edit(num_experts_per_tok=5), "num_experts_per_tok 5 must be in 1..4 (the number of experts)"),
    ("qwen3_moe", _config_edit(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    ("qwen3_moe", _config_edit(attention_bias=True), "qwen3_moe with attention_bias is not supported"),
    ("gpt_oss", _config_edit(quantization_config={"quant_method": "fp8"}), "quant_method 'fp8' is not implemented"),
    ("gpt_oss", _config_edit(hidden_act="gelu"), "Unsupported hidden_act 'gelu' for gpt_oss"),
    ("mixtral", _config_edit(quantization_config={"quant_method": "awq"}), "download the unquantized (bf16) weights"),
    ("qwen3_moe", _drop_tensors("layers.1.mlp.experts.2.up_proj.weight"),
     "layer 1 has only 3 of 4 experts' fc_2 weights: the checkpoint is incomplete"),
    ("gpt_oss-mxfp4", _drop_tensors("layers.1.mlp.experts.down_proj_scales"),
     "layer 1 has only ['_blocks'] of its MXFP4 down_proj: the checkpoint is incomplete"),
]


@pytest.mark.parametrize("family, edit, line", BAD_INPUT)
def test_what_the_model_does_not_implement_is_refused_in_one_line(family, edit, line, tmp_path, capsys):
    folder = tmp_path / family
    if family.endswith("-mxfp4"):
        write_mxfp4_folder(build_hf_model(family.removesuffix("-mxfp4")), folder)
    else:
        build_hf_model(family).save_pretrained(folder)
    edit(folder)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_recipe("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(folder))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 1 and err.startswith("error: ") and line in err, err
    assert not list(folder.glob("lit_*"))  # nothing written
