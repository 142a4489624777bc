"""Autoregressive generation with a static KV cache: the one generation loop (CPU, CUDA and XLA).

The loop is written for devices that run asynchronously or trace graphs (CUDA, XLA), after gpt-fast:
- `prefill` feeds the whole prompt in one forward and takes the logits of the last real position with a tensor
  index, so a prompt right-padded to a length bucket reuses one compiled graph for every length in the bucket;
- `decode_one_token` feeds one token at a device `input_pos` that is advanced in place: every step has the
  same shapes;
- `sample` never reads a tensor value on the host (no `.item()`, no branching on values);
- stop tokens are tracked with a device-side `done` flag and looked at on the host once per chunk.
What differs per backend (host-side padding to a prompt bucket, explicit replicated placement, a graph cut per
step, transfers instead of graphs for the host reads) is asked of a `lit_gpt.runtime.Runtime`, passed in:
`XLARuntime(fabric)` (lit_gpt.xla.runtime) on XLA; without one, the CPU/CUDA runtime on the weights' device.
When the steps are compiled: `lit_gpt.compile_policy`. The recipes' steps around the loop: `lit_gpt.recipes.generate`.
"""

import time
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Union

import torch

from lit_gpt.compile_policy import Steps, build_steps
from lit_gpt.loading import load_model  # noqa: F401  (re-exported for earlier importers: its home is lit_gpt.loading)
from lit_gpt.model import GPT
from lit_gpt.runtime import Runtime, bucket_length  # noqa: F401  (bucket_length: re-exported for earlier importers)
from lit_gpt.sampling import check_sampling_args, sample
from lit_gpt.utils import LitError

StopIds = Optional[Union[int, Sequence[int]]]


# ---------------------------------------------------------------------------------------------------------------
# Lengths and the KV cache
# ---------------------------------------------------------------------------------------------------------------
def check_lengths(prompt_length: int, max_new_tokens: int, block_size: int) -> None:
    """Raise a LitError that says what to change when the request does not fit the model's context."""
    if max_new_tokens <= 0:
        raise LitError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if prompt_length <= 0:
        raise LitError("the prompt is empty (0 tokens): give a prompt or encode it with a BOS token")
    if prompt_length > block_size:
        raise LitError(
            f"the prompt has {prompt_length} tokens but the model's context (block_size) is {block_size}:"
            f" shorten the prompt by at least {prompt_length - block_size} tokens"
        )
    if prompt_length + max_new_tokens > block_size:
        over = prompt_length + max_new_tokens - block_size
        raise LitError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context"
            f" (block_size {block_size}) by {over}: set max_new_tokens <= {block_size - prompt_length}"
            " or shorten the prompt"
        )


def kv_cache_length(model: GPT, batch_size: int) -> int:
    """Positions in the model's KV cache, 0 if it has none (or one for another batch size)."""
    cache = model.transformer.h[0].attn.kv_cache
    if cache is None or cache.k.size(0) != batch_size:
        return 0
    return cache.k.size(2)


def setup_kv_cache(
    model: GPT,
    prompt_length: int,
    max_new_tokens: int,
    batch_size: int = 1,
    max_seq_length: Optional[int] = None,
    runtime: Optional[Runtime] = None,
    dtype: Optional[torch.dtype] = None,
) -> int:
    """Check the lengths and give `model` a KV cache of `prompt_length + max_new_tokens` positions (or
    `max_seq_length`, e.g. a fixed size so that a tracing backend compiles the decode step once for all prompts).

    Sizing to the request rather than to block_size keeps memory and the per-step attention proportional to what
    is generated. Returns the cache length."""
    block_size = model.config.block_size
    check_lengths(prompt_length, max_new_tokens, block_size)
    needed = prompt_length + max_new_tokens
    if max_seq_length is None:
        max_seq_length = needed
    elif not needed <= max_seq_length <= block_size:
        raise LitError(
            f"max_seq_length {max_seq_length} must be between prompt + max_new_tokens ({needed}) and the context"
            f" length {block_size}"
        )
    runtime = runtime or default_runtime(model)
    runtime.setup_kv_cache(model, batch_size, max_seq_length, dtype)
    return max_seq_length


