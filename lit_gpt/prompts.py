"""Prompt styles: how a user's message (and the conversation so far) becomes the text the model sees.

- `chat`: the checkpoint's own chat template (`chat_template` in tokenizer_config.json or chat_template.jinja),
  rendered like transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`.
- `alpaca`: the Stanford Alpaca instruction format (what the Alpaca finetuning data uses).
- `raw`: the text as is, for base models that simply continue it.

`PromptStyle.from_checkpoint(checkpoint_dir)` picks `chat` for checkpoints tuned to follow their template and `raw`
otherwise, judged from the checkpoint's files only, never from its folder's name (`is_chat_model`);
`PromptStyle.from_checkpoint(checkpoint_dir, "alpaca")` (the recipes' `--prompt_style`) overrides the choice.
`describe_style` is the one stderr line the recipes print about the style they use.
"""

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

from lit_gpt.tokenizer import Tokenizer, special_tokens_map
from lit_gpt.utils import LitError

History = Sequence[Tuple[str, str]]  # (role, content) pairs; role is "system", "user" or "assistant"

# Strings that end an assistant turn in common chat templates. When the template writes one that is a single
# token, generation stops on it too: a base model's EOS (e.g. SmolLM2's <|endoftext|>) is not its turn end.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>", "<|eot|>")
# A text no template writes: where it ends in a rendered assistant turn, the turn's end marker begins.
_PROBE = "PROBE-REPLY-7f3a"


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
        """`name` if given, else the chat template for checkpoints tuned to it (`is_chat_model`), else raw."""
        if name:
            return cls.from_name(name, checkpoint_dir)
        if is_chat_model(checkpoint_dir):
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
    """Whether the checkpoint is tuned to follow its chat template, judged from its files alone (a folder may have
    any name): it has a template, and the template ends an assistant turn with a token the model stops on (its EOS
    or generation_config.json's `eos_token_id`). Instruct models are trained to end their replies so (SmolLM2 and
    Qwen2.5 Instruct stop on <|im_end|>, Llama 3 Instruct on <|eot_id|>, Gemma "-it" on <end_of_turn>); the base
    checkpoints that ship the same template end documents, not turns (<|endoftext|>, <|end_of_text|>, <eos>)."""
    return _turn_end(checkpoint_dir) is not None


def _turn_end(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """The stop token that the checkpoint's chat template writes after an assistant's reply, if any."""
    template = load_chat_template(checkpoint_dir)
    if template is None:
        return None
    try:
        style = ChatTemplate(template, special_tokens_map(checkpoint_dir))
        text = style.render([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _PROBE}],
                            add_generation_prompt=False)
        tokenizer = Tokenizer(checkpoint_dir)
    except (LitError, TypeError, ValueError):  # a template that refuses the probe conversation, or no tokenizer
        return None
    if _PROBE not in text:
        return None
    after = text[text.index(_PROBE) + len(_PROBE):].lstrip()
    stops = [tokenizer.id_to_token(i) for i in tokenizer.stop_ids]
    return next((s for s in stops if s and after.startswith(s)), None)


def describe_style(style: PromptStyle, checkpoint_dir: Union[str, Path], chosen: Optional[str],
                   label: str = "Prompt style") -> str:
    """The one line the generate/chat/serve recipes print (stderr) about the prompt style they use, and why."""
    if chosen:
        return f"{label}: {style.name} (--prompt_style {chosen})"
    if isinstance(style, ChatTemplate):
        return (f"{label}: chat (the checkpoint's chat template ends replies with {_turn_end(checkpoint_dir)}, a"
                " token the model stops on; --prompt_style raw to continue text instead)")
    if load_chat_template(checkpoint_dir) is not None:
        return (f"{label}: raw (the checkpoint has a chat template, but its EOS / generation_config.json"
                " eos_token_id do not end the template's turns: a base model; --prompt_style chat to use it)")
    return f"{label}: raw (the checkpoint has no chat template; --prompt_style alpaca or chat to choose one)"


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
