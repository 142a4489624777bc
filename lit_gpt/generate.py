"""Autoregressive generation with a static KV cache, shared by the CPU/CUDA and XLA recipes.

The loop is written for devices that run asynchronously or trace graphs (CUDA, XLA), after gpt-fast:
- `prefill` feeds the whole prompt in one forward and takes the logits of the last real position with a tensor
  index, so a prompt right-padded to a length bucket reuses one compiled graph for every length in the bucket;
- `decode_one_token` feeds one token at a device `input_pos` that is advanced in place: every step has the
  same shapes;
- `sample` never reads a tensor value on the host (no `.item()`, no branching on values);
- stop tokens are tracked with a device-side `done` flag and looked at on the host once per chunk.
It is the only generation loop: what differs on XLA (host-side padding to a prompt bucket, explicit replicated
placement, a graph cut per step, transfers instead of graphs for the host reads) is asked of a
`lit_gpt.runtime.Runtime`; `lit_gpt.xla.runtime.XLARuntime` answers it. No XLA import lives here.
"""

from pathlib import Path
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from lit_gpt.config import Config, load_config, next_power_of_two
from lit_gpt.model import GPT
from lit_gpt.runtime import Runtime, param_dtype
from lit_gpt.utils import (
    LitError, cast_floating, check_checkpoint_dir, download_command, load_checkpoint, meminfo_bytes,
)

