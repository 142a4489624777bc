"""Chat with a model in the terminal, with its chat template and the conversation so far.

    python chat/base.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct

The reply is printed as it is decoded (complete characters only). A reply ends at the model's end-of-turn /
EOS token(s) or after --max_new_tokens. Every turn re-renders the whole conversation with the prompt style (the
checkpoint's chat template by default); when it no longer fits the context, the oldest exchanges are dropped.
Commands: /exit (or Ctrl-D) quits, /reset starts a new conversation; Ctrl-C stops a reply early.
"""

import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, List, Optional, TextIO, Tuple, Union

import lightning as L
import torch

from lit_gpt.config import load_config
from lit_gpt.generate import (
    check_sampling_args,
    compile_steps,
    decode_one_token,
    generate_stream,
    generation_fabric,
    load_model,
    resolve_compile,
    prepare_for_generation,
)
from lit_gpt.prompts import PromptStyle
from lit_gpt.quantize import check_quantize, loader
from lit_gpt.runtime import param_dtype, resolve_accelerator
from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

History = List[Tuple[str, str]]


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    max_new_tokens: int = 512,
    temperature: float = 0.7,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    prompt_style: Optional[str] = None,
    system_prompt: Optional[str] = None,
    precision: Optional[str] = None,
    seed: int = 1234,
    compile: Union[bool, str] = "auto",
    accelerator: str = "auto",
    quantize: Optional[str] = None,
) -> None:
    """Chat with a model interactively.

    Args:
        checkpoint_dir: The model (a converted lit checkpoint directory).
        max_new_tokens: The most tokens of one reply.
        temperature: Sampling temperature; 0 is greedy decoding.
        top_k: Sample among the k most likely tokens only (null: all).
        top_p: Nucleus sampling: among the most likely tokens whose probabilities add up to top_p (1.0: all).
        prompt_style: "chat" (the checkpoint's template), "alpaca" or "raw"; default: chat for instruct checkpoints
            with a template, else raw.
        system_prompt: A system message at the start of the conversation (templates that support one).
        precision: "32-true", "bf16-true", "16-true" (default: bf16-true on GPUs that support it, else 32-true).
        seed: Seeds the sampling.
        compile: "auto" (default: the decode step compiled when a reply of max_new_tokens pays for it, with CUDA
            graphs on a GPU; eager on the CPU), "none", or a torch.compile mode: "default", "reduce-overhead"
            (CUDA graphs, GPUs only), "max-autotune".
        accelerator: "cpu", "cuda" or "auto".
        quantize: Weight-only quantization of the block linear layers (see lit_gpt/quantize.py): "torchao.int8wo",
            "torchao.int4wo", or on CUDA "bnb.int8", "bnb.nf4" (needs bitsandbytes). Default: none.
    """
    check_sampling_args(temperature, top_k, top_p)
    mode = resolve_compile(compile, resolve_accelerator(accelerator), max_new_tokens)  # checked before loading
    if max_new_tokens < 1:
        raise LitError(f"--max_new_tokens must be >= 1 (got {max_new_tokens})")
    fabric = generation_fabric(accelerator, precision)
    dtype = param_dtype(fabric.strategy.precision.precision)
    check_quantize(quantize, fabric.device, dtype)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_checkpoint(checkpoint_dir, prompt_style)
    block_size = load_config(checkpoint_dir).block_size
    if max_new_tokens >= block_size:
        raise LitError(f"--max_new_tokens {max_new_tokens} leaves no room for a prompt in the context ({block_size})")

    t0 = time.perf_counter()
    model = loader(partial(load_model, checkpoint_dir), quantize, fabric.device, dtype)()
    prepare_for_generation(model, fabric.device.type, fabric.strategy.precision.precision, mode)  # dtype, CPU layout
    model = fabric.setup_module(model)
    print(f"Loaded {checkpoint_dir} in {time.perf_counter() - t0:.2f} s ({style.name} prompt style)", file=sys.stderr)
    fabric.seed_everything(seed)
    if hasattr(sys.stdin, "reconfigure"):
        # bytes that are not UTF-8 reach `main` as lone surrogates (reported there) instead of raising inside
        # input(), which would end the session and lose the conversation
        sys.stdin.reconfigure(errors="surrogateescape")
    # the decode step compiled once for its fixed shapes (a CUDA graph replayed per token on a GPU), or eager
    decode_fn = compile_steps(mode, compile_prefill=False).decode
    main(fabric, model, tokenizer, style, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
         top_p=top_p, system_prompt=system_prompt, decode_fn=decode_fn)


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
