"""Prompt styles: how a user's message (and the conversation so far) becomes the text the model sees.

- `chat`: the checkpoint's own chat template (`chat_template` in tokenizer_config.json or chat_template.jinja),
  rendered like transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`.
- `alpaca`: the Stanford Alpaca instruction format (what the Alpaca finetuning data uses).
- `raw`: the text as is, for base models that simply continue it.

`PromptStyle.from_checkpoint(checkpoint_dir)` picks `chat` for instruct/chat checkpoints that ship a template
and `raw` otherwise; `PromptStyle.from_checkpoint(checkpoint_dir, "alpaca")` (the recipes' `--prompt_style`)
overrides the choice.
"""

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

from lit_gpt.tokenizer import Tokenizer, special_tokens_map
from lit_gpt.utils import LitError

History = Sequence[Tuple[str, str]]  # (role, content) pairs; role is "system", "user" or "assistant"

# Strings that end an assistant turn in common chat templates. When the template writes one that is a single
# token, generation stops on it too: a base model's EOS (e.g. SmolLM2's <|endoftext|>) is not its turn end.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>", "<|eot|>")
# Checkpoint names that mark a model tuned to follow a chat template.
_CHAT_MODEL_RE = re.compile(r"instruct|chat|(^|[-_.])it($|[-_.])|sft|dpo|orpo|rlhf", re.IGNORECASE)
# Families whose plain names are the chat models (Qwen3-0.6B, SmolLM3-3B, phi-4): their base checkpoints are the
# ones that say so (Qwen3-0.6B-Base, SmolLM3-3B-Base).
_CHAT_FAMILY_RE = re.compile(r"^(qwen3|smollm3|phi-4)($|[-_.])", re.IGNORECASE)
_BASE_MODEL_RE = re.compile(r"(^|[-_.])base($|[-_.])", re.IGNORECASE)


class PromptStyle:
    """Base class. `apply` returns the prompt text; `stop_tokens` the id sequences that end a reply."""

    name: str = ""
    # `Tokenizer.encode(text, bos=style.bos)`: None follows the checkpoint's tokenizer settings
    bos: Optional[bool] = None

    def apply(self, prompt: str, history: Optional[History] = None, **kwargs: Any) -> str:
        raise NotImplementedError

    def stop_tokens(self, tokenizer: Tokenizer) -> Tuple[List[int], ...]:
        return tuple([i] for i in ([tokenizer.eos_id] if tokenizer.eos_id is not None else []))

    @classmethod
    def names(cls) -> List[str]:
        return sorted(_STYLES)

    @classmethod
    def from_name(cls, name: str, checkpoint_dir: Optional[Union[str, Path]] = None) -> "PromptStyle":
        if name == "chat":
            if checkpoint_dir is None:
                raise LitError("the 'chat' prompt style needs a checkpoint directory (its chat template)")
            return ChatTemplate.from_checkpoint(checkpoint_dir)
        style = _STYLES.get(name)
        if style is None:
            raise LitError(f"unknown prompt style {name!r}; choose one of: {', '.join(cls.names())}")
        return style()

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Union[str, Path], name: Optional[str] = None) -> "PromptStyle":
        """`name` if given, else the chat template for instruct/chat checkpoints that have one, else raw."""
        if name:
            return cls.from_name(name, checkpoint_dir)
        if load_chat_template(checkpoint_dir) is not None and is_chat_model(checkpoint_dir):
            return ChatTemplate.from_checkpoint(checkpoint_dir)
        return Raw()


class Raw(PromptStyle):
    """No formatting. With a history, the conversation is one continuous text (what a base model continues)."""

    name = "raw"

    def apply(self, prompt: str, history: Optional[History] = None, **kwargs: Any) -> str:
        return "".join(content for _, content in history or ()) + prompt


class Alpaca(PromptStyle):
    """The Stanford Alpaca format. `input` adds the optional context block; earlier turns of a conversation
    become earlier instruction/response pairs."""

    name = "alpaca"
    header = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    )
    header_with_input = (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
    )

    def apply(self, prompt: str, history: Optional[History] = None, input: str = "", **kwargs: Any) -> str:
        turns = []
        for role, content in history or ():
            if role == "user":
                turns.append(f"### Instruction:\n{content}\n\n")
            elif role == "assistant":
                turns.append(f"### Response:\n{content}\n\n")
        context = f"### Input:\n{input}\n\n" if input else ""
        header = self.header_with_input if input else self.header
        return f"{header}{''.join(turns)}### Instruction:\n{prompt}\n\n{context}### Response:\n"