# ---------------------------------------------------------------------------------------------------------------
# The two steps
# ---------------------------------------------------------------------------------------------------------------
def prefill(
    model: GPT,
    prompt: torch.Tensor,
    input_pos: torch.Tensor,
    last: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Run the (B, L) prompt, right-padded to a bucket length L, through the model in one forward, filling the KV
    cache at `input_pos` (0..L-1); return the first new token (B,), sampled from the logits at the last real
    position `last` (a (1,) tensor holding T - 1).

    `last` is a tensor, not the int T - 1, so a traced graph does not depend on the prompt length. The padding is
    harmless: under the causal mask position T - 1 attends to keys 0..T-1 only, and the keys/values written at
    positions >= T are overwritten by the decode steps before any query can see them (the step at position p
    writes p, then attends to 0..p)."""
    logits = model(prompt, input_pos, last_only=last)
    return sample(logits[:, -1], temperature, top_k, top_p, generator)


def decode_one_token(
    model: GPT,
    token: torch.Tensor,
    input_pos: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Feed the (B,) tokens at position `input_pos` (shape (1,)) and return the next (B,) tokens."""
    logits = model(token.view(-1, 1), input_pos)
    return sample(logits[:, -1], temperature, top_k, top_p, generator)


# ---------------------------------------------------------------------------------------------------------------
# The loop (the only generation loop: CPU, CUDA and XLA)
# ---------------------------------------------------------------------------------------------------------------
def unwrap(model: torch.nn.Module) -> GPT:
    """The `GPT` inside Fabric's and FSDP's wrappers (they expose the wrapped module as `.module`)."""
    inner = model
    while not isinstance(inner, GPT) and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    if not isinstance(inner, GPT):
        raise TypeError(f"expected a lit_gpt GPT (possibly wrapped), got {type(model).__name__}")
    return inner


def default_runtime(model: torch.nn.Module) -> Runtime:
    """The CPU/CUDA runtime on the weights' device, for callers that pass none. XLA has its own (graph cuts, host
    padding, replicated placement): without it every step would be a new graph, so it must be passed."""
    device = unwrap(model).transformer.wte.weight.device
    if device.type == "xla":
        raise ValueError(
            "the model is on an XLA device: pass runtime=XLARuntime(fabric) (from lit_gpt.xla.runtime) to the"
            " generation functions"
        )
    return Runtime(None, device)


@torch.no_grad()
def generate_stream(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    stop_ids: StopIds = None,
    generator: Optional[torch.Generator] = None,
    runtime: Optional[Runtime] = None,
    pad_to: Optional[int] = None,
    pad_id: int = 0,
    chunk_size: Optional[int] = None,
    max_seq_length: Optional[int] = None,
    decode_fn: Callable[..., torch.Tensor] = decode_one_token,
    prefill_fn: Callable[..., torch.Tensor] = prefill,
) -> Iterator[torch.Tensor]:
    """Yield the new tokens in chunks: (n,) for a 1-D prompt, (B, n) for a (B, T) batch. The first two chunks
    hold one step each (the prefill's token, then the first decode step's, so a reader sees the first token at
    once and can time the steady steps apart from the first ones, which may compile); then chunks of
    `chunk_size` steps (default: the runtime's `stop_check_every`).

    `model` may be wrapped (Fabric, FSDP): its forward runs, the caches go to the inner `GPT`. The `runtime`
    (default: `default_runtime`, CPU/CUDA on the weights' device) says where tensors go and what differs per
    backend: on XLA (`XLARuntime`, required there) the prompt is right-padded *on the host* to a power-of-two
    bucket before the transfer and every step ends the lazy graph, so the prefill compiles once per bucket and the
    decode step once; chunks reach the host as transfers, never as new graphs. `pad_to` and `max_seq_length`
    override the bucket and the KV-cache length.

    Generation ends after `max_new_tokens` steps or once every row has produced one of `stop_ids`. The stop flag
    lives on the device and is computed inside each step; the host reads it once per chunk (the only
    synchronisation in the loop), so a chunk of n steps costs up to n - 1 wasted steps after a stop but fewer
    syncs. The step in which the last row stops is not yielded (a single sequence never contains its stop
    token); in a batch, a row that stopped earlier holds its stop token and then the first stop id: cut each row
    at its first stop id.

    `decode_fn` / `prefill_fn` replace the two steps, e.g. with the compiled ones of `compile_steps`."""
    check_sampling_args(temperature, top_k, top_p)
    gpt = unwrap(model)
    runtime = runtime or default_runtime(gpt)
    every = runtime.stop_check_every if chunk_size is None else chunk_size
    if every <= 0:
        raise LitError(f"chunk_size must be > 0, got {chunk_size}")
    single = prompt.dim() == 1
    if single:
        prompt = prompt.unsqueeze(0)
    B, T = prompt.shape
    block_size = gpt.config.block_size
    check_lengths(T, max_new_tokens, block_size)
    length = runtime.prompt_bucket(T, block_size) if pad_to is None else pad_to
    if length < T:
        raise LitError(f"pad_to ({pad_to}) is shorter than the prompt ({T} tokens)")
    cache = max_seq_length or runtime.cache_length(length, T, max_new_tokens, block_size)
    if cache < max(length, T + max_new_tokens) or cache > block_size:
        raise LitError(
            f"max_seq_length {cache} must be between the padded prompt + max_new_tokens"
            f" ({max(length, T + max_new_tokens)}) and the context length {block_size}"
        )
    if kv_cache_length(gpt, B) < cache or (max_seq_length is not None and kv_cache_length(gpt, B) != cache):
        runtime.setup_kv_cache(gpt, B, cache)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    stop_list = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids or ())
    stops_host = torch.tensor(stop_list, dtype=torch.long) if stop_list else None
    stops = runtime.to_device(stops_host) if stops_host is not None else None

    if length > T:  # padded where the prompt is (the host for XLA, whose callers keep prompts there)
        prompt = torch.nn.functional.pad(prompt, (0, length - T), value=pad_id)
    token = prefill_fn(
        model, runtime.to_device(prompt), runtime.to_device(torch.arange(length)),
        runtime.to_device(torch.tensor([T - 1])), **sampling,
    )
    done = runtime.to_device(torch.zeros(B, dtype=torch.bool))
    input_pos = runtime.to_device(torch.tensor([T]))
    chunk: List[torch.Tensor] = []
    for step in range(max_new_tokens):
        if step > 0:
            token = decode_fn(model, token, input_pos, **sampling)
            input_pos.add_(1)  # in place: the next step sees the same tensor, so its graph is the same
        if stops is not None:
            token = torch.where(done, stops[0], token)
            done = done | (token.unsqueeze(-1) == stops).any(-1)
        runtime.end_step()
        chunk.append(token)
        if step < 2 or len(chunk) == every or step == max_new_tokens - 1:
            out = runtime.to_host(chunk)
            chunk = []
            if stops is not None and bool(done.cpu().all()):
                # the first step after which every row has stopped; rows stopped in an earlier chunk hold stop ids
                st = stops if out.device == stops.device else stops_host.to(out.device)
                is_stop = (out.unsqueeze(-1) == st).any(-1)
                all_stopped = is_stop.cummax(dim=1).values.all(dim=0)
                end = int(torch.argmax(all_stopped.int()))
                out = out[:, :end]
                if out.size(1):
                    yield out[0] if single else out
                return
            yield out[0] if single else out


