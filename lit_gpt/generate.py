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

import itertools
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from lit_gpt.compile_policy import Steps, build_steps
from lit_gpt.loading import load_model  # noqa: F401  (re-exported for earlier importers: its home is lit_gpt.loading)
from lit_gpt.kv_cache import Ragged, RaggedGroup
from lit_gpt.model import GPT
from lit_gpt.runtime import Runtime, bucket_length  # noqa: F401  (bucket_length: re-exported for earlier importers)
from lit_gpt.sampling import Setting, check_sampling_args, sample
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
    if cache is None or cache.rows != batch_size:
        return 0
    return cache.length  # positions, not entries: a sliding layer's ring holds fewer (`lit_gpt.kv_cache`)


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
    temperature: Setting = 0.0,
    top_k: Optional[int] = None,
    top_p: Setting = 1.0,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
    slots: Optional[torch.Tensor] = None,
    cache_length: Optional[int] = None,
) -> torch.Tensor:
    """Run the (B, L) prompt, right-padded to a bucket length L, through the model in one forward, filling the KV
    cache at `input_pos` ((B, L) positions 0..L-1, in the cache rows `slots`: `GPT.forward`); return the first new
    token (B,), sampled (`lit_gpt.sampling.sample`) from the logits at the last real position `last` (a (1,) tensor
    holding T - 1).

    `last` is a tensor, not the int T - 1, so a traced graph does not depend on the prompt length. The padding is
    harmless: under the causal mask position T - 1 attends to keys 0..T-1 only, and the keys/values written at
    positions >= T are overwritten by the decode steps before any query can see them (the step at position p
    writes p, then attends to 0..p)."""
    logits = model(prompt, input_pos, last_only=last, slots=slots, cache_length=cache_length)
    return sample(logits[:, -1], temperature, top_k, top_p, generator, noise)


def decode_one_token(
    model: GPT,
    token: torch.Tensor,
    input_pos: torch.Tensor,
    *,
    temperature: Setting = 0.0,
    top_k: Optional[int] = None,
    top_p: Setting = 1.0,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
    cache_length: Optional[int] = None,
    ragged: Optional[Ragged] = None,
) -> torch.Tensor:
    """Feed the (B,) tokens at their positions `input_pos` ((B, 1): each row its own; or (1,) shared) and return
    the next (B,) tokens; the queries see the cache's first `cache_length` positions (default all). With `ragged`
    (`Batch.step_with`: prompt chunks riding along), one forward of its tokens instead, returning a token for each
    of its `heads` (the rows', then each chunk's)."""
    return sample(step_logits(model, token, input_pos, cache_length, ragged), temperature, top_k, top_p, generator,
                  noise)


def step_logits(model: torch.nn.Module, token: torch.Tensor, input_pos: torch.Tensor, cache_length: Optional[int],
                ragged: Optional[Ragged] = None) -> torch.Tensor:
    """A decode step's logits, (B, vocab): one token per row, or a `Ragged` forward's at its `heads`."""
    if ragged is not None:
        return model(ragged.ids, ragged.input_pos, ragged=ragged, head_rows=ragged.heads)
    return model(token.view(-1, 1), input_pos, cache_length=cache_length)[:, -1]


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


