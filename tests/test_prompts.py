"""Prompt styles: chat templates render exactly like transformers' apply_chat_template; automatic choice."""

import functools
import json
import re
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
    # decided by the checkpoint's files, never by its folder's name: the instruct files under a base model's name
    renamed = copy_tokenizer(smollm2_dir, tmp_path / "SmolLM2-135M")
    assert is_chat_model(renamed) and is_chat_model(smollm2_dir)
    assert isinstance(PromptStyle.from_checkpoint(renamed), ChatTemplate)
    # a base model's files under an instruct model's name: its EOS <|endoftext|> does not end the template's turns
    base = copy_tokenizer(smollm2_dir, tmp_path / "SmolLM2-135M-Instruct", eos_token="<|endoftext|>")
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert not is_chat_model(base)
    assert isinstance(PromptStyle.from_checkpoint(base), Raw)
    assert isinstance(PromptStyle.from_checkpoint(base, "chat"), ChatTemplate)
    assert isinstance(PromptStyle.from_checkpoint(smollm2_dir, "alpaca"), Alpaca)
    assert isinstance(PromptStyle.from_checkpoint(smollm2_dir, "raw"), Raw)
    # folders without tokenizer files are no chat models, whatever they are called
    for name in ("gemma-2b-it", "Llama-2-7b-chat-hf", "Qwen2.5-0.5B-Instruct"):
        (tmp_path / name).mkdir()
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


def _renamed_copy(src: Path, dst: Path) -> Path:
    """The checkpoint under another folder name, as scripts/convert_hf_checkpoint.py names it (lit_config.json's
    `name` is the folder's); the weights linked, not copied."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "lit_config.json").read_text())
    (dst / "lit_config.json").write_text(json.dumps({**config, "name": dst.name}))
    return dst


def _generate(capsys, monkeypatch, checkpoint_dir: Path, *args: str):
    import runpy
    import sys

    script = Path(__file__).resolve().parents[1] / "generate" / "base.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--checkpoint_dir", str(checkpoint_dir), "--temperature", "0",
                                      "--accelerator", "cpu", "--precision", "32-true", "--compile", "none", *args])
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr()


def test_a_renamed_instruct_checkpoint_encodes_the_same_request(smollm2_dir, tmp_path):
    """What generate/*.py feed the model (the prompt with its template, the stop ids) is the same under any folder
    name: the checkpoint's files decide, not `checkpoints/my-model`."""
    from lit_gpt.recipes.generate import GenerationArgs, check_request

    renamed = _renamed_copy(smollm2_dir, tmp_path / "checkpoints" / "my-model")
    own, other = (check_request(GenerationArgs("What is the capital of France?", d)) for d in (smollm2_dir, renamed))
    assert isinstance(other.style, ChatTemplate)
    assert other.encoded.tolist() == own.encoded.tolist() and other.stop_ids == own.stop_ids == [2]


@pytest.mark.slow  # loads the real SmolLM2 twice and generates: ~10 s
def test_a_renamed_instruct_checkpoint_generates_the_same(smollm2_dir, tmp_path, capsys, monkeypatch):
    """The folder's name decides nothing: the instruct model under `my-model` (lit_config.json saying so too) uses
    its chat template and answers exactly as under its own name; the style is named on stderr."""
    renamed = _renamed_copy(smollm2_dir, tmp_path / "checkpoints" / "my-model")
    ask = ("--prompt", "What is the capital of France?", "--max_new_tokens", "8")
    own = _generate(capsys, monkeypatch, smollm2_dir, *ask)
    other = _generate(capsys, monkeypatch, renamed, *ask)
    assert "Paris" in own.out and other.out == own.out, (own, other)
    for run in (own, other):
        assert "Prompt style: chat (the checkpoint's chat template ends replies with <|im_end|>" in run.err, run.err
        assert re.search(r"Sample 1: [1-8] tokens", run.err), run.err


def test_an_empty_sample_says_why(smollm2_dir, capsys):
    """A sample of 0 tokens names the stop token the model began with, the prompt style, and the other style."""
    import torch

    from lit_gpt.generate import GenerationResult, compile_steps
    from lit_gpt.recipes.generate import GenerationArgs, check_request, print_sample

    class Fabric:
        @staticmethod
        def print(*args, **kwargs):
            print(*args, **kwargs)

    class CPU:
        name = "cpu"

    request = check_request(GenerationArgs("Hi", smollm2_dir, prompt_style="raw", max_new_tokens=4))
    empty = GenerationResult(torch.tensor([], dtype=torch.long), 3, 0.1, None, 0.1, 0)
    print_sample(Fabric(), request, empty, 0, compile_steps(None), CPU())
    err = capsys.readouterr().err
    assert "Sample 1: 0 tokens" in err
    assert ("Sample 1 is empty: the model's first token was a stop token (<|im_end|>) with prompt style raw;"
            " try --prompt_style chat") in err, err