def generate(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """All new tokens of `generate_stream` (same arguments) in one tensor: (n,) for a 1-D prompt, else (B, n)."""
    chunks = list(generate_stream(model, prompt, max_new_tokens, **kwargs))
    if not chunks:
        return prompt.new_empty((0,) if prompt.dim() == 1 else (prompt.size(0), 0)).cpu()
    return torch.cat([c.to(chunks[0].device) for c in chunks], dim=-1)


def compile_steps(mode: Optional[str], compile_prefill: bool = True) -> Steps:
    """This loop's `prefill` and `decode_one_token`, eager for None or compiled in a `resolve_compile` mode
    (`lit_gpt.compile_policy.build_steps`); pass them as `generate_stream`'s `prefill_fn` and `decode_fn`."""
    return build_steps(prefill, decode_one_token, mode, compile_prefill)


class GenerationResult(NamedTuple):
    tokens: torch.Tensor
    """The new tokens (CPU, int64), cut before the first stop token."""
    prompt_length: int
    time_to_first_token: float
    """Seconds from the start of the prefill to the first token on the host (compilation included on XLA)."""
    decode_tokens_per_sec: Optional[float]
    """Steady decode speed: the steps after the first decode step (which may compile); None with < 3 tokens."""
    seconds: float
    compiles: int
    """Graph compilations during the call (XLA; 0 on eager backends)."""
    first_steps_seconds: Optional[float] = None
    """Seconds to the end of the first decode step (prefill + one step: where a compiled step compiles)."""


def timed_generate(
    model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, runtime: Optional[Runtime] = None, **kwargs: Any
) -> GenerationResult:
    """`generate_stream` read to the end on the host, with the time to the first token, the steady decode speed
    and the compilations. Every chunk is read as it arrives (the only host reads)."""
    runtime = runtime or default_runtime(model)
    compiles = runtime.compile_count()
    t0 = time.perf_counter()
    ids: List[int] = []
    first = steady_start = first_steps = None
    steady_from = 0
    for i, chunk in enumerate(generate_stream(model, prompt, max_new_tokens, runtime=runtime, **kwargs)):
        ids.extend(chunk.reshape(-1).tolist())
        now = time.perf_counter()
        if i == 0:
            first = now - t0
        elif i == 1:  # the first decode step (which may compile) is done: time the steady steps from here
            steady_start, steady_from = now, len(ids)
            first_steps = now - t0
    end = time.perf_counter()
    steady = None
    if steady_start is not None and len(ids) > steady_from and end > steady_start:
        steady = (len(ids) - steady_from) / (end - steady_start)
    return GenerationResult(
        tokens=torch.tensor(ids, dtype=torch.long), prompt_length=prompt.size(-1),
        time_to_first_token=first if first is not None else end - t0, decode_tokens_per_sec=steady,
        seconds=end - t0, compiles=runtime.compile_count() - compiles, first_steps_seconds=first_steps,
    )
