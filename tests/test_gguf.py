"""GGUF -> HF -> lit conversion: the real SmolLM2 GGUF (via the conftest fixture) and small synthetic GGUF files of
every architecture `lit_gpt.gguf` reads (llama, qwen2, qwen3, gemma2, gemma3, phi3)."""

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

# llama.cpp's converter, in small
from gguf_writer import byte_level_vocab, gpt2_vocab, sentencepiece_vocab, write_gguf  # noqa: E402
from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.gguf import ARCHITECTURES, _hf_config, _open_reader, _read_metadata, _unpermute_rows  # noqa: E402
from lit_gpt.gguf import convert_gguf  # noqa: E402
from lit_gpt.tokenizer import Tokenizer  # noqa: E402
from lit_gpt.utils import LitError  # noqa: E402
from lit_gpt.weights import load_checkpoint  # noqa: E402


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `convert_hf_to_gguf.py` row order for Q/K: each head's rows [first half | second half]
    become interleaved pairs (r0, r_half, r1, r_half+1, ...)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_lit(checkpoint_dir: Path) -> GPT:
    model = GPT(Config.from_checkpoint(checkpoint_dir))
    load_checkpoint(model, checkpoint_dir / "lit_model.safetensors")
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
    (out / "lit_model.safetensors").write_bytes(b"someone else's weights")
    with pytest.raises(LitError, match=str(out)):
        convert_gguf(gguf_path, out)
    assert (out / "lit_model.safetensors").read_bytes() == b"someone else's weights"
    # an earlier version's conversion (lit_model.pth) is not this one either: replaced only with overwrite
    shutil.rmtree(out)
    shutil.copytree(synthetic["dir"], out)
    (out / "lit_model.safetensors").unlink()
    (out / "lit_model.pth").write_bytes(b"an earlier version's weights")
    with pytest.raises(LitError, match=r"already holds .*lit_model\.pth.*--overwrite true"):
        convert_gguf(gguf_path, out)
    assert (out / "lit_model.pth").read_bytes() == b"an earlier version's weights"
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
    supported = "'llama', 'qwen2', 'qwen3', 'gemma2', 'gemma3', 'phi3'"
    with pytest.raises(LitError, match=f"architecture 'falcon'; supported GGUF architectures: {supported}") as e:
        convert_gguf(tmp_path / "falcon.gguf", tmp_path / "out1")
    assert "\n" not in str(e.value)
    write_llama_gguf(tmp_path / "spm.gguf", hf, {}, 2, 2, 1, tokens, [], tokenizer_model="t5")
    with pytest.raises(LitError, match="'t5' tokenizer"):
        convert_gguf(tmp_path / "spm.gguf", tmp_path / "out2")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(LitError, match="cannot read"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "out3")
    with pytest.raises(LitError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out4")
    with pytest.raises(LitError, match="dtype"):
        convert_gguf(tmp_path / "spm.gguf", tmp_path / "out5", dtype="int8")


# ---------------------------------------------------------------------------------------------------------------
# qwen2, qwen3, gemma2, gemma3, phi3: tiny HF models written as GGUF the way llama.cpp does (tests/gguf_writer.py)
# ---------------------------------------------------------------------------------------------------------------
_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
# Gemma: llama.cpp scales attention by 1/sqrt(head_dim) (the GGUF has no query_pre_attn_scalar) and transformers'
# loader keeps the config class's 256: the head size is 256 where the two are compared.
_GEMMA = dict(_SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=256, intermediate_size=128)
# Phi3Config's default ids (pad 32000) are outside these vocabularies
_PHI = dict(_SMALL, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SEQ = 12  # longer than the sliding windows (4) below: the window really drops keys

# name -> (GGUF architecture, HF config class, its kwargs, vocabulary, whether transformers' own GGUF loader reads
# everything the model uses; f16 weights)
ARCH_VARIANTS = {
    "qwen2": ("qwen2", "Qwen2Config", dict(_SMALL, rope_theta=1e6, tie_word_embeddings=True), "gpt2", True, False),
    # transformers' loader does not read qwen3's key_length: its Qwen3Config default head_dim (128) is used
    "qwen3": ("qwen3", "Qwen3Config", dict(_SMALL, head_dim=128, rope_theta=1e6), "gpt2", True, True),
    "gemma2": ("gemma2", "Gemma2Config", dict(_GEMMA, sliding_window=4), "spm-gemma", True, False),
    # 6 layers: five sliding-window layers, then a global one
    "gemma3": ("gemma3", "Gemma3TextConfig", dict(_GEMMA, num_hidden_layers=6, sliding_window=4), "spm-gemma", True,
               True),
    "phi3": ("phi3", "Phi3Config", dict(_PHI, original_max_position_embeddings=64), "spm", True, False),
    # what transformers' loader does not read (it keeps the config class's defaults), checked against the HF model
    # the file was written from: Gemma 3 4B-style linear RoPE scaling (global layers only) with a head size of 32,
    # Phi-3-mini's sliding window, Phi-4-mini's partial rotary embeddings, long-context RoPE factors and tied head
    "gemma3-scaled": ("gemma3", "Gemma3TextConfig",
                      dict(_GEMMA, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                           rope_scaling=dict(rope_type="linear", factor=8.0)), "spm-gemma", False, False),
    "phi3-window": ("phi3", "Phi3Config", dict(_PHI, original_max_position_embeddings=64, sliding_window=4), "spm",
                    False, False),
    "phi4-mini": ("phi3", "Phi3Config",
                  dict(_PHI, original_max_position_embeddings=8, tie_word_embeddings=True, partial_rotary_factor=0.5,
                       rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 2.0],
                                         long_factor=[1.0, 1.5, 3.0, 6.0])), "gpt2", False, False),
}


