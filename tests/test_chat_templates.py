"""Chat templates of the supported model families give the same token ids as transformers' `apply_chat_template`.

Each family gets a checkpoint folder with a tiny byte-level `tokenizer.json` that has the family's special tokens, a
`tokenizer_config.json` with its named special tokens and its real chat template (SmolLM3's in a separate
`chat_template.jinja`, as on the Hub), and our side encodes the rendered text the way the recipes do
(`tokenizer.encode(style.apply(...))`, generate.py and chat/base.py), BOS rules included.
"""

import functools
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from lit_gpt.config import Config
from lit_gpt.recipes.generate import GenerationArgs, check_request
from lit_gpt.prompts import ChatTemplate, PromptStyle, is_chat_model
from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import LitError

transformers = pytest.importorskip("transformers")

# ---------------------------------------------------------------------------------------------------------------
# The templates, as the checkpoints ship them
# ---------------------------------------------------------------------------------------------------------------
# Qwen/Qwen3-0.6B (the same template in every Qwen3 checkpoint of April 2025)
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# google/gemma-2-2b-it
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# google/gemma-3-1b-it (text part of the template every Gemma 3 checkpoint ships)
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# microsoft/Phi-3.5-mini-instruct
PHI35_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# microsoft/Phi-4-mini-instruct
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is"
    " not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>'"
    " + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

# microsoft/phi-4
PHI4 = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}"
    "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)

# allenai/OLMo-2-1124-7B-Instruct (and 13B)
OLMO2 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}{% else %}"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)

# HuggingFaceTB/SmolLM3-3B chat_template.jinja
SMOLLM3 = r"""{# ───── defaults ───── #}
{%- if enable_thinking is not defined -%}
{%- set enable_thinking = true -%}
{%- endif -%}

{# ───── reasoning mode ───── #}
{%- if enable_thinking -%}
  {%- set reasoning_mode = "/think" -%}
{%- else -%}
  {%- set reasoning_mode = "/no_think" -%}
{%- endif -%}

{# ───── header (system message) ───── #}
{{- "<|im_start|>system\n" -}}

{%- if messages[0].role == "system" -%}
  {%- set system_message = messages[0].content -%}
  {%- if "/no_think" in system_message -%}
    {%- set reasoning_mode = "/no_think" -%}
  {%- elif "/think" in system_message -%}
    {%- set reasoning_mode = "/think" -%}
  {%- endif -%}
  {%- set custom_instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}

{%- if "/system_override" in system_message -%}
  {{- custom_instructions.replace("/system_override", "").rstrip() -}}
  {{- "<|im_end|>\n" -}}
{%- else -%}
  {{- "## Metadata\n\n" -}}
  {{- "Knowledge Cutoff Date: June 2025\n" -}}
  {%- set today = strftime_now("%d %B %Y") -%}
  {{- "Today Date: " ~ today ~ "\n" -}}
  {{- "Reasoning Mode: " + reasoning_mode + "\n\n" -}}

  {{- "## Custom Instructions\n\n" -}}
  {%- if custom_instructions -%}
    {{- custom_instructions + "\n\n" -}}
  {%- elif reasoning_mode == "/think" -%}
    {{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves thoroughly exploring questions through a systematic thinking process before providing the final precise and accurate solutions. This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, reassessment, reflection, backtracking, and iteration to develop well-considered thinking process. Please structure your response into two main sections: Thought and Solution using the specified format: <think> Thought section </think> Solution section. In the Thought section, detail your reasoning process in steps. Each step should include detailed considerations such as analysing questions, summarizing relevant findings, brainstorming new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting previous steps. In the Solution section, based on various attempts, explorations, and reflections from the Thought section, systematically present the final solution that you deem correct. The Solution section should be logical, accurate, and concise and detail necessary steps needed to reach the conclusion.\n\n" -}}
  {%- else -%}
    {{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face.\n\n" -}}
  {%- endif -%}

  {%- if xml_tools or python_tools -%}
    {{- "### Tools\n\n" -}}
    {%- if xml_tools -%}
      {%- set ns = namespace(xml_tool_string="You may call one or more functions to assist with the user query.\nYou are provided with function signatures within <tools></tools> XML tags:\n\n<tools>\n") -%}
      {%- for tool in xml_tools[:] -%} {# The slicing makes sure that xml_tools is a list #}
        {%- set ns.xml_tool_string = ns.xml_tool_string ~ (tool | string) ~ "\n" -%}
      {%- endfor -%}
      {%- set xml_tool_string = ns.xml_tool_string + "</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" -%}
      {{- xml_tool_string -}}
    {%- endif -%}
    {%- if python_tools -%}
      {%- set ns = namespace(python_tool_string="When you send a message containing Python code between '<code>' and '</code>' tags, it will be executed in a stateful Jupyter notebook environment, and you will then be given the output to continued reasoning in an agentic loop.\n\nYou can use the following tools in your python code like regular functions:\n<tools>\n") -%}
      {%- for tool in python_tools[:] -%} {# The slicing makes sure that python_tools is a list #}
        {%- set ns.python_tool_string = ns.python_tool_string ~ (tool | string) ~ "\n" -%}
      {%- endfor -%}
      {%- set python_tool_string = ns.python_tool_string + "</tools>\n\nThe state persists between code executions: so variables that you define in one step are still available thereafter." -%}
      {{- python_tool_string -}}
    {%- endif -%}
    {{- "\n\n" -}}
    {{- "<|im_end|>\n" -}}
  {%- endif -%}
{%- endif -%}
{# ───── main loop ───── #}
{%- for message in messages -%}
    {%- set content = message.content if message.content is string else "" -%}
    {%- if message.role == "user" -%}
        {{ "<|im_start|>" + message.role + "\n"  + content + "<|im_end|>\n" }}
    {%- elif message.role == "assistant" -%}
        {% generation %}
        {%- if reasoning_mode == "/think" -%}
            {{ "<|im_start|>assistant\n" + content.lstrip("\n") + "<|im_end|>\n" }}
        {%- else -%}
            {{ "<|im_start|>assistant\n" + "<think>\n\n</think>\n" + content.lstrip("\n") + "<|im_end|>\n" }}
        {%- endif -%}
        {% endgeneration %}
    {%- elif message.role == "tool" -%}
    {{ "<|im_start|>" + "user\n"  + content + "<|im_end|>\n" }}
    {%- endif -%}
{%- endfor -%}
{# ───── generation prompt ───── #}
{%- if add_generation_prompt -%}
    {%- if reasoning_mode == "/think" -%}
        {{ "<|im_start|>assistant\n" }}
    {%- else -%}
        {{ "<|im_start|>assistant\n" + "<think>\n\n</think>\n"  }}
    {%- endif -%}
{%- endif -%}
"""


