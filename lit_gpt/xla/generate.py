"""Generation on XLA devices with a fixed, small number of compilations: two graphs per prompt-length bucket.

    model = fabric.setup_module(load_staged(config, checkpoint_dir / "lit_model.pth", fabric))
    result = generate(model, tokenizer.encode(prompt), max_new_tokens=50, stop_ids=tokenizer.stop_ids)
    result.tokens, result.time_to_first_token, result.decode_tokens_per_sec, result.compiles

How each part keeps the graphs fixed (a tracing backend compiles every distinct graph once, and a graph is
distinct as soon as a shape or a Python number baked into it changes):
  * caches: the KV cache and the RoPE tables are built on the host and transferred. Creating them on the device
    would be a graph of its own; computing RoPE lazily would fold it into the first prefill, whose graph would
    then differ from the second prompt's.
  * prefill: the prompt is right-padded *on the host* to a power-of-two bucket, then transferred (padding on the
    device makes the pad a graph node whose shape is the prompt length); the logits of the last real position
    are taken with a device index tensor, not a Python int. Every prompt of a bucket runs one graph.
  * decode: one token at a device `input_pos` that is advanced in place, and `torch_xla.sync()` after each
    step: every step is the same graph, whatever max_new_tokens is.
  * sampling (temperature, top-k, top-p) runs on the device (`lit_gpt.generate.sample`: no host reads).
  * stopping: tokens stay on the device; every `check_every` steps the new ones are copied to the host (a
    transfer, no computation) and looked at there, so at most `check_every - 1` steps are wasted after a stop.
The KV cache holds the next power of two >= bucket + max_new_tokens positions (at most block_size): for a given
max_new_tokens the cache, and with it the decode graph, depends on the bucket only.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.config import next_power_of_two
from lit_gpt.generate import bucket_length, check_lengths, check_sampling_args, decode_one_token, sample
from lit_gpt.model import GPT, KVCache
from lit_gpt.utils import LitError


@dataclass
class GenerationResult:
    tokens: torch.Tensor
    """The new tokens (CPU, int64), cut before the first stop token."""
    prompt_length: int
    bucket: int
    """The padded prompt length the prefill ran with."""
    time_to_first_token: float
    """Seconds from the start of the prefill to the first token on the host, compilation included."""
    decode_tokens_per_sec: Optional[float]
    """Steady decode speed: the steps after the first decode step (which may compile); None with < 3 tokens."""
    compiles: int
    """XLA compilations during this call."""
    stopped: bool
    """A stop token ended the generation (else max_new_tokens did)."""


def unwrap(model: nn.Module) -> GPT:
    """The `GPT` inside Fabric's and FSDPv2's wrappers (both expose the wrapped module as `.module`)."""
    inner = model
    while not isinstance(inner, GPT) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    if not isinstance(inner, GPT):
        raise TypeError(f"expected a lit_gpt GPT (possibly wrapped), got {type(model).__name__}")
    return inner


def cache_length(bucket: int, max_new_tokens: int, block_size: int) -> int:
    """KV cache positions for a prompt bucket: a power of two, so few distinct decode graphs exist."""
    return min(next_power_of_two(bucket + max_new_tokens), block_size)


def set_rope_length(model: GPT, length: int) -> None:
    """RoPE tables for `length` positions, built on the host and transferred (replicated under SPMD).

    Built on the device they would be computed inside the next graph, which then differs from the graphs after
    it (where the tables are inputs): one compilation more for every graph that first uses them."""
    device = model.transformer.wte.weight.device
    model.max_seq_length = length  # bookkeeping; the device computation it queues is replaced (and never run) below
    model.reset_rope_cache(device=torch.device("cpu"))
    model.cos, model.sin = to_device(model.cos, device), to_device(model.sin, device)


def setup_caches(model: GPT, batch_size: int, length: int, dtype: Optional[torch.dtype] = None) -> None:
    """Give `model` a KV cache of `length` positions (built on the host and transferred: no device computation,
    hence no compilation) and RoPE tables of at least that length.

    A cache of that size is kept: positions beyond the current one are masked, so a previous prompt's entries are
    harmless. The RoPE tables only grow, so that a training loop that generates samples keeps its own tables (and
    with them its compiled graphs) when they are long enough."""
    device = model.transformer.wte.weight.device
    dtype = dtype or model.transformer.wte.weight.dtype
    if model.rope_cache_length is None or model.rope_cache_length < length or model.cos.device != device:
        set_rope_length(model, length)
    cache = model.transformer.h[0].attn.kv_cache
    if cache is not None and tuple(cache.k.shape) == (batch_size, cache.k.size(1), length, cache.k.size(3)) and (
        cache.k.dtype == dtype and cache.k.device == device
    ):
        return
    c = model.config
    for block in model.transformer.h:
        # not `model.set_kv_cache`: it would also resize the RoPE tables (on the device)
        kv = KVCache(batch_size, c.n_query_groups, length, c.head_size, device=torch.device("cpu"), dtype=dtype)
        kv.k, kv.v = to_device(kv.k, device), to_device(kv.v, device)
        block.attn.kv_cache = kv


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Transfer a host tensor, replicated over all devices under SPMD.

    The explicit sharding matters: a device tensor without one is given one by the first graph that uses it
    (the partitioner's choice), and the next graph, seeing an input with another sharding, compiles again. The KV
    cache keeps its annotation through the in-place writes, so every step sees the same input shardings."""
    x = t.to(device)
    import torch_xla.runtime as xr

    if xr.is_spmd():
        import torch_xla.distributed.spmd as xs

        mesh = xs.get_global_mesh()
        if mesh is not None:
            xs.mark_sharding(x, mesh, (None,) * x.dim())
    return x