@pytest.fixture(scope="module")
def vocabularies():
    """The vocabularies, made once: byte-level BPE (Qwen, Phi-4) and sentencepiece (Gemma, Phi-3) ones."""
    pytest.importorskip("sentencepiece")
    phi3 = sentencepiece_vocab(gemma=False)
    phi3.pad = phi3.eos  # Phi-3's GGUF names a pad token; transformers' Phi3Config default (32000) is out of range
    return {"gpt2": gpt2_vocab(), "spm": phi3, "spm-gemma": sentencepiece_vocab(gemma=True)}


def build_hf(cls_name: str, kwargs: Dict, vocab_size: int, seed: int = 0):
    from tiny_hf import randomize_

    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, cls_name)(vocab_size=vocab_size, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def transformers_gguf_model(directory: Path, name: str):
    """transformers' own GGUF loader on `directory / name`. `from_pretrained(directory, gguf_file=name)` needs
    `accelerate`; without it, the same steps it takes for these (legacy-path) architectures: the config from the
    metadata, then `load_gguf_checkpoint`'s renamed and processed tensors loaded into that model."""
    import transformers
    from transformers.utils import is_accelerate_available

    kw = dict(dtype=torch.float32, attn_implementation="eager")
    if is_accelerate_available():
        return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, **kw).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, **kw)
    tensors = load_gguf_checkpoint(str(directory / name), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    model.tie_weights()
    return model.eval()


_converted: Dict[str, Dict] = {}


@pytest.fixture
def arch_case(request, vocabularies, tmp_path_factory):
    """One ARCH_VARIANTS entry written as GGUF and converted (once per session): the HF model it came from, the
    folder `convert_gguf` wrote, and the file."""
    name = request.param
    if name not in _converted:
        arch, cls_name, kwargs, vocab_name, read_by_transformers, f16 = ARCH_VARIANTS[name]
        vocab = vocabularies[vocab_name]
        hf_model = build_hf(cls_name, kwargs, len(vocab))
        root = tmp_path_factory.mktemp(f"gguf-{name}")
        write_gguf(root / f"{name}.gguf", arch, hf_model, vocab, f16=f16)
        out = convert_gguf(root / f"{name}.gguf", root / "converted")
        _converted[name] = dict(name=name, arch=arch, hf=hf_model, dir=out, root=root, file=f"{name}.gguf",
                                vocab=vocab, read_by_transformers=read_by_transformers, f16=f16)
    return _converted[name]


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_layer_tensor_names_follow_llama_cpp():
    """Every GGUF <-> HF name pair of `ARCHITECTURES` is the one llama.cpp's own tensor map (gguf-py) makes."""
    for arch_name, arch in ARCHITECTURES.items():
        names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name], 3)
        for gguf_name, hf_name in arch.layer.items():
            got = names.get_name(f"model.layers.2.{hf_name}", try_suffixes=(".weight", ".bias"))
            assert got == f"blk.2.{gguf_name}", (arch_name, hf_name)
    assert [a.permute_qk for a in ARCHITECTURES.values()] == [True, False, False, False, False, False]
    assert {n for n, a in ARCHITECTURES.items() if a.norm_offset} == {"gemma2", "gemma3"}


