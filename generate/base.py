"""Generate text from a prompt with a converted checkpoint, on the CPU or a CUDA GPU (through Lightning Fabric).

    python generate/base.py --prompt "What food do llamas eat?"
    python generate/base.py --checkpoint_dir out/full/alpaca/final --prompt_style alpaca --prompt "..."
    python generate/base.py --prompt "The capital of France is" --prompt_style raw --temperature 0

The generated text goes to stdout (with `raw` prompts, the prompt and its continuation; with a chat or alpaca
template, the reply only); time, tokens/s and memory go to stderr. The XLA recipe is `xla/generate/base.py`.
"""

import resource
import sys
import time
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from lit_gpt.generate import (
    check_lengths,
    check_model_dir,
    check_sampling_args,
    decode_one_token,
    generate,
    load_config,
    load_model,
    use_column_major_weights,
)
from lit_gpt.prompts import PromptStyle, Raw
from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli


def setup(
    prompt: str = "What food do llamas eat?",
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    precision: Optional[str] = None,
    prompt_style: Optional[str] = None,
    seed: int = 1234,
    compile: bool = False,
    accelerator: str = "auto",
) -> None:
    """Generate `num_samples` continuations of a prompt.

    Args:
        prompt: The text to continue (or the question, with a chat template).
        checkpoint_dir: A converted checkpoint directory (lit_model.pth, lit_config.json, tokenizer files).
        num_samples: How many samples to draw, one after the other.
        max_new_tokens: The most tokens to generate per sample; generation also stops at the model's stop tokens.
        temperature: Sampling temperature; 0 is greedy decoding (top_k and top_p then do nothing).
        top_k: Sample among the k most likely tokens only (null: all).
        top_p: Nucleus sampling: among the most likely tokens whose probabilities add up to top_p (1.0: all).
        precision: "32-true", "bf16-true", "16-true" (default: bf16-true on GPUs that support it, else 32-true).
        prompt_style: "chat" (the checkpoint's chat template), "alpaca" or "raw"; default: chat for instruct
            checkpoints with a template, else raw.
        seed: Seeds the sampling.
        compile: `torch.compile` the decode step (worth it for long generations; the first steps compile).
        accelerator: "cpu", "cuda" or "auto".
    """
    if num_samples < 1:
        raise LitError(f"--num_samples must be >= 1 (got {num_samples})")
    if max_new_tokens <= 0:
        raise LitError(f"--max_new_tokens must be > 0 (got {max_new_tokens})")
    check_sampling_args(temperature, top_k, top_p)
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if precision is None:
        precision = "bf16-true" if accelerator == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    if precision not in ("32-true", "bf16-true", "16-true"):
        raise LitError(f"--precision must be 32-true, bf16-true or 16-true for generation (got {precision!r})")
    fabric = L.Fabric(devices=1, accelerator=accelerator, precision=precision)
    main(
        fabric, prompt, checkpoint_dir, num_samples, max_new_tokens, temperature, top_k, top_p, prompt_style, seed,
        compile,
    )


def main(
    fabric: L.Fabric,
    prompt: str,
    checkpoint_dir: Path,
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    prompt_style: Optional[str],
    seed: int,
    compile: bool,
) -> None:
    # everything that can fail on bad input is checked before the weights are read
    check_model_dir(checkpoint_dir)
    config = load_config(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_checkpoint(checkpoint_dir, prompt_style)
    encoded = tokenizer.encode(style.apply(prompt), device=fabric.device)
    check_lengths(encoded.numel(), max_new_tokens, config.block_size)
    # single-token stop sequences end generation on the device; the styles here have no longer ones
    stop_ids = [ids[0] for ids in style.stop_tokens(tokenizer) if len(ids) == 1]

    t0 = time.perf_counter()
    model = load_model(checkpoint_dir)
    if fabric.device.type == "cpu" and fabric.strategy.precision.precision == "32-true":
        use_column_major_weights(model)  # faster matrix-vector products on the CPU (see its docstring)
    model = fabric.setup_module(model)
    print(f"Loaded {checkpoint_dir} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)

    decode_fn = torch.compile(decode_one_token, dynamic=False) if compile else decode_one_token
    # the CPU reads the stop flag for free; on a GPU reading it every step would stall the queue of kernels
    chunk_size = 1 if fabric.device.type == "cpu" else 16
    fabric.seed_everything(seed)
    for i in range(num_samples):
        t0 = time.perf_counter()
        # inference mode: nothing here needs autograd afterwards, and each small op dispatches a little faster
        with torch.inference_mode():
            new = generate(
                model, encoded, max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids,
                chunk_size=chunk_size, decode_fn=decode_fn,
            )
            new_ids = new.tolist()  # a host read: the timing includes all of the device's work
        t = time.perf_counter() - t0
        n = len(new_ids)
        text = tokenizer.decode(encoded.tolist() + new_ids if isinstance(style, Raw) else new_ids)
        print(text, flush=True)
        print(f"Sample {i + 1}: {n} tokens in {t:.02f} s, {n / t:.02f} tokens/s", file=sys.stderr)
    if fabric.device.type == "cuda":
        print(f"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB (max allocated)", file=sys.stderr)
    else:
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        print(f"Memory used: {peak_rss / 1e9:.02f} GB (peak RSS, includes the mapped weights)", file=sys.stderr)


if __name__ == "__main__":
    run_cli(setup)