# ---------------------------------------------------------------------------------------------------------------
# The families: special tokens (the added tokens the template writes), named tokens, and BOS handling
# ---------------------------------------------------------------------------------------------------------------
class Family:
    def __init__(self, name: str, template: str, special: Sequence[str], config: Dict[str, Any],
                 added: Sequence[str] = (), add_bos: Optional[str] = None, turn_end: str = "",
                 jinja_file: bool = False, generation_eos: Sequence[str] = ()) -> None:
        self.name = name  # also the checkpoint folder's name: an instruct model's
        self.template = template
        self.special = list(special)  # added tokens with special=True
        self.added = list(added)  # added tokens with special=False (e.g. Qwen3's <think>)
        self.config = config  # tokenizer_config.json's named special tokens
        self.add_bos = add_bos  # the BOS that tokenizer.json's post-processor adds, if any (Gemma's <bos>)
        self.turn_end = turn_end  # the token that ends an assistant turn: generation must stop on it
        self.jinja_file = jinja_file  # the template in chat_template.jinja instead of tokenizer_config.json
        # the tokens whose ids generation_config.json's eos_token_id lists (as the Hub's file does: Gemma "-it" and
        # Phi-3.5/4-mini stop on their turn end, which is not their tokenizer's EOS)
        self.generation_eos = list(generation_eos)