@pytest.mark.parametrize("arch_case", list(ARCH_VARIANTS), indirect=True)
def test_arch_config_matches_the_hf_model(arch_case):
    """config.json holds what the model the file came from needs (transformers reads both the same way)."""
    transformers = pytest.importorskip("transformers")
    expected = arch_case["hf"].config
    got = transformers.AutoConfig.from_pretrained(arch_case["dir"])
    assert got.model_type == expected.model_type and got.architectures == [type(arch_case["hf"]).__name__]
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters", "sliding_window",
            "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
            "original_max_position_embeddings", "max_position_embeddings", "hidden_activation", "hidden_act"]
    for key in keys:
        if hasattr(expected, key):
            assert getattr(got, key) == getattr(expected, key), key
    assert got.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)


@pytest.mark.parametrize("arch_case", list(ARCH_VARIANTS), indirect=True)
def test_arch_logits_match_transformers_gguf_loader(arch_case):
    """The HF folder we write gives transformers' GGUF loader's logits on the same file; where that loader does not
    read what the model uses (`read_by_transformers` False), the logits of the HF model the file was written from."""
    transformers = pytest.importorskip("transformers")
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        arch_case["dir"], dtype=torch.float32, attn_implementation="eager").eval()
    if arch_case["read_by_transformers"]:
        reference = transformers_gguf_model(arch_case["root"], arch_case["file"])
    else:
        reference = arch_case["hf"]
    idx = _ids(len(arch_case["vocab"]))
    with torch.no_grad():
        expected = reference(idx).logits
        actual = ours(idx).logits
    assert (actual - expected).abs().max().item() <= 1e-4
    if not arch_case["f16"]:  # float32 tensors: the model the file was written from, too
        with torch.no_grad():
            assert (actual - arch_case["hf"](idx).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch_case", list(ARCH_VARIANTS), indirect=True)
def test_arch_lit_logits_match_hf(arch_case):
    """End to end: the lit checkpoint `convert_gguf` wrote gives the logits of the HF folder next to it."""
    transformers = pytest.importorskip("transformers")
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        arch_case["dir"], dtype=torch.float32, attn_implementation="eager").eval()
    model = load_lit(arch_case["dir"])
    idx = _ids(len(arch_case["vocab"]))
    with torch.no_grad():
        expected = ours(idx).logits
        actual = model(idx)
    assert (actual - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch_case", ["gemma3", "phi3"], indirect=True)
def test_sentencepiece_vocabulary_round_trips(arch_case):
    """A sentencepiece ('llama') GGUF vocabulary becomes a tokenizer.model that lit and transformers read alike,
    that encodes like the sentencepiece model the vocabulary came from and like transformers' GGUF tokenizer, and
    decodes back to the text. Where a dummy prefix is added (Phi-3, not Gemma) the two conventions differ for a text
    that starts with a space or follows a special or user-defined token: llama.cpp and transformers' GGUF tokenizer
    prefix every text fragment; the folder keeps Llama 2's / Phi-3's own `legacy: false` (the start of the text
    only). transformers' tokenizers (its GGUF one, and its GemmaTokenizer reading tokenizer.model) do not match a
    user-defined piece made of spaces whole, where sentencepiece, llama.cpp and lit do."""
    import sentencepiece as spm

    transformers = pytest.importorskip("transformers")
    d, vocab = arch_case["dir"], arch_case["vocab"]
    assert (d / "tokenizer.model").is_file() and not (d / "tokenizer.json").exists()
    tok = Tokenizer(d)
    assert tok.backend == "sentencepiece" and tok.vocab_size == len(vocab)
    gemma = arch_case["arch"] == "gemma3"
    assert (tok.bos_id, tok.eos_id, tok.use_bos) == ((2, 1, True) if gemma else (1, 2, True))
    original = spm.SentencePieceProcessor(model_proto=vocab.sp_model)
    from_gguf = transformers.AutoTokenizer.from_pretrained(arch_case["root"], gguf_file=arch_case["file"])
    from_folder = transformers.AutoTokenizer.from_pretrained(d)
    turn = "<start_of_turn>" if gemma else "<|user|>"
    texts = ("hello world", "the lazy fox: 1234 ünïcödé 🦙", " two  spaces\tand\nlines", f"{turn}hi there",
             f"x {turn} y", "three   spaces")
    for text in texts:
        ids = tok.encode(text, bos=False).tolist()
        user_defined = "   " in text  # transformers' tokenizers split the user-defined "▁▁▁" apart
        if not (gemma and user_defined):
            assert ids == from_folder(text, add_special_tokens=False).input_ids, text
        prefix_differs = not gemma and (text.startswith(" ") or turn in text or user_defined)
        if not prefix_differs and not user_defined:
            assert ids == from_gguf(text, add_special_tokens=False).input_ids, text
        if turn not in text and (gemma or not text.startswith(" ")):  # sentencepiece: no special tokens
            assert ids == original.encode(text), text
        assert tok.decode(ids) == from_folder.decode(ids)
        # a decoder that adds a dummy prefix drops one leading space
        assert tok.decode(ids) == (text[1:] if text.startswith(" ") and not gemma else text)
    assert tok.encode(f"{turn}hi", bos=False).tolist()[0] == vocab.tokens.index(turn)  # a control token, whole
    assert vocab.tokens.index("   ") in tok.encode("three   spaces").tolist()  # a user-defined one, whole


def test_gpt4o_pre_tokenizer_splits_like_transformers_gguf_loader(tmp_path):
    """Phi-4-mini's GGUF files name the o200k split (`gpt-4o`): words split at case changes, digits in threes.
    The converted tokenizer gives the ids of transformers' own tokenizer for the same GGUF file."""
    from lit_gpt.tokenizer import Tokenizer

    transformers = pytest.importorskip("transformers")
    vocab = gpt2_vocab(pre="gpt-4o")
    # merges across the places where o200k splits and GPT-2's split does not (between digits 3 and 4 of a run,
    # at a lower-to-upper case change): they apply only if the split is GPT-2's
    for merge in ("3 4", "o W"):
        vocab.merges.append(merge)
        vocab.tokens.append(merge.replace(" ", ""))
        vocab.types.append(1)
    hf_model = build_hf("Phi3Config", ARCH_VARIANTS["phi4-mini"][2], len(vocab))
    write_gguf(tmp_path / "o200k.gguf", "phi3", hf_model, vocab)
    out = convert_gguf(tmp_path / "o200k.gguf", tmp_path / "out")
    ours = Tokenizer(out)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="o200k.gguf")
    for text in ("HelloWorld and helloWORLD", "12345678 and 42", "don't Won'T", "a  b\n\nc/d"):
        assert ours.encode(text, bos=False).tolist() == theirs(text, add_special_tokens=False).input_ids, text
    merged = [vocab.tokens.index("34"), vocab.tokens.index("oW")]
    assert not set(merged) & set(ours.encode("HelloWorld 12345678", bos=False).tolist())


