"""Write tiny GGUF files from Hugging Face models the way llama.cpp's `convert_hf_to_gguf.py` does, for the tests of
`lit_gpt.gguf`.

Independent of the converter under test: tensor names come from the `gguf` package's own `TensorNameMap` (llama.cpp's
`gguf-py/gguf/tensor_mapping.py`), and each architecture's metadata and tensor edits follow llama.cpp's model class:
- `TextModel.set_gguf_parameters` (qwen2, qwen3, gemma3's base): block count, context, sizes, heads, rope theta,
  rms eps, key/value length when config.json has `head_dim`, linear / YaRN rope scaling;
- `Gemma2Model`: its own list (no rope theta: llama.cpp's default 10000), key/value length, soft-caps, window; every
  `*norm.weight` stored as 1 + w; `lm_head` skipped (tied);
- `Gemma3Model`: the base list plus key/value length, the global rope theta, the window, the final soft-cap when
  set; every `*norm.weight` stored as 1 + w;
- `Phi3MiniModel`: its own list, with `rope.dimension_count` = int(partial_rotary_factor * n_embd) // n_head, the
  window (0 for none) and, for long-context models, `rope_factors_long/short.weight` and the attention factor.
Vocabularies: byte-level BPE ('gpt2', with merges) or sentencepiece ('llama'), the latter built from a real
sentencepiece model as `_create_vocab_sentencepiece` does (pieces, scores, types; tokens added in tokenizer_config.json
get score -1000 and become CONTROL when special, else USER_DEFINED with their "▁" written as spaces).
"""

import io
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

import gguf

