"""Chat with a model in the terminal, with its chat template and the conversation so far.

    python chat/base.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

The reply is printed as it is decoded (complete characters only). A reply ends at the model's end-of-turn /
EOS token(s) or after --max_new_tokens. Every turn re-renders the whole conversation with the prompt style (the
checkpoint's chat template by default); when it no longer fits the context, the oldest exchanges are dropped.
Commands: /exit (or Ctrl-D) quits, /reset starts a new conversation; Ctrl-C stops a reply early.
"""

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple, Union

import lightning as L
import torch

from lit_gpt.compile_policy import resolve_compile
from lit_gpt.config import load_config
from lit_gpt.generate import compile_steps, decode_one_token, generate_stream
from lit_gpt.loading import load_model, scale_rope
from lit_gpt.prompts import PromptStyle, describe_style
from lit_gpt.recipes.flags import ROPE_SCALING
from lit_gpt.recipes.generate import (
    FLAG_HELP, flag_help, generation_fabric, loading, prepare_for_device, quantize_weights,
)
from lit_gpt.runtime import resolve_accelerator
from lit_gpt.sampling import check_sampling_args
from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

History = List[Tuple[str, str]]


@flag_help(
    FLAG_HELP,
    checkpoint_dir="The model: a converted checkpoint folder (lit_model.safetensors, lit_config.json, tokenizer"
    " files).",
    max_new_tokens="The most tokens of one reply; a reply also ends at the model's end-of-turn token.",
    system_prompt="A system message at the start of the conversation (templates that support one).",
    compile='"auto" (default: the decode step compiled when a reply of max_new_tokens pays for it, with CUDA graphs'
    ' on a GPU; eager on the CPU), "none", or a torch.compile mode: "default", "reduce-overhead" (CUDA graphs, GPUs'
    ' only), "max-autotune".',
    rope_scaling=ROPE_SCALING.doc,
)
def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    max_new_tokens: int = 512,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    precision: Optional[str] = None,
    prompt_style: Optional[str] = None,
    system_prompt: Optional[str] = None,
    seed: int = 1234,
    compile: Union[bool, str] = "auto",
    accelerator: str = "auto",
    quantize: Optional[str] = None,
    rope_scaling: Optional[Dict[str, Any]] = None,
) -> None:
    """Chat with a model interactively."""
    check_sampling_args(temperature, top_k, top_p)
    mode = resolve_compile(compile, resolve_accelerator(accelerator), max_new_tokens)  # checked before loading
    if max_new_tokens < 1:
        raise LitError(f"--max_new_tokens must be >= 1 (got {max_new_tokens})")
    if system_prompt is not None and not _is_utf8(system_prompt):  # bytes that are not UTF-8: lone surrogates
        bad = system_prompt.encode("utf-8", errors="surrogateescape")
        raise LitError(f"--system_prompt is not valid UTF-8 text ({_first_bad_byte(bad)}): pass it in UTF-8, e.g."
                       " convert it with iconv -t UTF-8")
    fabric = generation_fabric(accelerator, precision, quantize)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_checkpoint(checkpoint_dir, prompt_style)
    block_size = load_config(checkpoint_dir, rope_scaling=rope_scaling).block_size  # --rope_scaling: longer
    if max_new_tokens >= block_size:
        raise LitError(f"--max_new_tokens {max_new_tokens} leaves no room for a prompt in the context ({block_size})")
    # the decode step compiled once for its fixed shapes (a CUDA graph replayed per token on a GPU), or eager
    steps = compile_steps(mode, compile_prefill=False)

    with loading(fabric, f"{checkpoint_dir} ({style.name} prompt style)"):
        model = quantize_weights(fabric, scale_rope(load_model(checkpoint_dir, quantize), rope_scaling), quantize)
        model = prepare_for_device(fabric, model, steps)  # precision dtype, CPU layout, Fabric
    fabric.print(describe_style(style, checkpoint_dir, prompt_style), file=sys.stderr)  # which style, and why
    fabric.seed_everything(seed)
    if hasattr(sys.stdin, "reconfigure"):
        # bytes that are not UTF-8 reach `main` as lone surrogates (reported there) instead of raising inside
        # input(), which would end the session and lose the conversation
        sys.stdin.reconfigure(errors="surrogateescape")
    main(fabric, model, tokenizer, style, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
         top_p=top_p, system_prompt=system_prompt, decode_fn=steps.decode)