def test_phi3_with_separate_q_k_v_is_fused(vocabularies, tmp_path):
    """A Phi-3 file with attn_q/k/v instead of attn_qkv becomes HF's fused qkv_proj (rows q | k | v)."""
    from safetensors.torch import load_file

    vocab = vocabularies["spm"]
    hf_model = build_hf("Phi3Config", ARCH_VARIANTS["phi3"][2], len(vocab))
    write_gguf(tmp_path / "split.gguf", "phi3", hf_model, vocab, split_qkv=True)
    names = {t.name for t in _open_reader(tmp_path / "split.gguf").tensors}
    assert "blk.1.attn_k.weight" in names and "blk.1.attn_qkv.weight" not in names
    converted = load_file(str(convert_gguf(tmp_path / "split.gguf", tmp_path / "out") / "model.safetensors"))
    expected = hf_model.state_dict()
    assert set(converted) == set(expected)  # qkv_proj, no q/k/v_proj
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_end_of_turn_token_ends_generation_too(vocabularies, tmp_path):
    """llama.cpp's tokenizer.ggml.eot_token_id (Gemma's <end_of_turn>, Phi-3's <|end|>) goes into
    generation_config.json beside EOS, as the Hub's own file lists it, so a raw prompt stops at the end of a turn."""
    import copy

    from lit_gpt.tokenizer import Tokenizer

    vocab = copy.copy(vocabularies["gpt2"])
    vocab.eot = vocab.bos  # an id other than EOS that the vocabulary has
    assert vocab.eot != vocab.eos
    hf_model = build_hf("Qwen3Config", ARCH_VARIANTS["qwen3"][2], len(vocab))
    write_gguf(tmp_path / "eot.gguf", "qwen3", hf_model, vocab)
    out = convert_gguf(tmp_path / "eot.gguf", tmp_path / "out")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [vocab.eos, vocab.eot]
    assert {vocab.eos, vocab.eot} <= set(Tokenizer(out).stop_ids)