ARCH_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def byte_level_vocab() -> List[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


class Vocab:
    """A tokenizer as llama.cpp writes it into GGUF metadata."""

    def __init__(self, model: str, tokens: List[str], types: List[int], scores: Optional[List[float]] = None,
                 merges: Optional[List[str]] = None, pre: Optional[str] = None, bos: Optional[int] = None,
                 eos: Optional[int] = None, unk: Optional[int] = None, pad: Optional[int] = None,
                 add_bos: Optional[bool] = None, add_space_prefix: Optional[bool] = None,
                 chat_template: Optional[str] = None, sp_model: Optional[bytes] = None,
                 eot: Optional[int] = None) -> None:
        self.model, self.tokens, self.types, self.scores = model, tokens, types, scores
        self.merges, self.pre = merges, pre
        self.bos, self.eos, self.unk, self.pad = bos, eos, unk, pad
        self.add_bos, self.add_space_prefix, self.chat_template = add_bos, add_space_prefix, chat_template
        self.sp_model = sp_model  # the original sentencepiece model (tests compare against it)
        self.eot = eot  # end of turn (llama.cpp's tokenizer.ggml.eot_token_id)

    def __len__(self) -> int:
        return len(self.tokens)

    def write(self, writer: "gguf.GGUFWriter") -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        for value, add in ((self.bos, writer.add_bos_token_id), (self.eos, writer.add_eos_token_id),
                           (self.unk, writer.add_unk_token_id), (self.pad, writer.add_pad_token_id),
                           (self.eot, writer.add_eot_token_id)):
            if value is not None:
                add(value)
        if self.add_bos is not None:
            writer.add_add_bos_token(self.add_bos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def gpt2_vocab(pre: str = "qwen2") -> Vocab:
    """Byte-level BPE: three ChatML specials, the 256 byte symbols and a few merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level_vocab()
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
    tokens += [m.replace(" ", "") for m in merges]
    return Vocab("gpt2", tokens, [3 if t.startswith("<|") else 1 for t in tokens], merges=merges, pre=pre,
                 bos=tokens.index("<|endoftext|>"), eos=tokens.index("<|im_end|>"), add_bos=False,
                 chat_template="{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")


_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there: the world is wide and the sea is deep",
    "numbers 1 2 3 and 42 or 1234 appear here and there",
    "Gemma and Phi read text with sentencepiece pieces, bytes for the rest",
    "a  double space,\ttabs\tand\nnew lines\n\nmatter too",
] * 4


def sentencepiece_vocab(gemma: bool, vocab_size: int = 300) -> Vocab:
    """Train a tiny sentencepiece BPE model (Gemma-style: no dummy prefix, specials pad/eos/bos/unk = 0..3, two turn
    markers; else Llama/Phi-3-style: dummy prefix, unk/bos/eos = 0..2) and write its vocabulary as llama.cpp does."""
    import sentencepiece as spm

    buffer = io.BytesIO()
    specials = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    added = ["<start_of_turn>", "<end_of_turn>"] if gemma else ["<|user|>", "<|end|>"]
    plain = ["▁▁▁"]  # an added token that is not special: llama.cpp writes its "▁" as spaces
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS), model_writer=buffer, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=1.0, add_dummy_prefix=not gemma, remove_extra_whitespaces=False,
        normalization_rule_name="identity", user_defined_symbols=added + plain, minloglevel=2, **specials,
    )
    sp = spm.SentencePieceProcessor(model_proto=buffer.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = 1
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_unused(i):
            kind = 5
        elif sp.is_byte(i):
            kind = 6
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(kind)
    for token in added:  # listed as special in the model's tokenizer_config.json
        i = tokens.index(token)
        scores[i], types[i] = -1000.0, 3
    for token in plain:  # listed there as not special
        i = tokens.index(token)
        tokens[i], scores[i], types[i] = token.replace("▁", " "), -1000.0, 4
    return Vocab(
        "llama", tokens, types, scores=scores, pre="default",
        bos=specials["bos_id"], eos=specials["eos_id"], unk=specials["unk_id"],
        pad=specials["pad_id"] if specials["pad_id"] >= 0 else None, add_bos=True,
        add_space_prefix=False if gemma else None, sp_model=buffer.getvalue(),
    )


def _rope(config: Any) -> Dict[str, Any]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    return dict(params.get("full_attention", params))


def write_gguf(path: Path, arch: str, hf_model: torch.nn.Module, vocab: Vocab, f16: bool = False,
               split_qkv: bool = False) -> None:
    """`hf_model` (a transformers causal LM of the family `arch` reads) as llama.cpp's converter writes it;
    `split_qkv`: Phi-3's fused qkv_proj as separate attn_q/k/v tensors (which llama.cpp's loader also accepts)."""
    c = hf_model.config
    n_layer, n_embd, n_head = c.num_hidden_layers, c.hidden_size, c.num_attention_heads
    n_kv = c.num_key_value_heads or n_head
    rope = _rope(c)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    extra: Dict[str, np.ndarray] = {}
    if arch in ("qwen2", "qwen3", "gemma3"):  # TextModel.set_gguf_parameters
        w.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        elif rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if arch == "qwen3" or arch == "gemma3":  # config.json has head_dim
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
    if arch == "gemma2":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma3":
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        if c.sliding_window is not None and "sliding_attention" in c.layer_types:
            w.add_sliding_window(c.sliding_window)
    if arch == "phi3":
        partial = rope.get("partial_rotary_factor", 1.0)
        rope_dims = int(partial * n_embd) // n_head
        original = getattr(c, "original_max_position_embeddings", None) or rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):
            scale = c.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    vocab.write(w)

    name_map = gguf.get_tensor_name_map(ARCH_ENUM[arch], n_layer)
    state_dict = dict(hf_model.state_dict())
    if split_qkv:
        head_dim = n_embd // n_head
        for hf_name in [n for n in state_dict if n.endswith("qkv_proj.weight")]:
            q, k, v = state_dict.pop(hf_name).split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim])
            for part, tensor in zip("qkv", (q, k, v)):
                state_dict[hf_name.replace("qkv_proj", f"{part}_proj")] = tensor
    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied head is not in the checkpoint
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf has no name for {hf_name} in {arch}"
        data = tensor.detach().float().numpy().copy()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1  # Gemma RMSNorm scales by (1 + w): llama.cpp stores 1 + w
        # llama.cpp keeps norms (1-D) in float32 whatever the file type
        w.add_tensor(name, data.astype(np.float16) if f16 and data.ndim > 1 else data.astype(np.float32))
    for name, data in extra.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