def _to_host(tokens: Sequence[torch.Tensor]) -> List[int]:
    """Copy already computed device tokens to the host: a transfer per tensor, no graph."""
    return [int(t.cpu().reshape(-1)[0]) for t in tokens]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    stop_ids: Optional[Union[int, Sequence[int]]] = None,
    pad_id: int = 0,
    check_every: int = 8,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after the 1-D (CPU) `prompt` on the model's XLA device.

    `model` may be wrapped (Fabric, FSDPv2): its forward is used, the caches go to the inner `GPT`. The tokens
    reach the host every `check_every` steps, where the stop tokens are looked for."""
    import torch_xla

    from lit_gpt.xla.diagnostics import compile_count

    if prompt.dim() != 1:
        raise LitError(f"expected a 1-D prompt of token ids, got shape {tuple(prompt.shape)}")
    if check_every < 1:
        raise LitError(f"check_every must be >= 1, got {check_every}")
    check_sampling_args(temperature, top_k, top_p)
    gpt = unwrap(model)
    block_size = gpt.config.block_size
    T = prompt.numel()
    check_lengths(T, max_new_tokens, block_size)
    bucket = bucket_length(T, block_size)
    device = gpt.transformer.wte.weight.device
    stops = set([stop_ids] if isinstance(stop_ids, int) else list(stop_ids or ()))
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    compiles_before = compile_count()
    setup_caches(gpt, 1, cache_length(bucket, max_new_tokens, block_size))
    model.eval()

    t0 = time.perf_counter()
    padded = to_device(F.pad(prompt.to(torch.long), (0, bucket - T), value=pad_id).unsqueeze(0), device)
    input_pos = to_device(torch.arange(bucket), device)
    # the last real position as a device tensor: a Python int would be baked into the graph (one per length)
    last = to_device(torch.tensor([T - 1]), device)
    token = sample(model(padded, input_pos, last_only=last)[:, -1], **sampling)
    torch_xla.sync()
    device_tokens = [token]
    host: List[int] = _to_host(device_tokens)  # waits for the prefill: the first token is on the host here
    time_to_first_token = time.perf_counter() - t0
    stopped = host[0] in stops

    decode_start: Optional[float] = None
    decode_steps = 0
    pos = to_device(torch.tensor([T]), device)
    step = 1
    while not stopped and step < max_new_tokens:
        token = decode_one_token(model, token, pos, **sampling)
        pos.add_(1)  # in place on the device: the next step's graph is the same
        torch_xla.sync()
        device_tokens.append(token)
        step += 1
        if step == 2:
            _to_host(device_tokens[1:2])  # the first decode step may compile: time the steady steps after it
            decode_start = time.perf_counter()
        else:
            decode_steps += 1
        if step % check_every == 0 or step == max_new_tokens:
            new = _to_host(device_tokens[len(host) :])
            host.extend(new)
            stopped = any(t in stops for t in new)
    if len(host) < len(device_tokens):  # the loop ended between two checks
        host.extend(_to_host(device_tokens[len(host) :]))
    decode_time = time.perf_counter() - decode_start if decode_start is not None else 0.0

    out = host
    if stops:
        cut = next((i for i, t in enumerate(out) if t in stops), None)
        if cut is not None:
            out, stopped = out[:cut], True
    return GenerationResult(
        tokens=torch.tensor(out, dtype=torch.long),
        prompt_length=T,
        bucket=bucket,
        time_to_first_token=time_to_first_token,
        decode_tokens_per_sec=decode_steps / decode_time if decode_steps > 0 and decode_time > 0 else None,
        compiles=compile_count() - compiles_before,
        stopped=stopped,
    )


# ---------------------------------------------------------------------------------------------------------------
# The recipes' session (xla/generate/{base,adapter,lora}.py differ only in how the model is loaded)
# ---------------------------------------------------------------------------------------------------------------
def default_precision(precision: Optional[str]) -> str:
    """The generation recipes' precision: bf16-true on TPUs, else 32-true (no mixed precision: no training)."""
    from lit_gpt.xla.accelerator import default_precision as choose

    return choose(precision, ("32-true", "bf16-true"), "for generation on XLA")