@pytest.mark.parametrize("arch_case", ["gemma3"], indirect=True)
def test_reconverting_a_sentencepiece_model(arch_case, synthetic, tmp_path, capsys):
    """The same conversion again is a no-op; over another model's folder it is refused, and with --overwrite the
    old tokenizer.json goes (it would shadow the new tokenizer.model)."""
    gguf_path = arch_case["root"] / arch_case["file"]
    again = tmp_path / "again"
    shutil.copytree(arch_case["dir"], again)
    before = {p.name: p.read_bytes() for p in again.iterdir()}
    convert_gguf(gguf_path, again)
    assert "nothing to do" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in again.iterdir()} == before
    other = tmp_path / "other"
    shutil.copytree(synthetic["dir"], other)  # a llama conversion: tokenizer.json
    with pytest.raises(LitError, match="refusing to overwrite"):
        convert_gguf(gguf_path, other)
    convert_gguf(gguf_path, other, overwrite=True)
    assert not (other / "tokenizer.json").exists() and Tokenizer(other).backend == "sentencepiece"
    assert json.loads((other / "config.json").read_text())["model_type"] == "gemma3_text"


def test_gemma_27b_attention_scale_and_defaults(tmp_path):
    """llama.cpp's hard-coded Gemma rules: 1/sqrt(n_embd / n_head) for the 27B sizes (46 / 62 layers), else
    1/sqrt(head_dim); Gemma 2's window and soft-caps when the file has none; Gemma 3 without a window: no sliding
    layers and one RoPE base."""
    cases = {("gemma2", 46): 4608 // 32, ("gemma2", 42): 256, ("gemma3", 62): 5376 // 32, ("gemma3", 34): 256}
    for (arch, n_layer), scalar in cases.items():
        n_embd = 4608 if n_layer == 46 else 5376 if n_layer == 62 else 2560
        w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
        w.add_block_count(n_layer)
        w.add_context_length(8192)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(4 * n_embd)
        w.add_head_count(32)
        w.add_head_count_kv(16)
        w.add_key_length(128 if n_layer in (46, 62) else 256)
        w.add_value_length(128 if n_layer in (46, 62) else 256)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        reader = _open_reader(tmp_path / "m.gguf")
        config = _hf_config(arch, _read_metadata(reader), reader, torch.float32)
        assert config["query_pre_attn_scalar"] == scalar, (arch, n_layer)
        if arch == "gemma2":
            assert (config["sliding_window"], config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (
                4096, 50.0, 30.0)
            assert config["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
            assert config["rope_theta"] == 10000.0  # llama.cpp writes no rope theta for Gemma 2
        else:
            assert config["sliding_window"] is None and set(config["layer_types"]) == {"full_attention"}
            assert config["rope_local_base_freq"] == config["rope_theta"] == 10000.0
            assert config["final_logit_softcapping"] is None and config["model_type"] == "gemma3_text"


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
                 "model.safetensors", "lit_model.safetensors", "lit_config.json"):
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