def main(
    fabric: L.Fabric,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    style: PromptStyle,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    system_prompt: Optional[str] = None,
    decode_fn: Callable = decode_one_token,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
) -> History:
    """The conversation loop: read a message, stream the reply, remember both. Returns the history."""
    stop_ids = [ids[0] for ids in style.stop_tokens(tokenizer) if len(ids) == 1]
    block_size = model.config.block_size
    history: History = []
    out.write("Chat with the model. /exit (or Ctrl-D) quits, /reset forgets the conversation, Ctrl-C stops a reply.\n")
    while True:
        try:
            message = read(">> You: ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        except UnicodeDecodeError as e:  # a reader whose stream could not be reconfigured
            out.write(f"(that line is not valid UTF-8 text ({e.reason}): it was ignored, type it again)\n")
            continue
        if not _is_utf8(message):
            bad = message.encode("utf-8", errors="surrogateescape")
            out.write(f"(that line is not valid UTF-8 text ({_first_bad_byte(bad)}): it was ignored, type it again;"
                      " is the terminal's encoding UTF-8?)\n")
            continue
        command = message.strip()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            history = []
            out.write("(conversation reset)\n")
            continue
        if not command:
            continue

        prompt, history = fit_prompt(style, tokenizer, message, history, system_prompt, block_size - max_new_tokens)
        if prompt is None:
            out.write(f"(this message alone does not fit the context of {block_size} tokens with room for"
                      f" {max_new_tokens} new ones: shorten it or lower --max_new_tokens)\n")
            continue
        encoded = prompt.to(fabric.device)
        out.write(">> Model: ")
        out.flush()
        reply = stream_reply(model, tokenizer, encoded, out, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, stop_ids=stop_ids, decode_fn=decode_fn)
        out.write("\n")
        out.flush()
        history += [("user", message), ("assistant", reply)]
    return history


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_bad_byte(raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte 0x{raw[e.start]:02x} at position {e.start}"
    return "a lone surrogate"


def fit_prompt(
    style: PromptStyle, tokenizer: Tokenizer, message: str, history: History, system_prompt: Optional[str],
    budget: int,
) -> Tuple[Optional[torch.Tensor], History]:
    """The encoded conversation plus `message`, dropping the oldest exchanges until it has at most `budget`
    tokens. Returns (None, history) when even the message alone is too long."""
    while True:
        ids = tokenizer.encode(style.apply(message, history=history, system=system_prompt), bos=style.bos)
        if ids.numel() <= budget:
            return ids, history
        if not history:
            return None, history
        history = history[2:]  # the oldest user/assistant exchange


def stream_reply(
    model: torch.nn.Module, tokenizer: Tokenizer, prompt: torch.Tensor, out: TextIO, *, max_new_tokens: int,
    temperature: float, top_k: Optional[int], top_p: float, stop_ids: List[int], decode_fn: Callable,
) -> str:
    """Generate a reply, writing its text to `out` as tokens arrive; return the whole reply text."""
    decoder = tokenizer.stream_decoder(skip_special_tokens=True)
    pieces = []
    # one token per chunk: on the CPU reading the stop flag every step costs nothing, and the text appears at once
    stream = generate_stream(model, prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             stop_ids=stop_ids, chunk_size=1, decode_fn=decode_fn)
    try:
        for tokens in stream:
            text = decoder.step(tokens)
            if text:
                pieces.append(text)
                out.write(text)
                out.flush()
    except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
        stream.close()
    text = decoder.flush()
    if text:
        pieces.append(text)
        out.write(text)
    return "".join(pieces)


if __name__ == "__main__":
    run_cli(setup)
