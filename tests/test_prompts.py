"""Prompt styles: chat templates render exactly like transformers' apply_chat_template; automatic choice."""

import functools
import json
import shutil
from pathlib import Path

import pytest

from lit_gpt.prompts import Alpaca, ChatTemplate, PromptStyle, Raw, is_chat_model, load_chat_template
from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import LitError

transformers = pytest.importorskip("transformers")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

HISTORIES = [
    [],
    [("system", "You answer in one word.")],
    [("user", "Hi 😀"), ("assistant", "Hello! How can I help?")],
    [("system", "Be terse."), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"), ("assistant", "6")],
]


def copy_tokenizer(src: Path, dst: Path, **config_updates) -> Path:
    dst.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)
    if config_updates:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config.update(config_updates)
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@functools.lru_cache(maxsize=4)
def hf_tokenizer(checkpoint_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(checkpoint_dir)


def hf_render(checkpoint_dir: Path, history, prompt: str) -> str:
    hf = hf_tokenizer(checkpoint_dir)
    messages = [{"role": r, "content": c} for r, c in history] + [{"role": "user", "content": prompt}]
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_smollm2_chat_template_matches_transformers(smollm2_dir):
    style = PromptStyle.from_checkpoint(smollm2_dir)
    assert isinstance(style, ChatTemplate)
    for history in HISTORIES:
        assert style.apply("What is the capital of France?", history) == hf_render(
            smollm2_dir, history, "What is the capital of France?"
        )
    # the template's default system prompt appears when none is given
    assert "You are a helpful AI assistant named SmolLM" in style.apply("hi")
    # a system prompt passed to `apply` is the first message
    assert style.apply("hi", system="Be brief.") == hf_render(smollm2_dir, [("system", "Be brief.")], "hi")


TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "Default system" %}
{%- endif %}
<|im_start|>system
{{ system }}<|im_end|>
{% for message in messages %}
{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}
{% if loop.index0 > 8 %}{% break %}{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|im_end|>{% endgeneration %}
{% else %}{{ message['content'] }}<|im_end|>
{% endif %}
{% endfor %}
{{- {"note": "ünïcode <b>&"} | tojson }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_template_features_match_transformers(smollm2_dir, tmp_path):
    # bos_token variable, trim_blocks/lstrip_blocks, set/slicing, loop controls, {% generation %}, tojson
    d = copy_tokenizer(smollm2_dir, tmp_path / "Custom-Instruct", chat_template=TEMPLATE)
    style = PromptStyle.from_checkpoint(d)
    assert isinstance(style, ChatTemplate)
    for history in HISTORIES:
        assert style.apply("Why?  ", history) == hf_render(d, history, "Why?  ")
    with pytest.raises(LitError, match="unknown role tool"):
        style.apply("x", [("tool", "{}")])


def test_template_sources(smollm2_dir, tmp_path):
    template = load_chat_template(smollm2_dir)
    # a list of named templates: "default" is used
    d = copy_tokenizer(smollm2_dir, tmp_path / "a", chat_template=[{"name": "tool_use", "template": "T"},
                                                                   {"name": "default", "template": template}])
    assert load_chat_template(d) == template
    # chat_template.jinja wins over tokenizer_config.json
    (d / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}!")
    assert ChatTemplate.from_checkpoint(d).apply("hey") == "hey!"
    with pytest.raises(LitError, match="not valid Jinja"):
        ChatTemplate("{% for %}")


def test_automatic_choice_and_override(smollm2_dir, tmp_path):
    base = copy_tokenizer(smollm2_dir, tmp_path / "SmolLM2-135M")  # same files, a base model's name
    assert not is_chat_model(base) and is_chat_model(smollm2_dir)
    assert isinstance(PromptStyle.from_checkpoint(base), Raw)
    assert isinstance(PromptStyle.from_checkpoint(base, "chat"), ChatTemplate)
    assert isinstance(PromptStyle.from_checkpoint(smollm2_dir, "alpaca"), Alpaca)
    assert isinstance(PromptStyle.from_checkpoint(smollm2_dir, "raw"), Raw)
    for name in ("gemma-2b-it", "Llama-2-7b-chat-hf", "Qwen2.5-0.5B-Instruct"):
        (tmp_path / name).mkdir()
        assert is_chat_model(tmp_path / name), name
    for name in ("Llama-2-7b-hf", "pythia-160m", "gemma-2b", "tiny-llama"):
        (tmp_path / name).mkdir(exist_ok=True)
        assert not is_chat_model(tmp_path / name), name

    no_template = copy_tokenizer(smollm2_dir, tmp_path / "NoTemplate-Instruct", chat_template=None)
    assert isinstance(PromptStyle.from_checkpoint(no_template), Raw)
    with pytest.raises(LitError, match="no chat template"):
        PromptStyle.from_checkpoint(no_template, "chat")
    with pytest.raises(LitError, match="unknown prompt style 'vicuna'"):
        PromptStyle.from_checkpoint(smollm2_dir, "vicuna")


def test_stop_tokens(smollm2_dir, tmp_path):
    tokenizer = Tokenizer(smollm2_dir)
    assert PromptStyle.from_checkpoint(smollm2_dir).stop_tokens(tokenizer) == ([2],)
    assert Raw().stop_tokens(tokenizer) == ([2],)
    # a base model: EOS is <|endoftext|>, but its chat template ends turns with <|im_end|>
    base = copy_tokenizer(smollm2_dir, tmp_path / "SmolLM2-135M", eos_token="<|endoftext|>")
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    base_tokenizer = Tokenizer(base)
    assert base_tokenizer.stop_ids == [0]
    assert ChatTemplate.from_checkpoint(base).stop_tokens(base_tokenizer) == ([0], [2])
    assert Alpaca().stop_tokens(base_tokenizer) == ([0],)


def test_alpaca():
    style = Alpaca()
    text = style.apply("Name a color.")
    assert text.startswith("Below is an instruction that describes a task. Write a response")
    assert text.endswith("### Instruction:\nName a color.\n\n### Response:\n")
    text = style.apply("Translate.", input="Bonjour")
    assert "paired with an input" in text
    assert text.endswith("### Instruction:\nTranslate.\n\n### Input:\nBonjour\n\n### Response:\n")
    text = style.apply("And another?", [("user", "Name a color."), ("assistant", "Red.")])
    assert text.index("Name a color.") < text.index("### Response:\nRed.") < text.index("And another?")
    assert text.count("Below is an instruction") == 1


def test_raw():
    assert Raw().apply("The capital of France is") == "The capital of France is"
    assert Raw().apply(" more", [("user", "Once upon"), ("assistant", " a time")]) == "Once upon a time more"