class ChatTemplate(PromptStyle):
    """A Jinja chat template rendered the way transformers does (sandboxed environment, `trim_blocks`,
    `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text),
    with the tokenizer's named special tokens (bos_token, eos_token, ...) as variables."""

    name = "chat"
    # the template writes the BOS itself where the model wants one (Llama 3, Gemma): encoded as transformers'
    # `apply_chat_template` encodes it, without the tokenizer's own special tokens (no second or unwanted BOS)
    bos = False

    def __init__(self, template: str, special_tokens: Optional[Dict[str, str]] = None,
                 system_prompt: Optional[str] = None, template_kwargs: Optional[Mapping[str, Any]] = None) -> None:
        self.template_source = template
        self.special_tokens = dict(special_tokens or {})
        self.system_prompt = system_prompt
        # Extra template variables for every rendering, e.g. {"enable_thinking": False} for Qwen3 / SmolLM3: what
        # transformers users pass as `apply_chat_template(..., enable_thinking=False)`.
        self.template_kwargs = dict(template_kwargs or {})
        self._template = _compile(template)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Union[str, Path], system_prompt: Optional[str] = None,
                        template_kwargs: Optional[Mapping[str, Any]] = None) -> "ChatTemplate":
        template = load_chat_template(checkpoint_dir)
        if template is None:
            raise LitError(
                f"{str(checkpoint_dir)!r} has no chat template (tokenizer_config.json 'chat_template' or"
                " chat_template.jinja); use --prompt_style alpaca or --prompt_style raw"
            )
        return cls(template, special_tokens_map(checkpoint_dir), system_prompt, template_kwargs)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The template applied to a list of {"role", "content"} messages. `kwargs` are extra template variables
        (over `template_kwargs`), like the keyword arguments of transformers' `apply_chat_template`."""
        import jinja2

        variables = {**self.special_tokens, **self.template_kwargs, **kwargs}
        try:
            return self._template.render(
                # transformers drops the keys whose value is None (OpenAI-style `content=None`, `tool_calls=None`):
                # templates test `is defined`, and a None would render as "None".
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=variables.pop("tools", None),
                documents=variables.pop("documents", None),
                **variables,
            )
        except jinja2.TemplateError as e:
            raise LitError(f"the chat template rejected the conversation: {e}") from e

    def messages(self, prompt: str, history: Optional[History] = None, system: Optional[str] = None) -> List[Dict[str, str]]:
        messages = [{"role": role, "content": content} for role, content in history or ()]
        system = system if system is not None else self.system_prompt
        if system is not None and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        messages.append({"role": "user", "content": prompt})
        return messages

    def apply(self, prompt: str, history: Optional[History] = None, system: Optional[str] = None, **kwargs: Any) -> str:
        """The conversation plus `prompt`, ready for the reply; `kwargs` are template variables (see `render`)."""
        return self.render(self.messages(prompt, history, system), add_generation_prompt=True, **kwargs)

    def stop_tokens(self, tokenizer: Tokenizer) -> Tuple[List[int], ...]:
        stop = list(tokenizer.stop_ids)
        for token in _END_OF_TURN:
            token_id = tokenizer.token_to_id(token) if token in self.template_source else None
            if token_id is not None and token_id not in stop:
                stop.append(token_id)
        return tuple([i] for i in stop)


_STYLES: Dict[str, Type[PromptStyle]] = {"raw": Raw, "alpaca": Alpaca, "chat": ChatTemplate}


def load_chat_template(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's `chat_template` (a
    string, or a list of named templates of which "default" is used), else chat_template.json."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / "chat_template.jinja").is_file():
        return (checkpoint_dir / "chat_template.jinja").read_text(encoding="utf-8")
    for filename in ("tokenizer_config.json", "chat_template.json"):
        path = checkpoint_dir / filename
        if not path.is_file():
            continue
        try:
            template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError) as e:
            raise LitError(f"{str(path)!r} is not a valid JSON object ({e})") from e
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template
    return None


def is_chat_model(checkpoint_dir: Union[str, Path]) -> bool:
    """Whether the checkpoint is an instruct/chat model, judged by its name (folder, lit_config, config.json)."""
    checkpoint_dir = Path(checkpoint_dir)
    names = [checkpoint_dir.name]
    for filename, key in (("lit_config.json", "name"), ("config.json", "_name_or_path")):
        path = checkpoint_dir / filename
        if path.is_file():
            try:
                value = json.loads(path.read_text(encoding="utf-8")).get(key)
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
                value = None
            if isinstance(value, str):
                names.append(Path(value).name)
    return any(
        _CHAT_MODEL_RE.search(name) or (_CHAT_FAMILY_RE.search(name) and not _BASE_MODEL_RE.search(name))
        for name in names
    )


def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in transformers;
        for rendering it is transparent, but templates that use it do not parse without the tag."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own `tojson` escapes HTML characters, which would change the prompt text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise LitError(f"the checkpoint's chat template is not valid Jinja: {e}") from e
