"""chat/base.py: streaming replies, multi-turn history through the chat template, stop tokens, /exit, /reset."""

import importlib.util
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_chat():
    spec = importlib.util.spec_from_file_location("recipe_chat_base", ROOT / "chat" / "base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorder(io.StringIO):
    """Counts writes, so a test can tell a streamed reply (many writes) from one printed at the end."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def scripted(messages):
    it = iter(messages)

    def read(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from lit_gpt.cpu_layout import prepare_for_generation
    from lit_gpt.loading import load_model
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.recipes.generate import generation_fabric
    from lit_gpt.tokenizer import Tokenizer

    fabric = generation_fabric("cpu", "32-true")
    model = load_model(smollm2_dir)
    prepare_for_generation(model, "cpu", "32-true", None)  # as chat/base.py prepares it for its eager loop on the CPU
    return fabric, fabric.setup_module(model), Tokenizer(smollm2_dir), PromptStyle.from_checkpoint(smollm2_dir)


def test_real_model_streams_answer_stops_at_end_of_turn_and_keeps_history(smollm2, monkeypatch):
    chat = load_chat()
    fabric, model, tokenizer, style = smollm2
    assert style.name == "chat"
    prompts = []
    original = chat.fit_prompt

    def spy(*args, **kwargs):
        ids, history = original(*args, **kwargs)
        prompts.append(tokenizer.decode(ids))
        return ids, history

    monkeypatch.setattr(chat, "fit_prompt", spy)
    out = Recorder()
    history = chat.main(fabric, model, tokenizer, style, max_new_tokens=40, temperature=0.0, top_k=None, top_p=1.0,
                        read=scripted(["What is the capital of France?", "And of Germany?", "/exit", "never read"]),
                        out=out)
    assert [role for role, _ in history] == ["user", "assistant", "user", "assistant"]
    first = history[1][1]
    assert "Paris" in first
    # the reply ended at the end-of-turn token, long before max_new_tokens, and holds no special token
    assert len(tokenizer.encode(first)) < 40 and "<|im_end|>" not in first
    # streamed: the first reply reached the output in several pieces
    start = out.writes.index(">> Model: ")
    end = out.writes.index("\n", start)
    assert end - start - 1 >= 3 and "".join(out.writes[start + 1 : end]) == first
    # the second turn saw the first exchange through the chat template
    assert "What is the capital of France?" in prompts[1] and first in prompts[1]
    assert prompts[1].count("<|im_start|>user") == 2


def test_reset_exit_and_eof(tiny_dir):
    from lit_gpt.loading import load_model
    from lit_gpt.recipes.generate import generation_fabric
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    chat = load_chat()
    fabric = generation_fabric("cpu", "32-true")
    model = fabric.setup_module(load_model(tiny_dir))
    tokenizer, style = Tokenizer(tiny_dir), PromptStyle.from_name("alpaca")
    kwargs = dict(max_new_tokens=3, temperature=0.0, top_k=None, top_p=1.0)
    out = io.StringIO()
    history = chat.main(fabric, model, tokenizer, style, read=scripted(["hi", "", "/reset", "again"]), out=out, **kwargs)
    # "" is ignored, /reset forgot the first exchange, EOF ended the loop
    assert [c for r, c in history if r == "user"] == ["again"]
    assert "(conversation reset)" in out.getvalue()
    history = chat.main(fabric, model, tokenizer, style, read=scripted(["/exit", "hi"]), out=io.StringIO(), **kwargs)
    assert history == []


def test_old_turns_are_dropped_when_the_context_is_full(tiny_dir):
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    chat = load_chat()
    tokenizer, style = Tokenizer(tiny_dir), PromptStyle.from_name("alpaca")
    history = [("user", "one " * 30), ("assistant", "two " * 30), ("user", "three"), ("assistant", "four")]
    full, kept = chat.fit_prompt(style, tokenizer, "five", history, None, budget=10_000)
    assert kept == history
    ids, kept = chat.fit_prompt(style, tokenizer, "five", history, None, budget=full.numel() - 10)
    assert kept == history[2:] and ids.numel() <= full.numel() - 10
    ids, kept = chat.fit_prompt(style, tokenizer, "five " * 200, history, None, budget=50)
    assert ids is None and kept == []


def test_a_line_that_is_not_utf8_is_reported_and_the_conversation_goes_on(tiny_dir):
    """Through real stdin bytes: the bad line gets one clear line, the session and its history survive."""
    import subprocess
    import sys

    stdin = b"first message\n\xff\xfe not utf-8 \xc3\n/exit\n"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "chat" / "base.py"), "--checkpoint_dir", str(tiny_dir), "--max_new_tokens", "2",
         "--temperature", "0", "--prompt_style", "alpaca", "--accelerator", "cpu", "--precision", "32-true"],
        input=stdin, capture_output=True, timeout=120, cwd=ROOT,
    )
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Traceback" not in out
    notes = [line for line in out.splitlines() if "not valid UTF-8" in line]
    assert len(notes) == 1 and "byte 0xff at position 0" in notes[0] and "type it again" in notes[0], out
    assert out.count(">> Model: ") == 1  # the good message was answered, the bad one was not sent


def test_a_bad_line_keeps_the_history(tiny_dir):
    from lit_gpt.loading import load_model
    from lit_gpt.recipes.generate import generation_fabric
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    chat = load_chat()
    fabric = generation_fabric("cpu", "32-true")
    model = fabric.setup_module(load_model(tiny_dir))
    tokenizer, style = Tokenizer(tiny_dir), PromptStyle.from_name("alpaca")
    kwargs = dict(max_new_tokens=2, temperature=0.0, top_k=None, top_p=1.0)
    bad = b"caf\xe9".decode("utf-8", errors="surrogateescape")  # what a Latin-1 terminal sends for "café"
    out = io.StringIO()
    history = chat.main(fabric, model, tokenizer, style, read=scripted(["one", bad, "two"]), out=out, **kwargs)
    assert [c for r, c in history if r == "user"] == ["one", "two"]
    assert "not valid UTF-8 text (byte 0xe9 at position 3)" in out.getvalue()