StopIds = Optional[Union[int, Sequence[int]]]


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------
def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` (..., vocab) -> (...) int64, entirely on the logits' device.

    temperature 0 is greedy. Otherwise the filters run in Hugging Face's order (temperature, top-k, top-p) and the
    draw is an exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i, like
    `torch.multinomial` but without its host synchronisation."""
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it already does
        # (the most likely token always stays, its preceding mass is 0)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / noise, dim=-1)


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: float) -> None:
    if temperature < 0:
        raise LitError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise LitError(f"top_k must be a positive number of tokens (or unset), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise LitError(f"top_p must be in (0, 1], got {top_p}")


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


def bucket_length(length: int, limit: int, minimum: int = 16) -> int:
    """A padded prompt length (the next power of two, at least `minimum`, at most `limit`): with prompts padded to
    a few bucket lengths, a tracing backend compiles the prefill once per bucket instead of once per length."""
    return min(max(next_power_of_two(length), minimum), limit)


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
    runtime = runtime or Runtime.on(model.transformer.wte.weight.device)
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
    (default: eager on the weights' device) says where tensors go and what differs per backend: on XLA the
    prompt is right-padded *on the host* to a power-of-two bucket before the transfer and every step ends the
    lazy graph, so the prefill compiles once per bucket and the decode step once; chunks reach the host as
    transfers, never as new graphs. `pad_to` and `max_seq_length` override the bucket and the KV-cache length.

    Generation ends after `max_new_tokens` steps or once every row has produced one of `stop_ids`. The stop flag
    lives on the device and is computed inside each step; the host reads it once per chunk (the only
    synchronisation in the loop), so a chunk of n steps costs up to n - 1 wasted steps after a stop but fewer
    syncs. The step in which the last row stops is not yielded (a single sequence never contains its stop
    token); in a batch, a row that stopped earlier holds its stop token and then the first stop id: cut each row
    at its first stop id.

    `decode_fn` / `prefill_fn` replace the two steps, e.g. with the compiled ones of `compile_steps`."""
    check_sampling_args(temperature, top_k, top_p)
    gpt = unwrap(model)
    runtime = runtime or Runtime.on(gpt.transformer.wte.weight.device)
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

# ---------------------------------------------------------------------------------------------------------------
# Compiled steps (CPU and CUDA; XLA traces its own graphs)
# ---------------------------------------------------------------------------------------------------------------
COMPILE_MODES = ("auto", "none", "default", "reduce-overhead", "max-autotune")
"""The choices of `--compile` (`resolve_compile`); `True` / `False` are also accepted (the former bool flag)."""


def compile_pays_after(device_type: str) -> Optional[int]:
    """Generated tokens (all samples of a run) from which `--compile auto` compiles; None: never.

    CUDA: compiling costs ~20-30 s with a cold cache and a few seconds with a warm one (see `compile_steps`); a step
    replayed as a CUDA graph saves the per-op launches of the eager one, most of a small model's step (the issue
    measured 196 -> 481 tokens/s with CUDA graphs on SmolLM2-1.7B's architecture, ~3 ms per token; more for smaller
    models): about a thousand tokens pay for a cold compile. An estimate, not a measurement on this code (no GPU was
    available).
    CPU: never. On the 2-core development machine (2026-11-23, shared with other jobs) the compiled decode step of
    SmolLM2-135M in fp32 was mostly slower than the eager one after ~40-80 s of compilation, one thread: 14.5 vs 21.5
    tokens/s for 40 tokens, 15.0 vs 12.9 for 32 tokens (KV cache 64), but 2.8 vs 14.1 for 128 (KV cache 160, no
    recompilation: Inductor's CPU code for that step is slow, not yet understood) in bench/generate.py's
    interleaved runs; an earlier quiet session measured it 1.45x faster. With no reliable gain, the default stays
    eager; `--compile default` compiles anyway."""
    return 1024 if device_type == "cuda" else None


def resolve_compile(compile: Union[bool, str], device_type: str, tokens: int) -> Optional[str]:
    """The `torch.compile` mode for generating `tokens` tokens in all on `device_type` ("cpu", "cuda", "xla"),
    None for eager. "auto" compiles when `tokens >= compile_pays_after(device_type)`: on CUDA with CUDA graphs
    ("reduce-overhead"); not on the CPU (see `compile_pays_after`); never on XLA, which compiles graphs itself."""
    if isinstance(compile, bool):  # the former --compile true/false
        compile = "auto" if compile else "none"
        if device_type != "xla" and compile == "auto":
            compile = "reduce-overhead" if device_type == "cuda" else "default"
    if compile not in COMPILE_MODES:
        raise LitError(f"--compile must be one of {', '.join(COMPILE_MODES)} (got {compile!r})")
    if device_type == "xla":
        if compile not in ("auto", "none"):
            raise LitError(
                f"--compile {compile} is for CPUs and CUDA GPUs: on XLA the loop's graphs are compiled by XLA"
                " already; leave --compile at auto"
            )
        return None
    if compile == "none":
        return None
    if compile == "auto":
        pays_after = compile_pays_after(device_type)
        if pays_after is None or tokens < pays_after:
            return None
        return "reduce-overhead" if device_type == "cuda" else "default"
    if device_type != "cuda" and compile == "reduce-overhead":
        raise LitError(
            f"--compile {compile} records CUDA graphs and needs a CUDA GPU: use --compile default on the {device_type}"
        )
    return compile


class Steps(NamedTuple):
    """The two steps `generate_stream` runs (its `prefill_fn` and `decode_fn`), eager or compiled."""

    prefill: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    mode: Optional[str]
    """The torch.compile mode of the decode step, None when eager."""
    compile_prefill: bool

    def shapes(self, prompt_length: int, max_new_tokens: int, block_size: int) -> Tuple[Optional[int], Optional[int]]:
        """`generate_stream`'s `pad_to` and `max_seq_length` for these steps: eager steps run the exact lengths
        (None, None); compiled ones take the prompt right-padded to a power-of-two bucket (`bucket_length`) and a KV
        cache of bucket + max_new_tokens positions, so that every prompt of a bucket gives the prefill and the
        decode step the shapes they were compiled (and their CUDA graphs recorded) for."""
        if self.mode is None:
            return None, None
        bucket = bucket_length(prompt_length, block_size)
        return bucket, min(bucket + max_new_tokens, block_size)


def _graph_safe(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A compiled step whose CUDA graph is replayed: each call starts a new graph step and returns a copy, since the
    next replay overwrites the graph's output memory while the loop still holds that token (in the chunk it has
    not read yet). Without the copy: "accessing tensor output of CUDAGraphs that has been overwritten"."""

    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs).clone()

    return step


def compile_steps(mode: Optional[str], compile_prefill: bool = True) -> Steps:
    """The loop's steps for a `resolve_compile` mode: eager for None; else the decode step compiled once for its
    fixed shapes in `mode` ("reduce-overhead" and "max-autotune" record a CUDA graph of it over the static KV cache
    and replay it each token), and, with `compile_prefill`, the prefill compiled (default mode, no CUDA graphs)
    once per prompt bucket (see `Steps.shapes`). Compilation happens in the first call of each; it is counted in
    that generation's time.

    Persistent cache: Inductor keeps its compiled kernels and graphs on disk (the FX graph cache and, for
    max-autotune, the autotuning results), in TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER), so a
    second process with the same model, shapes and mode compiles in a fraction of the first's time. Point it at a
    directory that survives reboots (TORCHINDUCTOR_CACHE_DIR=~/.cache/torchinductor); to ship a warm cache to
    another machine, see torch.compiler.save_cache_artifacts / load_cache_artifacts."""
    if mode is None:
        return Steps(prefill, decode_one_token, None, False)
    decode = torch.compile(decode_one_token, mode=mode, dynamic=False, fullgraph=True)
    if mode in ("reduce-overhead", "max-autotune"):  # both replay CUDA graphs
        decode = _graph_safe(decode)
    prefill_fn = torch.compile(prefill, dynamic=False, fullgraph=True) if compile_prefill else prefill
    return Steps(prefill_fn, decode, mode, compile_prefill)


# ---------------------------------------------------------------------------------------------------------------
# CPU weight layout
# ---------------------------------------------------------------------------------------------------------------
def use_column_major_weights(model: torch.nn.Module) -> int:
    """Store the weight of every linear layer that has at least as many rows (outputs) as columns (inputs)
    column-major: as the transposed view of a contiguous W^T. Returns how many tensors were changed.

    Why: a decode step multiplies one activation row by every weight matrix, a matrix-vector product bound by
    memory bandwidth. On x86 CPUs (MKL) `x @ W.T` streams a contiguous W^T clearly faster than the row-major W that
    nn.Linear keeps when the matrix is square or taller than wide (measured on 2 cores: 10-40% for SmolLM2's
    576->1536 MLP and 576->49152 head matrices, about 17% per generated token overall) and slower when it is wide
    (the 1536->576 down projection), hence the rule. An embedding that shares its weight with such a layer (a tied
    head) follows it, so tied weights remain one tensor; an embedding of its own stays row-major (a lookup reads
    rows). Shapes and names stay as they are; results differ from the row-major product by float summation order
    only. Meant for float32 inference on the CPU; a GPU has no use for it."""
    replaced: dict = {}
    modules = list(model.modules())
    for module in modules:
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if not weight.is_floating_point() or type(weight.data) is not torch.Tensor:
            continue  # a quantized weight (torchao, bitsandbytes): its kernel owns the layout
        if weight.dim() != 2 or weight.size(0) < weight.size(1) or weight.stride(0) == 1:
            continue
        if id(weight) not in replaced:
            with torch.no_grad():
                column_major = weight.detach().t().contiguous().t()
            # the original is kept in the entry so that its id() cannot be reused while the modules are rewired
            replaced[id(weight)] = (weight, torch.nn.Parameter(column_major, requires_grad=weight.requires_grad))
    for module in modules:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and id(module.weight) in replaced:
            module.weight = replaced[id(module.weight)][1]
    return len(replaced)


class PackedLinear(torch.nn.Module):
    """An inference-only stand-in for a float32 `nn.Linear` on the CPU: the weight is reordered once into oneDNN's
    blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's freezing pass does to the weights of
    the graphs it compiles for the CPU) and multiplied by oneDNN's linear kernel.

    Why: at batch 1 every decode step is a matrix-vector product per weight matrix, bound by how fast the weights
    stream from memory. oneDNN's kernel over its packed layout streams them faster than MKL over either nn.Linear
    layout and spreads the product over all cores (2-core AMD EPYC, all of SmolLM2-135M's block matrices once per
    step: 25.5 ms packed vs 30.8 ms column-major; decode 28-29 vs 22-24 tokens/s). Results differ from nn.Linear's
    by float summation order only. The packed tensor is opaque (no autograd, no torch.compile, no state_dict entry):
    `use_cpu_inference_layout` packs only for the eager loop."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # a plain attribute, not a buffer: model.to() and state_dict() must not touch the opaque tensor
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), 1)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN (x86 and most ARM builds can)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _plain_linear(module: torch.nn.Module) -> bool:
    """A layer that computes exactly F.linear(x, weight, bias): an nn.Linear, or a LoRA layer whose update is merged
    into its weight (generate/lora.py merges before generating)."""
    from lit_gpt.lora import LoRALinear

    return type(module) is torch.nn.Linear or (type(module) is LoRALinear and module.merged)


TIED_HEAD_COPY_SHARE = 8
"""`pack_linear_weights` packs a tied head when its second copy takes at most 1/TIED_HEAD_COPY_SHARE of the memory
still available."""


def pack_linear_weights(model: torch.nn.Module, tied_head: Optional[bool] = None) -> int:
    """Replace every plain float32 linear layer on the CPU (`_plain_linear`) by a `PackedLinear`. Returns how many
    were replaced. Unmerged LoRA, adapter layers and quantized weights keep their own kernels.

    A weight that two linear layers share is left alone. One that an embedding shares (a tied head: SmolLM2,
    Llama 3.2 1B/3B, Gemma, where the vocabulary matrix is also the embedding) is packed into a second copy, since
    the embedding needs its rows as they are: with `tied_head` True always, False never, None (the default) when
    that copy takes at most 1/`TIED_HEAD_COPY_SHARE` of the memory still available (else the head goes column-major
    with the embedding, one tensor). The head is the largest matrix and the one oneDNN gains most on (SmolLM2-135M's
    576->49152 head on 2 cores: 2.1 ms packed vs 3.9 ms column-major per token). With the head packed, the embedding
    keeps the row-major tensor it was loaded with: memory-mapped from a float32 checkpoint (`load_model`), only its
    looked-up rows are ever read, so the copy costs no memory over the column-major one it replaces; a model cast to
    float32 on loading holds both. bench/generate.py, SmolLM2-135M fp32, 2 cores, 2026-11-24: eager decode 2.10x
    transformers with the tied head column-major, 2.51x packed (52.7 -> 63.1 tokens/s)."""
    uses: dict = {}  # weight -> (modules using it, embeddings among them)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            n, embeddings = uses.get(id(weight), (0, 0))
            uses[id(weight)] = (n + 1, embeddings + isinstance(module, torch.nn.Embedding))
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _plain_linear(child):
                continue
            w = child.weight
            if type(w.data) is not torch.Tensor or w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            n, embeddings = uses[id(w)]
            if n - embeddings > 1:
                continue  # shared with another linear layer: one copy each would multiply the memory
            if embeddings:
                if tied_head is None:
                    available = meminfo_bytes("MemAvailable")
                    pack = available is not None and w.numel() * w.element_size() * TIED_HEAD_COPY_SHARE <= available
                else:
                    pack = tied_head
                if not pack:
                    continue
            setattr(parent, name, PackedLinear(child))
            replaced += 1
    return replaced


def prepare_for_generation(model: torch.nn.Module, device_type: str, precision: str, mode: Optional[str]) -> None:
    """What the generation recipes (generate/*.py, chat) do to the loaded model before Fabric's setup: its floating
    weights in the precision's dtype, whatever the file stored (`cast_floating`: Fabric's "32-true" casts nothing,
    so a bf16 Hub checkpoint would otherwise run in bf16 under the CPU's default 32-true, and miss the fp32 layout
    below); then, on the CPU in 32-true, `use_cpu_inference_layout` (packed weights for the eager loop,
    column-major for compiled steps)."""
    cast_floating(model, param_dtype(precision))
    if device_type == "cpu" and precision == "32-true":
        use_cpu_inference_layout(model, packed=mode is None)


def use_cpu_inference_layout(model: torch.nn.Module, packed: bool = True) -> None:
    """The fastest weight layout for float32 generation on the CPU: with `packed` (the eager loop) the linear layers
    in oneDNN's packed layout where this build has oneDNN, then the rest (a tied head and embedding, or everything
    when the steps are compiled: torch.compile cannot trace the opaque packed tensors) column-major."""
    if packed and onednn_available():
        pack_linear_weights(model)
    use_column_major_weights(model)


# ---------------------------------------------------------------------------------------------------------------
# Loading for inference
# ---------------------------------------------------------------------------------------------------------------
def check_model_dir(checkpoint_dir: Path) -> Path:
    """`check_checkpoint_dir`, plus the nearest known model names when the folder does not exist and its name
    is not a known model (a typo in --checkpoint_dir)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir() and checkpoint_dir.name not in Config.names():
        import difflib

        close = difflib.get_close_matches(checkpoint_dir.name, Config.names(), n=3, cutoff=0.5)
        if close:
            raise LitError(
                f"checkpoint directory {str(checkpoint_dir)!r} does not exist and {checkpoint_dir.name!r} is not a"
                f" known model name. Did you mean: {', '.join(close)}? Then download it with:"
                f" {download_command(checkpoint_dir.with_name(close[0]))}"
            )
    for method in ("lora", "adapter", "adapter_v2"):
        # a finetuning run's final/ folder of a PEFT method: the weights file belongs to another recipe
        finetuned = checkpoint_dir / f"lit_model.pth.{method}"
        if finetuned.is_file() and not (checkpoint_dir / "lit_model.pth").is_file():
            flag = "--lora_path" if method == "lora" else "--adapter_path"
            raise LitError(
                f"{str(checkpoint_dir)!r} holds {method} weights, not a whole model: use generate/{method}.py"
                f" {flag} {finetuned} --checkpoint_dir <the base model they were trained on>"
            )
    return check_checkpoint_dir(checkpoint_dir)


def load_model(checkpoint_dir: Path) -> GPT:
    """Build the model on the meta device and assign the memory-mapped weights of `lit_model.pth`: the weights
    exist once (in the page cache) instead of once initialised and once loaded. Tied embeddings stay one tensor."""
    path = check_model_dir(checkpoint_dir)
    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        model = GPT(config)
    load_checkpoint(model, path, assign=True)
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------------------------
# The body of the generate/*.py recipes (they differ only in how the model is loaded)
# ---------------------------------------------------------------------------------------------------------------
def generation_fabric(accelerator: str = "auto", precision: Optional[str] = None):
    """A one-device Fabric for generation: bf16-true on GPUs that support it, else 32-true, unless given."""
    import lightning as L  # here: only the generation recipes need Lightning

    from lit_gpt.runtime import resolve_accelerator

    accelerator = resolve_accelerator(accelerator)
    if precision is None:
        precision = "bf16-true" if accelerator == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    if precision not in ("32-true", "bf16-true", "16-true"):
        raise LitError(f"--precision must be 32-true, bf16-true or 16-true for generation (got {precision!r})")
    return L.Fabric(devices=1, accelerator=accelerator, precision=precision)


class Request(NamedTuple):
    """A checked generation request: what the CPU/GPU and the XLA `generate_samples` share."""

    tokenizer: Any
    style: Any
    encoded: torch.Tensor
    """The prompt with its template applied, encoded (1-D, on the CPU unless a device was given)."""
    stop_ids: List[int]
    """The single-token stop sequences of the style: generation ends on the device at any of them."""

    def text(self, new_ids: List[int]) -> str:
        """What the recipes print: with a raw prompt, the prompt and its continuation; with a template, the reply."""
        from lit_gpt.prompts import Raw

        raw = isinstance(self.style, Raw)
        return self.tokenizer.decode(self.encoded.tolist() + new_ids if raw else new_ids)


def check_request(
    checkpoint_dir: Path,
    prompt: str,
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    prompt_style: Optional[str],
    device: Optional[torch.device] = None,
) -> Request:
    """Every check on the user's input (folder, sampling arguments, prompt length against the context), run before
    any weights are read, and the encoded prompt."""
    from lit_gpt.prompts import PromptStyle  # here: only the generation recipes need prompts and tokenizer
    from lit_gpt.tokenizer import Tokenizer

    if num_samples < 1:
        raise LitError(f"--num_samples must be >= 1 (got {num_samples})")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
        raise LitError(
            f"--prompt is not valid UTF-8 text (byte {e.start} of it): pass the prompt in UTF-8, e.g. convert the"
            " file with iconv -t UTF-8"
        ) from None
    check_sampling_args(temperature, top_k, top_p)
    check_model_dir(checkpoint_dir)
    config = load_config(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_checkpoint(checkpoint_dir, prompt_style)
    encoded = tokenizer.encode(style.apply(prompt), bos=style.bos, device=device)
    check_lengths(encoded.numel(), max_new_tokens, config.block_size)
    # the styles here have single-token stop sequences only
    stop_ids = [ids[0] for ids in style.stop_tokens(tokenizer) if len(ids) == 1]
    return Request(tokenizer, style, encoded, stop_ids)


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
    import time

    runtime = runtime or Runtime.on(unwrap(model).transformer.wte.weight.device)
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


def generate_samples(
    fabric: Any,
    load_model: Callable[[], torch.nn.Module],
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
    compile: Union[bool, str] = "auto",
    runtime: Optional[Runtime] = None,
) -> List[str]:
    """The body of every generation recipe (CPU, CUDA and XLA): check the request, then `load_model()`, then print
    `num_samples` generations to stdout; to stderr, per sample: tokens, time, time to first token, steady decode
    tokens/s (and on XLA the compilations), then the memory used. Every check on the user's input runs before the
    weights are read. Returns the texts.

    `compile` is a `COMPILE_MODES` choice (`resolve_compile`): "auto" compiles the steps when the run's
    num_samples * max_new_tokens pays for the compilation (CUDA graphs on a GPU), the others force a mode; the
    compilation time (in the first sample) is printed."""
    import resource
    import sys
    import time

    runtime = runtime or Runtime(fabric)
    xla = runtime.name == "xla"
    device_type = "xla" if xla else fabric.device.type
    mode = resolve_compile(compile, device_type, num_samples * max_new_tokens)
    # the prompt stays on the host: the loop pads it there (XLA) and transfers it
    request = check_request(
        checkpoint_dir, prompt, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, prompt_style=prompt_style,
    )

    t0 = time.perf_counter()
    model = load_model().eval()
    prepare_for_generation(model, fabric.device.type, fabric.strategy.precision.precision, mode)
    model = fabric.setup_module(model)
    fabric.print(f"Loaded {checkpoint_dir} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)

    # the prefill is compiled on GPUs only: on the CPU it runs once per sample and its compilation would not pay
    steps = compile_steps(mode, compile_prefill=device_type == "cuda")
    pad_to, max_seq_length = steps.shapes(request.encoded.numel(), max_new_tokens, unwrap(model).config.block_size)
    fabric.seed_everything(seed)
    runtime.seed(seed)
    start = runtime.compile_count()
    texts = []
    for i in range(num_samples):
        # inference mode (eager): nothing here needs autograd afterwards, and each small op dispatches faster
        with runtime.inference_context():
            r = timed_generate(
                model, request.encoded, max_new_tokens, runtime, temperature=temperature, top_k=top_k, top_p=top_p,
                stop_ids=request.stop_ids, decode_fn=steps.decode, prefill_fn=steps.prefill, pad_to=pad_to,
                max_seq_length=max_seq_length,
            )
        new_ids = r.tokens.tolist()
        compiling = xla or (steps.compile_prefill and i == 0)
        texts.append(request.text(new_ids))
        fabric.print(texts[-1], flush=True)
        speed = f"{r.decode_tokens_per_sec:.2f} tokens/s" if r.decode_tokens_per_sec else "n/a (< 3 tokens)"
        fabric.print(
            f"Sample {i + 1}: {len(new_ids)} tokens in {r.seconds:.02f} s;"
            f" time to first token {r.time_to_first_token:.2f} s{' (compilation included)' if compiling else ''};"
            f" steady decode {speed}" + (f"; XLA compilations {r.compiles}" if xla else ""),
            file=sys.stderr,
        )
        if mode is not None and i == 0:
            # what the first two steps took beyond two steady steps: the compilation (with a warm cache, loading it)
            first_steps = r.first_steps_seconds if r.first_steps_seconds is not None else r.seconds
            steady_steps = 2 / r.decode_tokens_per_sec if r.decode_tokens_per_sec else 0.0
            compile_s = max(first_steps - steady_steps, 0.0)
            fabric.print(
                f"torch.compile ({mode}{', prefill per prompt bucket' if steps.compile_prefill else ''}):"
                f" ~{compile_s:.1f} s of compilation in sample 1; the compiled graphs are cached in"
                " TORCHINDUCTOR_CACHE_DIR for later runs", file=sys.stderr,
            )
    if xla:
        fabric.print(
            f"XLA compilations: {runtime.compile_count() - start} (prefill + decode: 2 per prompt-length bucket,"
            " whatever max_new_tokens is)", file=sys.stderr,
        )
    report = runtime.memory_report()
    if report is not None:
        fabric.print(report, file=sys.stderr)
    elif fabric.device.type == "cpu":
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        fabric.print(f"Memory used: {peak_rss / 1e9:.02f} GB (peak RSS, includes the mapped weights)", file=sys.stderr)
    return texts
