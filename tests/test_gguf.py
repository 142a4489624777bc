"""GGUF -> HF -> lit conversion: the real SmolLM2 GGUF (via the conftest fixture) and small synthetic GGUF files."""

import json
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.gguf import _unpermute_rows, convert_gguf  # noqa: E402
from lit_gpt.tokenizer import Tokenizer  # noqa: E402
from lit_gpt.utils import LitError, load_checkpoint  # noqa: E402


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `convert_hf_to_gguf.py` row order for Q/K: each head's rows [first half | second half]
    become interleaved pairs (r0, r_half, r1, r_half+1, ...)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_lit(checkpoint_dir: Path) -> GPT:
    model = GPT(Config.from_checkpoint(checkpoint_dir))
    load_checkpoint(model, checkpoint_dir / "lit_model.pth")
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# the row permutation
# ---------------------------------------------------------------------------------------------------------------
def test_unpermute_rows_restores_hf_order():
    # one head of 4 rows: llama.cpp stores rows (0, 2, 1, 3)
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    assert _unpermute_rows(stored, n_head=1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    w = np.random.default_rng(0).standard_normal((3 * 8, 5))
    for n_head in (1, 3):
        np.testing.assert_array_equal(_unpermute_rows(llamacpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(llamacpp_permute(w, 3), w)


# ---------------------------------------------------------------------------------------------------------------
# synthetic GGUF files
# ---------------------------------------------------------------------------------------------------------------
def byte_level_vocab() -> List[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def k_quant_bytes(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small finite fp16 scales (`gguf` can dequantize but not produce K-quants)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scale = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        blocks[..., :4] = scale  # d, dmin lead the block
    else:  # Q6_K: d ends the block
        blocks[..., -2:] = scale[:2]
    return blocks.reshape(rows, -1)


def write_llama_gguf(
    path: Path,
    hf: Dict[str, np.ndarray],
    types: Dict[str, Q],
    n_head: int,
    n_kv: int,
    n_layer: int,
    tokens: List[str],
    merges: List[str],
    raw: Dict[str, np.ndarray] = None,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
) -> Dict[str, np.ndarray]:
    """Write HF-named float weights as a llama.cpp GGUF (names, Q/K permutation, quantization). Returns the
    dequantized value of every stored tensor in HF layout, i.e. what the converter should read back."""
    raw = raw or {}
    n_embd = hf["model.embed_tokens.weight"].shape[1]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layer)
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hf["model.layers.0.mlp.gate_proj.weight"].shape[0])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(n_layer):
        for hf_part, gguf_part in layer.items():
            names[f"model.layers.{i}.{hf_part}.weight"] = f"blk.{i}.{gguf_part}.weight"

    stored = {}
    for hf_name, w in hf.items():
        if hf_name.endswith("q_proj.weight"):
            w = llamacpp_permute(w, n_head)
        elif hf_name.endswith("k_proj.weight"):
            w = llamacpp_permute(w, n_kv)
        qtype = types.get(hf_name, Q.F32)
        if hf_name in raw:
            data = raw[hf_name]
        elif qtype == Q.F32:
            data = w.astype(np.float32)
        elif qtype == Q.F16:
            data = w.astype(np.float16)
        else:
            data = quantize(w.astype(np.float32), qtype)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(names[hf_name], data)
        else:
            writer.add_tensor(names[hf_name], data, raw_shape=data.shape, raw_dtype=qtype)
        stored[hf_name] = dequantize(data, qtype).reshape(w.shape) if qtype not in (Q.F32, Q.F16) else data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


N_EMBD, N_HEAD, N_KV, N_LAYER, FFN = 256, 4, 2, 2, 512


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A 2-layer untied Llama in GGUF with every supported storage type, and its HF weights."""
    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level_vocab()
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
    tokens += [m.replace(" ", "") for m in merges]
    vocab, head_dim = len(tokens), N_EMBD // N_HEAD

    def w(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hf = {"model.embed_tokens.weight": w(vocab, N_EMBD, scale=0.5), "model.norm.weight": 1 + w(N_EMBD),
          "lm_head.weight": w(vocab, N_EMBD)}
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        hf.update({
            p + "input_layernorm.weight": 1 + w(N_EMBD), p + "post_attention_layernorm.weight": 1 + w(N_EMBD),
            p + "self_attn.q_proj.weight": w(N_HEAD * head_dim, N_EMBD),
            p + "self_attn.k_proj.weight": w(N_KV * head_dim, N_EMBD),
            p + "self_attn.v_proj.weight": w(N_KV * head_dim, N_EMBD),
            p + "self_attn.o_proj.weight": w(N_EMBD, N_HEAD * head_dim),
            p + "mlp.gate_proj.weight": w(FFN, N_EMBD), p + "mlp.up_proj.weight": w(FFN, N_EMBD),
            p + "mlp.down_proj.weight": w(N_EMBD, FFN),
        })
    types = {
        "model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q6_K,
        "model.layers.0.self_attn.v_proj.weight": Q.F16, "model.layers.0.self_attn.o_proj.weight": Q.BF16,
        "model.layers.0.mlp.gate_proj.weight": Q.Q4_0, "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
        "model.layers.0.mlp.down_proj.weight": Q.Q4_K,
        "model.layers.1.self_attn.q_proj.weight": Q.Q8_0, "model.layers.1.self_attn.k_proj.weight": Q.Q4_1,
    }
    raw = {"lm_head.weight": k_quant_bytes(Q.Q6_K, vocab, N_EMBD, rng),
           "model.layers.0.mlp.down_proj.weight": k_quant_bytes(Q.Q4_K, N_EMBD, FFN, rng)}
    root = tmp_path_factory.mktemp("gguf")
    stored = write_llama_gguf(root / "tiny.gguf", hf, types, N_HEAD, N_KV, N_LAYER, tokens, merges, raw)
    out = convert_gguf(root / "tiny.gguf", root / "tiny-llama")
    return dict(dir=out, hf=hf, stored=stored, types=types, tokens=tokens)


def test_synthetic_weights_round_trip(synthetic):
    from safetensors.torch import load_file

    converted = load_file(str(synthetic["dir"] / "model.safetensors"))
    hf, stored, types = synthetic["hf"], synthetic["stored"], synthetic["types"]
    assert set(converted) == set(hf)
    for name, original in hf.items():
        got = converted[name].numpy()
        assert got.shape == original.shape, name
        qtype = types.get(name, Q.F32)
        if qtype == Q.F32:
            np.testing.assert_array_equal(got, original, err_msg=name)  # permuted and restored exactly
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            # quantized in llama.cpp's row order: back in HF order, within the quantization error
            assert np.abs(got - original).max() < 0.1 * np.abs(original).max(), name
        elif name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
            np.testing.assert_array_equal(got, stored[name], err_msg=name)  # random K-quant blocks
        else:
            np.testing.assert_allclose(got, original, atol=0.1 * np.abs(original).max(), err_msg=name)


def test_synthetic_config_and_tokenizer(synthetic):
    d = synthetic["dir"]
    hf_config = json.loads((d / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] is False  # the file has output.weight
    assert hf_config["rope_theta"] == 50000.0 and hf_config["rms_norm_eps"] == 1e-5
    assert hf_config["vocab_size"] == len(synthetic["tokens"])
    config = Config.from_checkpoint(d)
    assert (config.n_layer, config.n_embd, config.n_head, config.n_query_groups) == (N_LAYER, N_EMBD, N_HEAD, N_KV)
    assert (config.intermediate_size, config.tie_embeddings) == (FFN, False)

    tokenizer_config = json.loads((d / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>" and tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    tok = Tokenizer(d)
    assert tok.vocab_size == len(synthetic["tokens"])
    ids = tok.encode("<|im_start|>hello world 42<|im_end|>").tolist()
    pieces = [tok.id_to_token(i) for i in ids]
    # special tokens whole, the merges applied, digits split one by one ("smollm" pre-tokenizer)
    assert pieces == ["<|im_start|>", "hell", "o", "Ġwor", "l", "d", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.decode(ids) == "<|im_start|>hello world 42<|im_end|>"


def test_synthetic_logits_match_transformers(synthetic):
    transformers = pytest.importorskip("transformers")
    d = synthetic["dir"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_lit(d)
    idx = torch.randint(0, len(synthetic["tokens"]), (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(idx).logits
        actual = model(idx)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_an_existing_checkpoint_folder_is_never_overwritten_silently(synthetic, tmp_path, capsys):
    gguf_path = synthetic["dir"].parent / "tiny.gguf"
    out = tmp_path / "tiny-llama"
    shutil.copytree(synthetic["dir"], out)
    files = lambda: {p.name: p.read_bytes() for p in out.iterdir()}  # noqa: E731
    before = files()
    # the same conversion again: nothing to do, nothing rewritten (the README's command 1 can be run twice)
    convert_gguf(gguf_path, out)
    assert files() == before and "nothing to do" in capsys.readouterr().err
    # another model's folder (here: a different config) is refused, naming the folder and the way out
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    before = files()
    refused = r"already holds config\.json.*refusing to overwrite.*--checkpoint_dir.*--overwrite true"
    with pytest.raises(LitError, match=refused):
        convert_gguf(gguf_path, out)
    assert files() == before
    (out / "config.json").unlink()
    (out / "lit_model.pth").write_bytes(b"someone else's weights")
    with pytest.raises(LitError, match=str(out)):
        convert_gguf(gguf_path, out)
    assert (out / "lit_model.pth").read_bytes() == b"someone else's weights"
    convert_gguf(gguf_path, out, overwrite=True)
    assert files() == {p.name: p.read_bytes() for p in synthetic["dir"].iterdir()}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_unsupported_gguf_files_give_clear_errors(tmp_path):
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level_vocab()
    rng = np.random.default_rng(1)
    hf = {"model.embed_tokens.weight": rng.standard_normal((len(tokens), 32)).astype(np.float32),
          "model.norm.weight": np.ones(32, np.float32)}
    for name, shape in (("input_layernorm", (32,)), ("post_attention_layernorm", (32,)),
                        ("self_attn.q_proj", (32, 32)), ("self_attn.k_proj", (32, 32)),
                        ("self_attn.v_proj", (32, 32)), ("self_attn.o_proj", (32, 32)),
                        ("mlp.gate_proj", (64, 32)), ("mlp.up_proj", (64, 32)), ("mlp.down_proj", (32, 64))):
        hf[f"model.layers.0.{name}.weight"] = rng.standard_normal(shape).astype(np.float32)

    write_llama_gguf(tmp_path / "falcon.gguf", hf, {}, 2, 2, 1, tokens, [], arch="falcon")
    with pytest.raises(LitError, match="architecture 'falcon'"):
        convert_gguf(tmp_path / "falcon.gguf", tmp_path / "out1")
    write_llama_gguf(tmp_path / "spm.gguf", hf, {}, 2, 2, 1, tokens, [], tokenizer_model="llama")
    with pytest.raises(LitError, match="'llama' tokenizer"):
        convert_gguf(tmp_path / "spm.gguf", tmp_path / "out2")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(LitError, match="cannot read"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "out3")
    with pytest.raises(LitError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out4")
    with pytest.raises(LitError, match="dtype"):
        convert_gguf(tmp_path / "spm.gguf", tmp_path / "out5", dtype="int8")


# ---------------------------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct GGUF (converted once per session by the conftest fixture)
# ---------------------------------------------------------------------------------------------------------------
def test_smollm2_config(smollm2_dir):
    config = Config.from_checkpoint(smollm2_dir)
    assert config.n_layer == 30
    assert config.n_embd == 576
    assert config.n_head == 9
    assert config.n_query_groups == 3
    assert config.head_size == 64
    assert config.intermediate_size == 1536
    assert config.vocab_size == 49152
    assert config.tie_embeddings is True
    assert config.rope_base == 100000.0
    assert config.norm_eps == 1e-5
    assert config.block_size == 8192
    assert (config.norm_class_name, config.mlp_class_name) == ("RMSNorm", "LLaMAMLP")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "lit_model.pth", "lit_config.json"):
        assert (smollm2_dir / name).is_file(), name
    generation_config = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == 2  # <|im_end|>


@pytest.fixture(scope="module")
def smollm2_models(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return load_lit(smollm2_dir), hf_model, transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def test_smollm2_logits_match_transformers(smollm2_models):
    model, hf_model, hf_tokenizer = smollm2_models
    ids = hf_tokenizer("The quick brown fox jumps over the lazy dog. 1 + 2 = 3", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = model(ids)
    assert actual.dtype == torch.float32
    assert (actual - expected).abs().max().item() < 1e-4


def test_smollm2_knows_the_capital_of_france(smollm2_dir, smollm2_models):
    model = smollm2_models[0]
    tokenizer = Tokenizer(smollm2_dir)
    idx = tokenizer.encode("The capital of France is").unsqueeze(0)
    new = []
    with torch.no_grad():
        for _ in range(4):  # greedy, full forward each step: the model is tiny and the prompt short
            next_id = model(idx)[0, -1].argmax()
            new.append(next_id.item())
            idx = torch.cat([idx, next_id.view(1, 1)], dim=1)
    assert " Paris" in [tokenizer.decode([i]) for i in new]
