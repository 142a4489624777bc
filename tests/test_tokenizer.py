"""Tokenizer: ids and text equal transformers' AutoTokenizer on the same files; BOS/EOS rules; streaming."""

import json
import random
from pathlib import Path

import pytest
import torch

from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import LitError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  two leading spaces and   three inside  ",
    "tabs\tand\nnewlines\r\n\n\nend",
    "Unicode: naïve café Ωμέγα ñ Straße",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧",
    "CJK 中文字符 日本語のテキスト 한국어",
    "numbers 12345 3.14159 2024-01-01",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
    " ",
    "\n",
]
SPECIAL_TEXTS = ["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "text <|endoftext|> more<|im_end|>"]


def assert_parity(tok: Tokenizer, hf, texts) -> None:
    for text in texts:
        ids = tok.encode(text)
        assert ids.dtype == torch.long
        expected = hf(text)["input_ids"]
        assert ids.tolist() == expected, text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(expected, skip_special_tokens=skip), text


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 (tokenizer.json, byte-level BPE, no BOS)
# ---------------------------------------------------------------------------------------------------------------
def test_smollm2_matches_transformers(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.backend == "huggingface"
    assert tok.vocab_size == len(hf) == 49152
    assert_parity(tok, hf, TEXTS + SPECIAL_TEXTS)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    # special-token strings become one id each
    assert tok.encode("<|im_start|>").tolist() == [hf.convert_tokens_to_ids("<|im_start|>")]


def test_smollm2_special_ids(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    assert tok.bos_id == tok.token_to_id("<|im_start|>") == 1
    assert tok.eos_id == tok.token_to_id("<|im_end|>") == 2
    assert tok.use_bos is False  # SmolLM2 adds no BOS
    assert tok.stop_ids == [2]
    ids = tok.encode("Hi", bos=True, eos=True).tolist()
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids[1:-1]) == "Hi"
    assert tok.encode("Hi", bos=True).tolist().count(1) == 1
    assert tok.encode("<|im_start|>Hi", bos=True).tolist().count(1) == 1  # an existing BOS is not doubled
    assert tok.encode("a b c d e f", max_length=3).numel() == 3
    assert tok.decode(tok.encode("x<|im_end|>"), skip_special_tokens=True) == "x"


# ---------------------------------------------------------------------------------------------------------------
# a Llama 3 style tokenizer.json: the post-processor adds BOS, generation_config lists several EOS ids
# ---------------------------------------------------------------------------------------------------------------
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a small corpus for a tiny tokenizer",
    "café naïve Straße 東京 日本 😀 numbers 123 456",
] * 20


def write_llama3_style(directory: Path, tokenizer_config: dict) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))],
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": False, **tokenizer_config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tokenizer.token_to_id(t) for t in specials]
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": ids[0], "eos_token_id": ids[1:]}))
    return directory


def test_post_processor_bos_and_eos_lists(tmp_path):
    d = write_llama3_style(tmp_path / "llama3", {})
    tok = Tokenizer(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert tok.use_bos is True  # no add_bos_token flag: the post-processor adds BOS, as in Llama 3
    assert tok.encode("hello").tolist()[0] == tok.token_to_id("<|begin_of_text|>")
    assert_parity(tok, hf, TEXTS[:9] + ["<|eot_id|> hello <|end_of_text|>"])
    assert tok.eos_id == tok.token_to_id("<|end_of_text|>")
    assert tok.stop_ids == [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]


def test_post_processor_decides_bos_over_the_flag(tmp_path):
    # transformers 5 keeps a tokenizer.json post-processor as written even when tokenizer_config says otherwise
    d = write_llama3_style(tmp_path / "flag", {"add_bos_token": False})
    tok = Tokenizer(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert tok.use_bos is True
    assert_parity(tok, hf, TEXTS[:9])
    assert tok.encode("hello", bos=False).tolist()[0] != tok.bos_id  # an explicit request wins


# ---------------------------------------------------------------------------------------------------------------
# sentencepiece (tokenizer.model only)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world café naïve 東京 日本 model token stream".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    (d / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    # Llama's settings: BPE, byte fallback, digits split, no normalization, whitespace kept
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True, minloglevel=2,
    )
    (d / "corpus.txt").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True}
    ))
    return d