def load_variant_staged(
    fabric: Any, model_cls: Any, config_cls: Any, checkpoint_dir: Path, finetuned_path: Path
) -> GPT:
    """An Adapter / LoRA model (`lit_gpt.adapter.GPT`, `lit_gpt.lora.GPT`, ...) with the base weights and the
    finetuned-weights file (`lit_gpt.peft` format) loaded block by block onto the devices. The variant's settings
    (e.g. lora_r) come from the file."""
    from lit_gpt.peft import load_finetuned
    from lit_gpt.utils import check_checkpoint_dir
    from lit_gpt.xla.loader import load_staged

    base_path = check_checkpoint_dir(checkpoint_dir)
    _, fields = load_finetuned(finetuned_path, model_cls.peft_method)  # also checks the file's method
    config = config_cls.from_checkpoint(checkpoint_dir, **fields)
    # the later file overrides: the finetuned weights on top of the base checkpoint
    return load_staged(lambda: model_cls(config), [base_path, finetuned_path], fabric)


def generate_samples(
    fabric: Any,
    load_model: Callable[[Any], nn.Module],
    checkpoint_dir: Path,
    prompt: str,
    *,
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    prompt_style: Optional[str] = None,
    seed: int = 1234,
) -> List[GenerationResult]:
    """Check the request, `load_model(fabric)` (staged onto the devices), and print `num_samples` generations to
    stdout like generate/base.py; to stderr, per sample: time to first token (compilation included), steady
    decode tokens/s and the XLA compilations, then the total number of compilations."""
    import torch_xla.core.xla_model as xm

    from lit_gpt.generate import check_request
    from lit_gpt.xla.diagnostics import compile_count

    # prompt on the host: `generate` pads it there before the transfer (see the module docstring)
    request = check_request(
        checkpoint_dir, prompt, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, prompt_style=prompt_style,
    )

    t0 = time.perf_counter()
    model = fabric.setup_module(load_model(fabric))
    fabric.print(f"Loaded the model in {time.perf_counter() - t0:.2f} s", file=sys.stderr)

    fabric.seed_everything(seed)
    xm.set_rng_state(seed)  # the device's generator, which sampling on XLA draws from
    start = compile_count()
    results = []
    for i in range(num_samples):
        r = generate(
            model, request.encoded, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop_ids=request.stop_ids,
        )
        results.append(r)
        new_ids = r.tokens.tolist()
        fabric.print(request.text(new_ids), flush=True)
        speed = f"{r.decode_tokens_per_sec:.2f} tokens/s" if r.decode_tokens_per_sec else "n/a (< 3 tokens)"
        fabric.print(
            f"Sample {i + 1}: {len(new_ids)} tokens; time to first token {r.time_to_first_token:.2f} s (compilation"
            f" included); steady decode {speed}; XLA compilations {r.compiles} (prompt {r.prompt_length} tokens,"
            f" bucket {r.bucket})",
            file=sys.stderr,
        )
    fabric.print(
        f"XLA compilations: {compile_count() - start} (prefill + decode: 2 per prompt-length bucket, whatever"
        " max_new_tokens is)",
        file=sys.stderr,
    )
    return results