class Batch:
    """The loop's state: a KV cache of `rows` rows ("slots") x `length` positions, and each row's last token, next
    position, stop flag and sampling settings, on the device. Sequences join at a step boundary (`join`: their
    prompts prefilled into free rows, which returns their first tokens) and leave when they end (`leave`); each
    `step` decodes one token for every row. `generate_stream` runs a batch that all its rows join at once; a server
    (`lit_gpt.recipes.serving`) keeps one batch for its lifetime and lets requests join and leave between steps
    (continuous batching). Both run these two methods: there is one loop.

    Shapes. With `static` (a backend that traces graphs: XLA, or compiled steps) every step runs all rows over the
    whole cache, so the decode step is one graph and a prefill one graph per prompt bucket; the state is updated
    in place, so every step sees the same input tensors (and, under SPMD, the same shardings). Eager backends run
    the rows up to the highest one in use, over the cache positions in use (rounded up to `VISIBLE_MULTIPLE`): an
    idle slot or an unused stretch of a long cache costs nothing.

    Sampling: one setting for every row (`uniform`: `generate_stream`'s arguments, one generator for the batch), or
    per row (`join(..., sampling=[RowSampling, ...])`: each row's temperature and top-p, and its own generator, from
    which that row's draws come whatever else is in the batch).

    Paged KV memory (`paged=(blocks, block_size)`, the server's): the rows share a pool of blocks through a block
    table (`lit_gpt.kv_cache.PagedKVCache`) that the caller's allocator fills (`set_block_table`) before a row is
    prefilled; the steps are the same (a row's positions, whichever blocks hold them).

    Every `join` and `step` ends with `runtime.end_step()` (on XLA, the end of the step's graph)."""

    VISIBLE_MULTIPLE = 64

    def __init__(self, model: torch.nn.Module, rows: int, length: int, *, runtime: Optional[Runtime] = None,
                 static: Optional[bool] = None, exact_length: bool = False, stop_ids: StopIds = None,
                 uniform: Optional[Dict[str, Any]] = None, decode_fn: Callable[..., torch.Tensor] = decode_one_token,
                 prefill_fn: Callable[..., torch.Tensor] = prefill, paged: Optional[Tuple[int, int]] = None) -> None:
        self.model, self.gpt = model, unwrap(model)
        self.runtime = runtime or default_runtime(self.gpt)
        have = kv_cache_length(self.gpt, rows)
        if paged is not None:
            self.runtime.setup_kv_cache(self.gpt, rows, length, paged=paged)
        elif have < length or (exact_length and have != length) or self.paged:
            self.runtime.setup_kv_cache(self.gpt, rows, length)
        self.rows, self.length = rows, kv_cache_length(self.gpt, rows)  # a longer cache already there is kept
        self.static = self.runtime.compiles_graphs if static is None else static
        self.decode_fn, self.prefill_fn = decode_fn, prefill_fn
        self.uniform = uniform
        self.tokens = self.runtime.zeros((rows,), torch.long)
        self.positions = self.runtime.zeros((rows,), torch.long)
        stop_list = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids or ())
        self.stops_host = torch.tensor(stop_list, dtype=torch.long) if stop_list else None
        self.stops = self.runtime.to_device(self.stops_host) if stop_list else None
        self.done = self.runtime.zeros((rows,), torch.bool)
        # host mirrors: which rows are in use, their next positions and their sampling settings
        self.active = [False] * rows
        self.next_pos = [0] * rows
        self.sampling: List[RowSampling] = [RowSampling()] * rows
        self.vocab = self.gpt.config.vocab_size
        self._greedy_args: Dict[int, Dict[str, torch.Tensor]] = {}  # static backends: all-greedy inputs by rows
        self._noise: Optional[torch.Tensor] = None  # eager backends: the per-row draws' buffer (`_fill_noise`)

    @property
    def paged(self) -> bool:
        return hasattr(self.gpt.transformer.h[0].attn.kv_cache, "pages")

    def set_block_table(self, table: torch.Tensor) -> None:
        """A paged cache's (rows, columns) block table from the host (every layer's: they share it)."""
        self.gpt.transformer.h[0].attn.kv_cache.pages.table = self.runtime.to_device(table)

    # --------------------------------------------------------------- rows
    def free_rows(self) -> List[int]:
        return [r for r in range(self.rows) if not self.active[r]]

    def leave(self, row: int) -> None:
        """Row `row` is free from the next step on (its cache entries are overwritten by the next join)."""
        self.active[row] = False
        self.sampling[row] = RowSampling()

    def sampling_args(self, rows: Sequence[int], more: Sequence["RowSampling"] = ()) -> Dict[str, Any]:
        """`sample`'s arguments for `rows` (their settings), followed by `more` settings (a step's riding chunks)."""
        if self.uniform is not None:
            return self.uniform
        settings = [self.sampling[r] for r in rows] + list(more)
        if not self.static and all(s.temperature == 0.0 for s in settings):
            return {}  # greedy rows only, on an eager backend: no settings, no draws
        # a static backend always runs the per-row graph (greedy rows are rows at temperature 0): one graph. With
        # every row greedy its inputs are the same every step: transferred once, not (rows x vocab) per step
        greedy = all(s.temperature == 0.0 for s in settings)
        if greedy and len(settings) in self._greedy_args:
            return self._greedy_args[len(settings)]
        if self.static:
            draws = [_exponential(self.vocab, s.generator) if s.temperature > 0 else None for s in settings]
            # each row's draws come from its generator's device (the host on XLA, which has no generator per row)
            where = next((d.device for d in draws if d is not None), torch.device("cpu"))
            noise = torch.stack([d.to(where) if d is not None else torch.ones(self.vocab, device=where) for d in draws])
        else:
            noise = self._fill_noise(settings)
        to_device = self.runtime.to_device
        top_p: Any = to_device(torch.tensor([s.top_p for s in settings]))
        if not self.static and all(s.top_p >= 1.0 for s in settings):
            top_p = 1.0  # eager: no row cuts a nucleus, so `sample` skips the sort of the vocabulary
        args = dict(temperature=to_device(torch.tensor([s.temperature for s in settings])), top_p=top_p,
                    noise=to_device(noise))
        if greedy:
            self._greedy_args[len(settings)] = args
        return args

    def _fill_noise(self, settings: Sequence["RowSampling"]) -> torch.Tensor:
        """Eager backends: every row's Exp(1) draws (ones for greedy rows) written in place into one (rows, vocab)
        buffer kept across steps, each sampling row's from its own generator (the same values as `_exponential`:
        `_exp_draws`): no new (rows x vocab) tensor and no stacked copy per step (measured: the stack was ~4% of an
        8-row step of SmolLM2-135M on the CPU). The step reads it before the next one refills it (eager: in order)."""
        where = next((s.generator.device if s.generator is not None else torch.device("cpu")
                      for s in settings if s.temperature > 0), torch.device("cpu"))
        buf = self._noise
        if buf is None or buf.device != where or buf.size(0) < len(settings):
            buf = self._noise = torch.empty(max(self.rows, len(settings)), self.vocab, device=where)
        noise = buf[: len(settings)]
        for row, s in zip(noise, settings):
            if s.temperature > 0:
                _exp_draws(row, s.generator)
            else:
                row.fill_(1.0)
        return noise

    # --------------------------------------------------------------- the two steps
    def join(self, rows: Sequence[int], prompt: torch.Tensor, sampling: Optional[Sequence["RowSampling"]] = None,
             pad_to: Optional[int] = None, pad_id: int = 0) -> torch.Tensor:
        """Prefill the (n, T) prompts (equal lengths; one row per entry of `rows`, which must be free) into those
        rows; return their first new tokens (n,) on the device. The prompt is right-padded to the runtime's bucket
        (or `pad_to`) where it is (the host for XLA)."""
        rows = list(rows)
        n, T = prompt.shape
        if n != len(rows) or any(self.active[r] for r in rows):
            raise ValueError(f"join: {n} prompts for rows {rows} (rows in use: {[r for r in rows if self.active[r]]})")
        length = self.runtime.prompt_bucket(T, self.length) if pad_to is None else pad_to
        if not T <= length <= self.length:
            raise LitError(f"a prompt of {T} tokens padded to {length} does not fit the KV cache of {self.length}")
        if sampling is not None:
            for r, s in zip(rows, sampling):
                self.sampling[r] = s
        if length > T:
            prompt = torch.nn.functional.pad(prompt, (0, length - T), value=pad_id)
        to_device = self.runtime.to_device
        whole = rows == list(range(self.rows))
        slots = None if whole else to_device(torch.tensor(rows))  # a partial join always gathers: one graph
        # the padding carries the position after the prompt's (T): a sliding layer's ring keeps the prompt's last
        # window, and T's entry, which the padding writes, is the first decode step's to overwrite (lit_gpt.kv_cache)
        token = self.prefill_fn(
            self.model, to_device(prompt), to_device(torch.arange(length).clamp(max=T).expand(n, length)),
            to_device(torch.tensor([T - 1])), slots=slots, cache_length=length, **self.sampling_args(rows),
        )
        start = to_device(torch.full((n,), T, dtype=torch.long))
        if whole:  # in place: the next step's inputs are the same tensors
            self.tokens.copy_(token)
            self.positions.copy_(start)
            self.done.zero_()
        else:
            index = slots
            self.tokens.index_copy_(0, index, token)
            self.positions.index_copy_(0, index, start)
        for r in rows:
            self.active[r], self.next_pos[r] = True, T
        if whole:
            token = self._stop(token)
        elif self.stops is not None:
            self.done.index_copy_(0, index, (token.unsqueeze(-1) == self.stops).any(-1))
        self.runtime.end_step()
        return token

    def step(self) -> torch.Tensor:
        """Decode one token for every row up to the highest in use (all rows with `static`): (n,) on the device.
        Rows not in use compute a token that nobody reads."""
        return self.step_with(())[0]

    def step_with(self, chunks: Sequence["Chunk"]) -> Tuple[torch.Tensor, torch.Tensor]:
        """`step`, with prompt chunks riding along in the same forward (eager backends; the server's chunked
        prefill): each `Chunk`'s tokens go into its row's cache at its positions, and the token its last position
        gives is sampled with its settings. One forward (`lit_gpt.kv_cache.Ragged`): the weights are read once for
        the decode step and the chunks. A chunk's row is not in use (`join` has not run for it): when its prompt is
        in, the caller makes it active (`active`, `next_pos`, `sampling`); its token and next position are set here.
        Returns the rows' tokens (n,) and the chunks' (len(chunks),), on the device."""
        used = [r for r in range(self.rows) if self.active[r]]
        if not used:
            raise ValueError("step: no row is in use (join first)")
        if chunks and self.static:
            raise ValueError("prompt chunks ride along in eager steps only (a static step is one graph)")
        n = self.rows if self.static else used[-1] + 1
        visible = None
        if not self.static:
            need = max(self.next_pos[r] for r in used) + 1
            visible = self.visible_length(need)
        tokens = self.tokens if n == self.rows else self.tokens[:n]
        positions = self.positions if n == self.rows else self.positions[:n]
        sampling = self.sampling_args(range(n), [c.sampling for c in chunks])
        if chunks:
            ragged, chunk_rows, chunk_ends = self._ragged(tokens, positions, visible, chunks)
            token = self.decode_fn(self.model, tokens, positions.unsqueeze(1), cache_length=visible, ragged=ragged,
                                   **sampling)
        else:
            token = self.decode_fn(self.model, tokens, positions.unsqueeze(1), cache_length=visible, **sampling)
        token, riders = token[:n], token[n:]
        tokens.copy_(token)
        # the next positions; an idle row's stays inside the cache (it writes there, nobody reads it)
        positions.add_(1).clamp_(max=self.length - 1)
        for r in used:
            self.next_pos[r] += 1
        token = self._stop(token, n)
        if chunks:  # each chunk's token, at the position after it (its first decode step's, once its prompt is in)
            self.tokens.index_copy_(0, chunk_rows, riders)
            self.positions.index_copy_(0, chunk_rows, chunk_ends)
        self.runtime.end_step()
        return token, riders

    def visible_length(self, need: int) -> int:
        """The cache positions an eager forward attends over when its queries reach `need` - 1: rounded up to
        `VISIBLE_MULTIPLE` (fewer distinct shapes), at most the cache."""
        return min(self.length, -(-need // self.VISIBLE_MULTIPLE) * self.VISIBLE_MULTIPLE)

    def _ragged(self, tokens: torch.Tensor, positions: torch.Tensor, visible: int,
                chunks: Sequence["Chunk"]) -> Tuple[Ragged, torch.Tensor, torch.Tensor]:
        """The decode rows (one group of n one-token rows) and each chunk (a group of its own) end to end, from one
        transfer of the chunks' host data; the heads: every decode row, then each chunk's last token. Also the
        chunks' rows and the positions after them, on the device. A chunk's row
        may sit among the decode rows (below the highest in use): its decode write goes where the chunk starts, and
        the chunk's own write (a later group) replaces it; its decode token is not read."""
        n, width = tokens.size(0), [len(c.ids) for c in chunks]
        total, k = sum(width), len(chunks)
        ends = list(itertools.accumulate(width, initial=n))[1:]
        inside = [(c.row, c.start) for c in chunks if c.row < n]
        host = torch.tensor(
            [t for c in chunks for t in c.ids] + [c.start + i for c in chunks for i in range(len(c.ids))]
            + list(range(n)) + [e - 1 for e in ends] + [c.row for c in chunks] + [c.start + w for c, w in
                                                                                   zip(chunks, width)]
            + [r for r, _ in inside] + [s for _, s in inside], dtype=torch.long)
        dev = self.runtime.to_device(host)
        ids, pos, heads, rows, chunk_ends, inside_rows, inside_starts = dev.split(
            [total, total, n + k, k, k, len(inside), len(inside)])
        if inside:
            positions.index_copy_(0, inside_rows, inside_starts)
        groups = [RaggedGroup(0, n, 1, positions.unsqueeze(1), None, visible)]
        for i, (c, w, end) in enumerate(zip(chunks, width, ends)):
            groups.append(RaggedGroup(end - w, 1, w, pos[end - w - n:end - n].view(1, w), rows[i:i + 1],
                                      self.visible_length(c.start + w)))
        ragged = Ragged(groups, torch.cat((tokens, ids)).unsqueeze(0), torch.cat((positions, pos)).unsqueeze(0),
                        heads=heads, owners=[(r, 1) for r in range(n)] + [(c.row, w) for c, w in zip(chunks, width)])
        return ragged, rows, chunk_ends

    def _stop(self, token: torch.Tensor, n: Optional[int] = None) -> torch.Tensor:
        """With stop ids: a row that stopped repeats the first stop id, and its flag is set (on the device)."""
        if self.stops is None:
            return token
        done = self.done if n is None or n == self.rows else self.done[:n]
        token = torch.where(done, self.stops[0], token)
        done.copy_(done | (token.unsqueeze(-1) == self.stops).any(-1))
        return token

    def all_done(self) -> bool:
        """Whether every row has produced a stop id (a host read of the flags)."""
        return bool(self.done.cpu().all())


class Chunk(NamedTuple):
    """A prompt chunk that rides along in a decode step (`Batch.step_with`): tokens `ids` at positions `start`,
    `start + 1`, ... of cache row `row`, and the settings of the token sampled from its last position."""

    row: int
    ids: Sequence[int]
    start: int
    sampling: "RowSampling"


class RowSampling(NamedTuple):
    """One row's sampling settings in a `Batch` (temperature 0: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: Optional[torch.Generator] = None


def _exponential(vocab: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """A row's Exp(1) draws for `sample`'s race, from its own generator, on that generator's device."""
    device = generator.device if generator is not None else torch.device("cpu")
    return _exp_draws(torch.empty(vocab, device=device), generator)


def _exp_draws(out: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Exp(1) draws written into `out` in place: -log(U), U ~ U[0, 1) (P(-log U > x) = e^-x). On the CPU this is
    ~5x cheaper than `exponential_` (measured: 8 rows of 49152 draws 2.1 ms against 11.3 ms, 1 thread), which a
    sampled batch pays every step for every sampling row. U = 0 gives +inf, a draw that cannot win the race (never
    0, which would let a token of probability 0 win)."""
    return out.uniform_(generator=generator).log_().neg_()


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

    The loop is a `Batch` that every row joins at once. `model` may be wrapped (Fabric, FSDP): its forward runs,
    the caches go to the inner `GPT`. The `runtime` (default: `default_runtime`, CPU/CUDA on the weights' device)
    says where tensors go and what differs per backend: on XLA (`XLARuntime`, required there) the prompt is
    right-padded *on the host* to a power-of-two bucket before the transfer and every step ends the lazy graph, so
    the prefill compiles once per bucket and the decode step once; chunks reach the host as transfers, never as new
    graphs. `pad_to` and `max_seq_length` override the bucket and the KV-cache length.

    Generation ends after `max_new_tokens` steps or once every row has produced one of `stop_ids`. The stop flag
    lives on the device and is computed inside each step; the host reads it once per chunk (the only
    synchronisation in the loop), so a chunk of n steps costs up to n - 1 wasted steps after a stop but fewer
    syncs. The step in which the last row stops is not yielded (a single sequence never contains its stop
    token); in a batch, a row that stopped earlier holds its stop token and then the first stop id: cut each row
    at its first stop id.

    `decode_fn` / `prefill_fn` replace the two steps, e.g. with the compiled ones of `compile_steps` (then every
    step keeps the shapes of the whole cache)."""
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
    compiled = decode_fn is not decode_one_token or prefill_fn is not prefill
    batch = Batch(model, B, cache, runtime=runtime, static=runtime.compiles_graphs or compiled,
                  exact_length=max_seq_length is not None, stop_ids=stop_ids,
                  uniform=dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator),
                  decode_fn=decode_fn, prefill_fn=prefill_fn)
    chunk: List[torch.Tensor] = []
    for step in range(max_new_tokens):
        token = batch.join(range(B), prompt, pad_to=length, pad_id=pad_id) if step == 0 else batch.step()
        chunk.append(token)
        if step < 2 or len(chunk) == every or step == max_new_tokens - 1:
            out = runtime.to_host(chunk)
            chunk = []
            if batch.stops is not None and batch.all_done():
                # the first step after which every row has stopped; rows stopped in an earlier chunk hold stop ids
                st = batch.stops if out.device == batch.stops.device else batch.stops_host.to(out.device)
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