def test_sentencepiece_matches_transformers(sp_dir):
    tok = Tokenizer(sp_dir)
    hf = transformers.AutoTokenizer.from_pretrained(sp_dir)
    assert tok.backend == "sentencepiece"
    assert (tok.bos_id, tok.eos_id, tok.use_bos, tok.stop_ids) == (1, 2, True, [2])
    assert tok.vocab_size == len(hf) == 400
    # whitespace at the start, after special tokens, unknown characters (byte fallback), special-token strings
    texts = TEXTS + ["hello</s> world", "a </s> b<s>c", "<unk>x", "  x", "\n x", "x\n"]
    assert_parity(tok, hf, texts)
    # round trip; like transformers' LlamaTokenizer, a leading space is lost (it reads as the word boundary)
    for text in (t for t in TEXTS if not t.startswith(" ")):
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
        assert tok.decode(tok.encode(text, bos=False)) == text


def test_sentencepiece_bos_rules(sp_dir, tmp_path):
    tok = Tokenizer(sp_dir)
    assert tok.encode("hello").tolist()[0] == 1
    assert tok.encode("hello", bos=False).tolist()[0] != 1
    assert tok.encode("<s>hello").tolist().count(1) == 1  # not doubled (transformers would give [1, 1, ...])
    assert tok.encode("hello", eos=True).tolist()[-1] == 2
    # for a sentencepiece model, tokenizer_config's flag turns BOS off, as in transformers' LlamaTokenizer
    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    config = json.loads((sp_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    tok = Tokenizer(tmp_path)
    assert tok.use_bos is False
    assert_parity(tok, transformers.AutoTokenizer.from_pretrained(tmp_path), TEXTS[:4])


# ---------------------------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------------------------
def test_stream_decoder_emits_only_complete_text(smollm2_dir, sp_dir):
    for d in (smollm2_dir, sp_dir):
        tok = Tokenizer(d)
        for text in TEXTS + ["😀😀 中文 👨‍👩‍👧 ok"]:
            ids = tok.encode(text, bos=False)
            decoder = tok.stream_decoder()
            pieces = [decoder.step(i) for i in ids.tolist()] + [decoder.flush()]
            assert "".join(pieces) == tok.decode(ids), (d, text)
            assert not any("\ufffd" in p for p in pieces)
            assert "".join(tok.decode_stream(ids)) == tok.decode(ids)


def test_stream_decoder_holds_back_partial_characters(smollm2_dir, sp_dir):
    tok = Tokenizer(smollm2_dir)
    ids = tok.encode(" 😀").tolist()
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])  # the emoji's bytes span two tokens
    decoder = tok.stream_decoder()
    assert decoder.step(ids[0]) == ""
    assert "".join(decoder.step(i) for i in ids[1:]) == " 😀"
    # ids that end mid-character: `flush` hands out what is left
    decoder = tok.stream_decoder()
    assert decoder.step(ids[0]) == ""
    assert decoder.flush() == tok.decode(ids[:1])
    # sentencepiece's word-initial "▁" survives piece by piece (a piece decoded alone would lose it)
    sp = Tokenizer(sp_dir)
    ids = sp.encode("hello world", bos=False)
    assert [sp.id_to_token(i) for i in ids.tolist()] == ["▁hello", "▁world"]
    assert sp.decode(ids[1:]) == "world"
    assert list(sp.decode_stream(ids)) == ["hello", " world"]


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------
def test_missing_or_broken_tokenizer(tmp_path):
    with pytest.raises(LitError, match="does not exist"):
        Tokenizer(tmp_path / "nope")
    with pytest.raises(LitError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LitError, match="cannot load"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(LitError, match="sentencepiece"):
        Tokenizer(tmp_path)