FAMILIES = {
    f.name: f
    for f in [
        Family("Qwen3-0.6B", QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
               added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
               turn_end="<|im_end|>"),
        Family("gemma-2-2b-it", GEMMA2, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
               {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
               add_bos="<bos>", turn_end="<end_of_turn>", generation_eos=["<eos>", "<end_of_turn>"]),
        Family("gemma-3-1b-it", GEMMA3,
               ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
               {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
               add_bos="<bos>", turn_end="<end_of_turn>", generation_eos=["<eos>", "<end_of_turn>"]),
        Family("Phi-3.5-mini-instruct", PHI35_MINI,
               ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"],
               {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
               turn_end="<|end|>", generation_eos=["<|end|>", "<|endoftext|>"]),
        Family("Phi-4-mini-instruct", PHI4_MINI,
               ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"],
               {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>"},
               turn_end="<|end|>", generation_eos=["<|end|>", "<|endoftext|>"]),
        Family("phi-4", PHI4, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sep|>"],
               {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>"},
               turn_end="<|im_end|>"),
        Family("OLMo-2-1124-7B-Instruct", OLMO2, ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
               {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
                "unk_token": "<|endoftext|>"},
               turn_end="<|endoftext|>"),
        Family("SmolLM3-3B", SMOLLM3, ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"],
               {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
               added=["<think>", "</think>"], turn_end="<|im_end|>", jinja_file=True),
    ]
}


def write_checkpoint(directory: Path, family: Family, add_bos: Optional[str] = None) -> Path:
    """A checkpoint folder with the family's tokenizer files: a byte-level BPE over the 256 byte symbols (no
    merges: every text is encodable, and the test is about the templates) plus the family's added tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = HFTokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(family.special)
    tokenizer.add_tokens(family.added)
    add_bos = add_bos or family.add_bos
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{add_bos} $A", pair=f"{add_bos} $A {add_bos} $B",
            special_tokens=[(add_bos, tokenizer.token_to_id(add_bos))],
        )
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: Dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              **family.config}
    if family.jinja_file:
        (directory / "chat_template.jinja").write_text(family.template, encoding="utf-8")
    else:
        config["chat_template"] = family.template
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if family.generation_eos:
        eos_ids = [tokenizer.token_to_id(t) for t in family.generation_eos]
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}), encoding="utf-8")
    # what generate/*.py check before they encode (`check_request`): a config and a weights file (never loaded here)
    Config(name=directory.name, block_size=4096, vocab_size=tokenizer.get_vocab_size(), n_layer=1, n_head=1,
           n_embd=8).save(directory)
    torch.save({}, directory / "lit_model.pth")
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_templates")
    return {name: write_checkpoint(root / name, family) for name, family in FAMILIES.items()}


@functools.lru_cache(maxsize=16)
def hf_tokenizer(checkpoint_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(checkpoint_dir)


def hf_ids(checkpoint_dir: Path, messages: List[Dict[str, Any]], **kwargs: Any) -> List[int]:
    out = hf_tokenizer(checkpoint_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           **kwargs)
    return list(out if isinstance(out, list) else out["input_ids"])


def hf_text(checkpoint_dir: Path, messages: List[Dict[str, Any]], **kwargs: Any) -> str:
    return hf_tokenizer(checkpoint_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                            **kwargs)


def encode_like_recipes(tokenizer: Tokenizer, text: str, style: PromptStyle) -> List[int]:
    # chat/base.py: `tokenizer.encode(style.apply(...), bos=style.bos)`: a template's text as the template wrote it
    return tokenizer.encode(text, bos=style.bos).tolist()


def as_messages(conversation: Sequence[Tuple[str, Any]]) -> List[Dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in conversation]


def assert_same(checkpoint_dir: Path, conversation: Sequence[Tuple[str, str]], **kwargs: Any) -> List[int]:
    """The recipes' path (`PromptStyle.from_checkpoint` -> `apply(prompt, history)` -> `encode`) against
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)`."""
    style = PromptStyle.from_checkpoint(checkpoint_dir)
    assert isinstance(style, ChatTemplate)
    *history, (role, prompt) = conversation
    assert role == "user"
    messages = as_messages(conversation)
    text = style.apply(prompt, history=history, **kwargs)
    assert text == hf_text(checkpoint_dir, messages, **kwargs)
    ids = encode_like_recipes(Tokenizer(checkpoint_dir), text, style)
    assert ids == hf_ids(checkpoint_dir, messages, **kwargs)
    if len(conversation) == 1 and not kwargs:  # one user message: what generate/*.py encode, through their own code
        request = check_request(GenerationArgs(prompt, checkpoint_dir, max_new_tokens=1, temperature=0.0, top_k=None))
        assert request.encoded.tolist() == ids
    return ids


CONVERSATIONS = [
    [("user", "What is 2+2?")],
    [("system", "You answer in one word."), ("user", "Name a color.")],
    [("user", "Hi 😀"), ("assistant", "Hello! How can I help?"), ("user", "  Tell me a joke.  ")],
    [("system", "Be terse."), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"), ("assistant", "6"),
     ("user", "and\n4+4?")],
]


@pytest.mark.parametrize("name", [n for n in FAMILIES if not n.startswith("gemma-2")])
def test_conversations_match_transformers(checkpoints, name):
    for conversation in CONVERSATIONS:
        assert_same(checkpoints[name], conversation)


# the EOS of each family's base checkpoint (a document's end)
BASE_EOS = {"Qwen3-0.6B": "<|endoftext|>", "gemma-2-2b-it": "<eos>", "gemma-3-1b-it": "<eos>",
            "Phi-3.5-mini-instruct": "<|endoftext|>", "Phi-4-mini-instruct": "<|endoftext|>", "phi-4": "<|endoftext|>",
            "SmolLM3-3B": "<|end_of_text|>"}


def test_chat_models_known_by_their_files_not_their_names(checkpoints, tmp_path):
    """Every family's instruct checkpoint is a chat model under any folder name (Qwen3, SmolLM3 and phi-4 name theirs
    without "Instruct"); the same files with a base model's EOS (a document end, not the template's turn end) and
    no generation_config.json are not, whatever their name says."""
    import shutil

    for i, name in enumerate(FAMILIES):
        renamed = Path(shutil.copytree(checkpoints[name], tmp_path / f"run-{i}" / "final"))
        assert is_chat_model(checkpoints[name]) and is_chat_model(renamed), name
        assert isinstance(PromptStyle.from_checkpoint(renamed), ChatTemplate), name
        base_eos = BASE_EOS.get(name)
        if base_eos is None:  # OLMo 2 ends turns with its EOS itself: its base model would be taken for chat
            continue
        base = Path(shutil.copytree(checkpoints[name], tmp_path / f"{name}-Instruct-chat"))
        config = json.loads((base / "tokenizer_config.json").read_text())
        (base / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": base_eos}))
        (base / "generation_config.json").unlink(missing_ok=True)
        assert not is_chat_model(base), (name, base_eos)


def test_stop_tokens_include_the_turn_end(checkpoints):
    for name, family in FAMILIES.items():
        tokenizer = Tokenizer(checkpoints[name])
        stop = PromptStyle.from_checkpoint(checkpoints[name]).stop_tokens(tokenizer)
        assert [tokenizer.token_to_id(family.turn_end)] in stop, name


def test_gemma2(checkpoints):
    d = checkpoints["gemma-2-2b-it"]
    for conversation in CONVERSATIONS:
        if conversation[0][0] != "system":
            ids = assert_same(d, conversation)
            assert ids.count(Tokenizer(d).bos_id) == 1  # the template's <bos>, not doubled by the post-processor
    # Gemma 2 has no system role: both refuse it
    style = PromptStyle.from_checkpoint(d)
    with pytest.raises(LitError, match="System role not supported"):
        style.apply("hi", system="Be brief.")
    with pytest.raises(Exception, match="System role not supported"):
        hf_ids(d, as_messages([("system", "Be brief."), ("user", "hi")]))


def test_gemma3_content_parts(checkpoints):
    # Gemma 3's template also takes `content` as a list of typed parts (text only here)
    d = checkpoints["gemma-3-1b-it"]
    style = ChatTemplate.from_checkpoint(d)
    tokenizer = Tokenizer(d)
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "text", "text": "there\n"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "And now a string."},
    ]
    text = style.render(messages)
    assert text == hf_text(d, messages)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nHithere<end_of_turn>\n")
    assert encode_like_recipes(tokenizer, text, style) == hf_ids(d, messages)


QWEN3_THINKING_HISTORY = [
    ("system", "You are a careful assistant."),
    ("user", "What is 2+2?"),
    ("assistant", "<think>\nTwo plus two.\n</think>\n\n4"),
    ("user", "And 3+3?"),
]


def test_qwen3_enable_thinking(checkpoints):
    d = checkpoints["Qwen3-0.6B"]
    for conversation in CONVERSATIONS + [QWEN3_THINKING_HISTORY]:
        default = assert_same(d, conversation)
        assert assert_same(d, conversation, enable_thinking=True) == default
        assert_same(d, conversation, enable_thinking=False)
    style = PromptStyle.from_checkpoint(d)
    # the earlier turn's reasoning is stripped from the history; enable_thinking=False pre-fills an empty block
    text = style.apply("And 3+3?", history=QWEN3_THINKING_HISTORY[:-1], enable_thinking=False)
    assert "Two plus two" not in text
    assert text.endswith("<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert style.apply("hi").endswith("<|im_start|>assistant\n")
    # a default for every rendering (what a recipe option would set); a call's own value wins
    quiet = ChatTemplate.from_checkpoint(d, template_kwargs={"enable_thinking": False})
    assert quiet.apply("hi") == style.apply("hi", enable_thinking=False) != style.apply("hi")
    assert quiet.apply("hi", enable_thinking=True) == style.apply("hi")
    # reasoning given as its own field, and a None field dropped as transformers does
    messages = as_messages(QWEN3_THINKING_HISTORY)
    messages[2] = {"role": "assistant", "content": "4", "reasoning_content": None}
    assert style.render(messages) == hf_text(d, messages)
    messages[2] = {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."}
    assert style.render(messages) == hf_text(d, messages)
    # a reasoning turn after the last user message keeps its <think> block
    messages = as_messages(QWEN3_THINKING_HISTORY[:3])
    assert style.render(messages, add_generation_prompt=False) == hf_tokenizer(d).apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False)
    assert "<think>\nTwo plus two.\n</think>" in style.render(messages, add_generation_prompt=False)


def test_smollm3_reasoning_flags(checkpoints):
    d = checkpoints["SmolLM3-3B"]
    assert "chat_template" not in json.loads((d / "tokenizer_config.json").read_text())  # chat_template.jinja only
    style = PromptStyle.from_checkpoint(d)
    conversations = [
        [("system", "Be brief. /no_think"), ("user", "hi")],
        [("system", "/think Be brief."), ("user", "hi"), ("assistant", "hello"), ("user", "bye")],
        [("system", "You are a pirate. /system_override"), ("user", "hi")],
        [("user", "hi"), ("assistant", "\nhello"), ("user", "bye")],
    ]
    for conversation in CONVERSATIONS + conversations:
        for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            assert_same(d, conversation, **kwargs)
    assert "Reasoning Mode: /think" in style.apply("hi")
    assert "Reasoning Mode: /no_think" in style.apply("hi", enable_thinking=False)
    assert style.apply("hi", enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    assert "Reasoning Mode: /no_think" in style.apply("hi", system="/no_think")


def test_olmo2_bos_either_way(checkpoints, tmp_path):
    # OLMo 2's template writes its <|endoftext|> BOS itself; a post-processor that adds it too does not double it
    conversation = CONVERSATIONS[3]
    ids = assert_same(checkpoints["OLMo-2-1124-7B-Instruct"], conversation)
    d = write_checkpoint(tmp_path / "OLMo-2-1124-7B-Instruct", FAMILIES["OLMo-2-1124-7B-Instruct"],
                         add_bos="<|endoftext|>")
    assert Tokenizer(d).use_bos
    assert assert_same(d, conversation) == ids


def test_template_without_bos_and_a_bos_adding_post_processor(tmp_path):
    # Phi-3.5-mini's template writes no <s>: with a post-processor that adds <s> (Llama-style tokenizer.json)
    d = write_checkpoint(tmp_path / "Phi-3.5-mini-instruct", FAMILIES["Phi-3.5-mini-instruct"], add_bos="<s>")
    assert Tokenizer(d).use_bos
    assert_same(d, CONVERSATIONS[1])
