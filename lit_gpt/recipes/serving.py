"""Continuous batching for the server (serve/base.py): requests share one `lit_gpt.generate.Batch`, the loop the
generation recipes run. A request takes a free row at the next step boundary; its prompt is prefilled there in
chunks (below); every decode step serves every request whose prompt is in; a request leaves as soon as it ends (a
stop token, a stop string, `max_tokens`, or its client gone), freeing its row for the next one.

    engine = Engine(loaded, slots=8, max_seq_length=2048, max_queue=64)    # loaded: recipes.evaluate.EvalModel
    engine.warm_up()                                   # XLA: compiles every graph the serving loop will run
    job = Job(prompt_ids, max_tokens=64, sampling=RowSampling(0.7, 0.9, generator), ..., emit=callback)
    engine.submit([job])                               # any thread; QueueFull past max_queue
    engine.run(should_stop)                            # the thread that owns the device (the main thread)

`emit` receives `("text", str)` as text becomes final and then `("end", finish_reason, completion_tokens)`, on the
engine's thread: the HTTP layer (lit_gpt.recipes.openai_api) hands them to its event loop.

Chunked prefill, scheduled with decode (as Sarathi-Serve and vLLM do it): each step boundary takes at most
`prefill_chunk` prompt tokens (the waiting prompts', first come first served) and decodes a token for the rows whose
prompts are in, so a long prompt delays the streams in flight by one chunk per boundary, not by its whole prefill.
On eager backends the chunks ride along in the decode step's forward (`Batch.step_with`, `lit_gpt.kv_cache.Ragged`:
the weights are read once per boundary; a prompt's last chunk gives its first token). On static backends (XLA), and
for a prompt whose every position is scored (`echo`), they are a prefill call of their own before the decode step.
With no row decoding, nobody is delayed: whole prompts (up to `max_seq_length` tokens). A row part-way through its
prompt sits in the decode step like an idle row: its step writes at the position its next chunk starts at
(overwritten by that chunk) and its token is not read.

Paged KV memory (`--kv_cache_tokens`, default slots x max_seq_length; lit_gpt/recipes/kv_blocks.py): the rows share
a pool of `PREFIX_BLOCK`-token blocks through a block table. A request takes the lowest free row once the blocks of
its prompt + max_tokens are there, else it waits at the head of the queue. Prefix caching is block sharing: a
prompt's leading full blocks that another request computed (in flight, ended, or prefilling them, which it waits for)
are shared with reference counts, and stay cached after their requests end until an allocation evicts them. The
prompt's last token is always computed (its logits give the first new token); a request that scores its prompt
(`echo` with `logprobs`) computes all of it. `stats` counts the prompt tokens computed (`prefill_tokens`) and reused
(`cached_tokens`).

Scores (a job with `logprobs`): every step that serves such a job also returns, per row, the log-probability of
the token it took and the `MAX_LOGPROBS` most likely tokens with theirs (log-softmax of the model's logits, before
temperature or top-p: what OpenAI and vLLM report); a job with `echo_scores` gets its prompt's too, from prefill
calls that keep the logits of every prompt position. They are read on the host with the step's tokens and kept on
the job (`scores`, `prompt_scores`) for the HTTP layer; a job with `max_tokens` 0 ends after its prefill (a prompt
scored, nothing generated). On static backends the scores are part of every step's graph (one graph, whoever asks).

Shapes on XLA: the rows, the cache length and the prefill call ((`STATIC_PREFILL_ROWS`, `prefill_chunk`), unused
rows padded) are fixed and every step runs all rows with per-row sampling settings (greedy rows included), so after
`warm_up` (the prefill call, the same keeping every position's scores and the decode step: three graphs; the block
table is an input, the same shape whatever it holds) nothing compiles. On the CPU and GPUs a step runs the rows up
to the highest in use and the cache positions in use (`Batch`), and a prefill call the rows and chunk lengths it has.

A model with sliding-window layers whose cache is a ring (`lit_gpt.kv_cache`) keeps only a window per row. Its
prompts are prefilled in chunks too, on every backend (a chunk attends over the ring as it was and its own keys,
then keeps the last window; on XLA in the fixed-shape prefill call every model has). A row part-way through its
prompt sits through one decode step between its chunks, whose write lands at the position its next chunk starts at:
that ring entry holds the one position that left the window of every later query, so no entry still in use is
overwritten (first come first served, a prompt part-way through gets a chunk at every boundary: its position never
moves on past that). Prefix caching stays off: a
ring entry holds position p mod window, so what a row holds is the last window of its tokens, not a prefix another
prompt could reuse: rings are not paged (--kv_cache_tokens refused in one line).
"""

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from lit_gpt.generate import Batch, Chunk, RowSampling, step_logits, unwrap
from lit_gpt.lora_bank import select_adapters
from lit_gpt.recipes.kv_blocks import paging
from lit_gpt.recipes.prefix_cache import PREFIX_BLOCK, block_hashes, shared_blocks
from lit_gpt.recipes.serve_tokens import MAX_LOGPROBS, Score, new_generator  # noqa: F401 (re-exported)
from lit_gpt.recipes.serve_tokens import partial_stop, read_scores, score_tokens
from lit_gpt.sampling import sample
from lit_gpt.utils import LitError

DEFAULT_PREFILL_CHUNK = 32
"""Prompt tokens per step boundary while rows decode, chosen by measurement (bench/prefill_chunk.py, results in
bench/results/serve_prefill_chunk_cpu.json: SmolLM2-135M, fp32, 2 CPU threads, 4 rows decoding while 2 prompts of
2,000 tokens come in, chunks riding along): a boundary's p50 / p90 against a decode step alone was 1.9x / 2.3x at
16 tokens, 2.2x / 2.8x at 32, 2.9x / 3.6x at 48. 32 keeps a boundary within 3x of a decode step (the burst's target)
with room for the HTTP layer, and prefills nearly twice as many prompt tokens per second as 16."""
STATIC_PREFILL_ROWS = 4  # rows of the prefill call on a static backend (fixed; unused ones padded)


class QueueFull(Exception):
    """More requests wait than the server's bound (`--max_queue`): answered with HTTP 429."""


@dataclass
class Job:
    """One completion (one of a request's `n` choices) and what the engine needs to run and end it."""

    prompt_ids: List[int]
    max_tokens: int
    emit: Callable[..., None]
    sampling: RowSampling = field(default_factory=RowSampling)
    stop_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    logprobs: Optional[int] = None
    """Alternatives per token (0..MAX_LOGPROBS) to keep with each generated token's score; None: no scores."""
    echo_scores: bool = False
    """Also score the prompt (its first token has none: nothing precedes it)."""
    cancelled: bool = False
    """Set from any thread (the client went away): the job leaves at the next step boundary, nothing more sent."""
    generated_ids: List[int] = field(default_factory=list)
    submitted: float = 0.0  # perf_counter at `submit`, and at the job's last token: its latencies (metrics)
    last_token_at: float = 0.0
    scores: List[Score] = field(default_factory=list)
    """With `logprobs`: a score per generated token (a stop token, which ends the job unseen, has none)."""
    prompt_scores: Optional[List[Score]] = None
    """With `echo_scores`: a score per prompt token after the first."""
    adapter: int = 0  # its LoRA adapter's id (0: the base; recipes.serve_loras): its row's weights, its hashes' key
    # the engine's bookkeeping
    row: Optional[int] = None
    generated: int = 0
    held: str = ""
    decoder: Any = None
    prefilling: bool = False
    done_pos: int = 0  # prompt tokens whose keys/values are in the row (computed or reused)
    order: int = 0  # admission order: prompts are prefilled first come first served
    pending: int = 0  # the last token taken, which the next decode step feeds
    hashes: List[int] = field(default_factory=list)  # the prompt's hash chain (one per full PREFIX_BLOCK)


class Engine:
    """The serving loop: one `Batch` of `slots` rows over a KV cache of `max_seq_length` positions each, a bounded
    queue of jobs waiting for a row, and the loop that admits, prefills (in chunks of at most `prefill_chunk`
    tokens, 0: whole prompts), steps and ends them (`run`, on one thread); `prefix_cache` reuses the keys/values of
    shared prompt prefixes."""

    def __init__(self, loaded: Any, slots: int, max_seq_length: int, max_queue: int,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefix_cache: bool = True,
                 log: Callable[[str], None] = lambda line: None, kv_cache_tokens: Optional[int] = None,
                 prefill_with_decode: bool = True) -> None:
        if slots < 1:
            raise LitError(f"--slots must be >= 1, got {slots}")
        if max_queue < 0:
            raise LitError(f"--max_queue must be >= 0, got {max_queue}")
        if prefill_chunk < 0:
            raise LitError(f"--prefill_chunk must be >= 0 (0: whole prompts), got {prefill_chunk}")
        block_size = loaded.block_size
        if not 1 < max_seq_length <= block_size:
            raise LitError(f"--max_seq_length must be between 2 and the model's context ({block_size}),"
                           f" got {max_seq_length}")
        self.loaded, self.tokenizer, self.runtime = loaded, loaded.tokenizer, loaded.runtime
        self.slots, self.max_seq_length, self.max_queue = slots, max_seq_length, max_queue
        self.log = log
        self.static = bool(self.runtime.compiles_graphs)
        # the step's scores (device tensors, see _score), computed when a job in flight wants them (always when
        # static: one graph)
        self.scoring = self.static
        self.scores: Optional[Tuple[torch.Tensor, ...]] = None
        self.prompt_scores: Optional[Tuple[torch.Tensor, ...]] = None
        self.kv = paging(unwrap(loaded.model), slots, max_seq_length, kv_cache_tokens, PREFIX_BLOCK)
        paged = (self.kv.blocks, PREFIX_BLOCK) if self.kv is not None else None
        # the most tokens (prompt + max_tokens) one request may have: a row's positions, or the pool's blocks
        self.request_tokens = min(max_seq_length, self.kv.row_limit * PREFIX_BLOCK) if self.kv else max_seq_length
        with self.runtime.inference_context():
            self.batch = Batch(loaded.model, slots, max_seq_length, runtime=self.runtime, static=self.static,
                               exact_length=True, decode_fn=self._decode, paged=paged)
        self.chunk = min(prefill_chunk or max_seq_length, max_seq_length)
        self.prefix_cache = prefix_cache
        self.prefill_rows = min(slots, STATIC_PREFILL_ROWS) if self.static else slots
        # eager backends: a boundary's chunks ride along in the decode step's forward (one read of the weights);
        # a static one runs its fixed prefill graph, then the decode graph
        self.ride_along = prefill_with_decode and not self.static
        self.ring = any(getattr(b.attn.kv_cache, "ring", None) for b in self.batch.gpt.transformer.h)
        if self.ring:  # sliding-window rings: see the module's docstring. Nothing shared
            self.prefix_cache = False
            log(f"Sliding-window ring caches: prefix caching is off, prompts prefilled in chunks of {self.chunk}")
        self.jobs: List[Optional[Job]] = [None] * slots
        self.waiting: Deque[Job] = collections.deque()
        self.lock = threading.Condition()
        self.tasks: Deque[Callable[[], None]] = collections.deque()  # other threads' device work, between steps
        # the tokens whose keys/values each row holds (its first len(...) positions)
        self.row_tokens: List[List[int]] = [[] for _ in range(slots)]
        self.admissions = 0
        self.blocked = False  # the head of the queue waits for KV blocks (free rows take nobody then)
        self.stats = self.new_stats()
        self.warm_compiles = self.runtime.compile_count()
        self.metrics: Any = None  # lit_gpt.recipes.serve_metrics.ServeMetrics once serving (not in the warm-up)

    def kv_blocks(self) -> Dict[str, int]:
        """The paged KV cache's blocks (/health, /metrics; read from any thread): all (but scratch), those rows hold,
        and those cached for their prefix (held by nobody); zeros when unpaged."""
        return self.kv.counts() if self.kv is not None else dict.fromkeys(("kv_blocks", "kv_blocks_in_use",
                                                                           "kv_blocks_cached"), 0)

    @staticmethod
    def new_stats() -> Dict[str, int]:
        return {"steps": 0, "tokens": 0, "admitted": 0, "prefill_calls": 0, "prefill_tokens": 0, "cached_tokens": 0}

    def compiles_since_warm_up(self) -> int:
        """Graphs compiled after the warm-up (XLA; 0 on eager backends): what a request may have waited for."""
        return self.runtime.compile_count() - self.warm_compiles

    # ----------------------------------------------------------------- from the HTTP threads
    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue jobs (a request's choices, all or none); raises QueueFull when they would pass the bound."""
        for job in jobs:
            if len(job.prompt_ids) + job.max_tokens > self.request_tokens:
                raise LitError(f"a prompt of {len(job.prompt_ids)} tokens + max_tokens {job.max_tokens} is more than"
                               f" this server's KV cache holds for one request ({self.request_tokens} tokens)")
        with self.lock:
            # the free rows take waiting jobs at the next step boundary, unless the head of the queue waits for blocks
            taken = 0 if self.blocked and self.waiting else self.free_rows()
            if len(self.waiting) + len(jobs) > self.max_queue + taken:
                raise QueueFull(f"{len(self.waiting)} requests are waiting for a free slot or KV blocks (--max_queue"
                                f" {self.max_queue}): retry later")
            now = time.perf_counter()
            for job in jobs:
                job.submitted = now
            self.waiting.extend(jobs)
            self.lock.notify()

    def free_rows(self) -> int:
        return sum(job is None for job in self.jobs)

    def positions_in_use(self) -> int:
        """KV cache positions the jobs in flight have written (a gauge of /metrics; read from any thread)."""
        return sum(len(self.row_tokens[r]) for r, job in enumerate(list(self.jobs)) if job is not None)

    def busy(self) -> bool:
        with self.lock:
            return bool(self.waiting) or any(job is not None for job in self.jobs)

    # ----------------------------------------------------------------- the loop (the device's thread)
    def run(self, should_stop: Callable[[], bool], idle_wait: float = 0.05) -> None:
        """Admit, step and end jobs until `should_stop()` is true and nothing is in flight or waiting."""
        with self.runtime.inference_context():
            while True:
                while self.tasks:
                    self.tasks.popleft()()
                with self.lock:
                    if not self.waiting and all(job is None for job in self.jobs):
                        if should_stop():
                            return
                        self.lock.wait(idle_wait)
                        continue
                self.iterate()

    def iterate(self) -> None:
        """One step boundary: drop cancelled jobs, give waiting ones free rows, one prefill call for the prompts
        not yet in (a chunk each), then one decode step for the rows whose prompts are in."""
        for row, job in enumerate(self.jobs):
            if job is not None and job.cancelled:
                self._leave(row)
        while True:
            with self.lock:  # the row is taken under the lock: `submit` counts free rows and waiting jobs
                free = [r for r, job in enumerate(self.jobs) if job is None]
                job = self.waiting[0] if free and self.waiting else None
                row = None
                if job is not None and not job.cancelled:
                    row = self._pick_row(job, free)
                    self.blocked = row is None
                    if row is None:  # not enough KV blocks yet: the head of the queue waits, and those behind it
                        break
                    self.jobs[row] = job
                if job is not None:
                    self.waiting.popleft()
            if job is None:
                break
            if row is None:
                if self.metrics is not None:
                    self.metrics.finished.labels("cancelled").inc()
                continue
            self._admit(job, row)
        plan = self._plan_prefill()
        rows = self._decoding()
        if plan and rows and self._rides(plan):  # the chunks ride along in the decode step's forward
            self._step(rows, plan)
            return
        if plan:  # nobody decodes (whole prompts), a static backend, or prompts whose scores are asked for
            self._run_chunk(plan)
            rows = self._decoding()  # with the rows whose prompts just came in
        if rows:
            self._step(rows, [])

    def _decoding(self) -> List[int]:
        return [r for r, job in enumerate(self.jobs) if job is not None and not job.prefilling]

    def _rides(self, plan: List[Tuple[int, int, int]]) -> bool:
        """Whether this boundary's chunks go in the decode step's forward (`Batch.step_with`): on eager backends
        (`ride_along`), unless a chunk's prompt is scored (its every position's logits: a prefill call of its own)."""
        return self.ride_along and not any(self.jobs[r].echo_scores for r, _, _ in plan)

    def _step(self, rows: List[int], plan: List[Tuple[int, int, int]]) -> None:
        """One decode step for `rows` (the rows whose prompts are in), with `plan`'s prompt chunks riding along."""
        finishing = [e == len(self.jobs[r].prompt_ids) for r, _, e in plan]
        wanted = any(self.jobs[r].logprobs is not None for r in rows) or any(
            f and self.jobs[r].logprobs is not None for (r, _, _), f in zip(plan, finishing))
        self.scoring = self.static or wanted
        for r in rows:  # this step writes the pending token's keys/values into the row
            self.row_tokens[r].append(self.jobs[r].pending)
        if self.kv is not None:  # rows that ended: scratch in the device's table; the chunks' rows: their blocks
            for r, _, _ in plan:
                self.kv.publish(r)
            self.kv.sync(self.batch.set_block_table)
        if plan:
            chunks = [Chunk(r, self.jobs[r].prompt_ids[s:e], s, self.jobs[r].sampling if f else RowSampling())
                      for (r, s, e), f in zip(plan, finishing)]
            token, riders = self.batch.step_with(chunks)
            tokens = torch.cat((token, riders)).tolist()  # the one host read per step: every row's new token
        else:
            tokens = self.batch.step().tolist()
        scores = read_scores(self.scores) if wanted else None
        self.stats["steps"] += 1
        for row in rows:
            self._take(row, tokens[row], scores[row] if scores is not None else None)
        if plan:
            n = len(tokens) - len(plan)
            self._chunks_done(plan, finishing, tokens[n:], scores[n:] if scores is not None else None, None)

    # ----------------------------------------------------------------- admission and the prefix cache
    def _pick_row(self, job: Job, free: List[int]) -> Optional[int]:
        """The lowest free row (which, on eager backends, keeps the decode step to the fewest rows) with the KV
        blocks of the job's prompt + max_tokens, sharing the registered blocks of its prompt's prefix (`done_pos`:
        the tokens they hold); None when the blocks are not there yet."""
        row = free[0]
        if self.kv is None:
            return row
        if self.prefix_cache:
            job.hashes = block_hashes(job.prompt_ids, job.adapter)
        reuse = self._reusable(job, len(job.hashes)) // PREFIX_BLOCK
        shared = self.kv.admit(row, len(job.prompt_ids) + job.max_tokens, job.hashes, job.prompt_ids, reuse)
        if shared is None:
            return None
        job.done_pos = shared * PREFIX_BLOCK
        return row

    def _reusable(self, job: Job, blocks: int) -> int:
        """Prompt tokens that `blocks` shared blocks let the job reuse: never its last token (its logits give the
        first new token), nothing for a job that scores its prompt."""
        if not self.prefix_cache or job.echo_scores:
            return 0
        return min(blocks * PREFIX_BLOCK, (len(job.prompt_ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK)

    def _admit(self, job: Job, row: int) -> None:
        job.row, job.decoder = row, self.tokenizer.stream_decoder(skip_special_tokens=True)
        job.prefilling, job.order = True, self.admissions
        self.admissions += 1
        self.stats["admitted"] += 1
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self._count_cached(job.done_pos)  # the shared blocks `_pick_row` found
        self.row_tokens[row] = list(job.prompt_ids[: job.done_pos])

    def _count_cached(self, tokens: int) -> None:
        self.stats["cached_tokens"] += tokens
        if self.metrics is not None and tokens:
            self.metrics.cached_tokens.inc(tokens)

    def _share_prefix(self, job: Job) -> None:
        """Before its first prefill call: the blocks of the job's prompt that other rows have computed since its
        admission replace its own (`BlockAllocator.share_more`)."""
        if self.kv is None or self.kv.published[job.row]:
            return
        start = job.done_pos // PREFIX_BLOCK
        n = self.kv.share_more(job.row, job.hashes, job.prompt_ids, start,
                               self._reusable(job, len(job.hashes)) // PREFIX_BLOCK) * PREFIX_BLOCK
        self._count_cached(n)
        job.done_pos += n
        self.row_tokens[job.row] = list(job.prompt_ids[: job.done_pos])

    def _waits(self, job: Job, earlier: List[Job]) -> bool:
        """Whether an earlier prompt being prefilled shares blocks with this one that it has not computed yet (this
        one waits for them rather than computing them twice)."""
        have = job.done_pos // PREFIX_BLOCK
        for other in earlier:
            shared = self._reusable(job, shared_blocks(other.hashes, job.hashes, start=have))
            if shared > job.done_pos and other.done_pos < shared:
                return True
        return False

    # ----------------------------------------------------------------- chunked prefill
    def _plan_prefill(self) -> List[Tuple[int, int, int]]:
        """This boundary's prompt chunks, (row, start, end) each: the prompts not yet in, first come first served, a
        chunk each within the budget (`chunk` tokens; whole prompts up to `max_seq_length` when no row is
        decoding)."""
        order = sorted((job for job in self.jobs if job is not None and job.prefilling), key=lambda j: j.order)
        if not order:
            return []
        decoding = any(job is not None and not job.prefilling for job in self.jobs)
        # eager backends: `chunk` tokens in all (their cost grows with the tokens); XLA: a chunk for each of the call's
        # fixed rows (the graph computes all of them whatever they hold)
        budget = self.chunk * self.prefill_rows if self.static else self.chunk if decoding else self.max_seq_length
        plan: List[Tuple[int, int, int]] = []  # (row, start, end)
        earlier: List[Job] = []
        for job in order:
            if self.prefix_cache and not job.echo_scores:
                self._share_prefix(job)
                if not (self.kv is not None and self.kv.published[job.row]) and self._waits(job, earlier):
                    earlier.append(job)
                    continue
            earlier.append(job)
            if budget > 0 and len(plan) < self.prefill_rows:
                n = min(len(job.prompt_ids) - job.done_pos, budget, self.chunk if self.static else budget)
                plan.append((job.row, job.done_pos, job.done_pos + n))
                budget -= n
        return plan

    def _run_chunk(self, plan: List[Tuple[int, int, int]]) -> None:
        """A prefill call of its own for `plan`'s chunks; each row whose prompt is then complete takes its first
        token."""
        rows = [r for r, _, _ in plan]
        width = self.chunk if self.static else max(e - s for _, s, e in plan)
        pads = []
        if self.static:  # fixed rows: the others' calls write at the end of what their rows hold (unread there)
            pads = [r for r in range(self.slots) if r not in rows][: self.prefill_rows - len(plan)]
        ids, pos, last, targets, finishing = [], [], [], [], []
        for i, (r, s, e) in enumerate(plan):
            prompt = self.jobs[r].prompt_ids
            pad = width - (e - s)
            ids.append(prompt[s:e] + [0] * pad)
            # the padding carries the position after the chunk's last (its write is the next chunk's or the first
            # decode step's to overwrite; a sliding layer's ring keeps the chunk's last window, lit_gpt.kv_cache)
            pos.append(list(range(s, e)) + [e] * pad)
            last.append(i * width + e - s - 1)
            targets.append((prompt[s + 1: e + 1] + [0] * width)[:width])
            finishing.append(e == len(prompt))
        for r in pads:
            at = min(len(self.row_tokens[r]), self.max_seq_length - 1)
            ids.append([0] * width)
            pos.append([at] * width)
            last.append((len(ids) - 1) * width)
            targets.append([0] * width)
            finishing.append(False)
        jobs = [self.jobs[r] for r in rows]
        if self.kv is not None:
            for r in rows:
                self.kv.publish(r)
            self.kv.sync(self.batch.set_block_table)
        score_prompt = any(job.echo_scores for job in jobs)
        self.scoring = self.static or any(job.logprobs is not None for job, f in zip(jobs, finishing) if f)
        settings = [job.sampling if f else RowSampling() for job, f in zip(jobs, finishing)]
        settings += [RowSampling()] * len(pads)
        to_device = self.runtime.to_device
        all_rows = rows + pads
        slots = to_device(torch.tensor(all_rows))
        starts = [e for _, _, e in plan] + [p[0] for p in pos[len(plan):]]
        # eager: the positions this call writes and reads, rounded as `Batch` rounds the decode step's
        visible = None if self.static else self.batch.visible_length(max(p[-1] for p in pos) + 1)
        select_adapters(self.batch.gpt, [self.jobs[r] for r in all_rows])  # each row's LoRA (lit_gpt.lora_bank)
        token = self._chunk_forward(to_device(torch.tensor(ids)), to_device(torch.tensor(pos)), slots,
                                    to_device(torch.tensor(last)), visible, score_prompt,
                                    to_device(torch.tensor(targets)), self.batch.sampling_args((), settings))
        # the rows' decode-step inputs: a finished prompt's first token at its next position; the others keep
        # their token, at the end of what they hold
        batch = self.batch
        done = to_device(torch.tensor(finishing))
        batch.tokens.index_copy_(0, slots, torch.where(done, token, batch.tokens.index_select(0, slots)))
        batch.positions.index_copy_(0, slots, to_device(torch.tensor(starts)))
        self.runtime.end_step()
        read = any(finishing) or score_prompt
        tokens = token.tolist() if read else None
        scores = read_scores(self.scores) if read and self.scoring and any(
            jobs[i].logprobs is not None for i, f in enumerate(finishing[: len(plan)]) if f) else None
        prompt_scores = read_scores(self.prompt_scores) if score_prompt else None
        self.prompt_scores = None
        self._chunks_done(plan, finishing, tokens, scores, prompt_scores)

    def _chunks_done(self, plan: List[Tuple[int, int, int]], finishing: List[bool], tokens: Optional[List[int]],
                     scores: Optional[List[Any]], prompt_scores: Optional[List[Any]]) -> None:
        """After a forward that took `plan`'s chunks (a prefill call, or a decode step they rode along in): what
        the rows hold, their shareable blocks, and the first token of each prompt now in (`tokens`, `scores`:
        per chunk)."""
        self.stats["prefill_calls"] += 1
        computed = sum(e - s for _, s, e in plan)
        self.stats["prefill_tokens"] += computed
        if self.metrics is not None:
            self.metrics.prefill_tokens.inc(computed)
        batch = self.batch
        for i, (r, s, e) in enumerate(plan):
            job = self.jobs[r]
            job.done_pos = e
            self.row_tokens[r].extend(job.prompt_ids[s:e])
            if self.prefix_cache and self.kv is not None:  # its full blocks computed so far: shareable
                self.kv.register(r, job.hashes[: e // PREFIX_BLOCK], job.prompt_ids)
            if job.echo_scores:
                job.prompt_scores = (job.prompt_scores or []) + prompt_scores[i][: min(e, len(job.prompt_ids) - 1) - s]
            if not finishing[i]:
                continue
            job.prefilling = False
            batch.active[r], batch.next_pos[r], batch.sampling[r] = True, e, job.sampling
            if job.max_tokens == 0:  # the prompt's scores were all it asked for
                self._end(r, "length", "")
                continue
            job.pending = tokens[i]
            self._take(r, tokens[i], scores[i] if scores is not None and job.logprobs is not None else None)

    def _chunk_forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                       visible: Optional[int], score_prompt: bool, targets: torch.Tensor,
                       sampling: Dict[str, Any]) -> torch.Tensor:
        """The prefill call's forward: (rows, width) tokens at per-row positions into cache rows `slots`, the token
        sampled from each row's logits at `last` (indices into the flattened rows x width), the scores of those
        tokens and, with `score_prompt`, of every position's next prompt token (`targets`)."""
        model = self.batch.model
        if score_prompt:
            logits = model(ids, pos, slots=slots, cache_length=visible)
            self.prompt_scores = score_tokens(logits, targets)
            logits = logits.reshape(-1, logits.size(-1)).index_select(0, last)
        else:
            logits = model(ids, pos, head_rows=last, slots=slots, cache_length=visible)
        token = sample(logits, **sampling)
        self.scores = score_tokens(logits, token) if self.scoring else None
        return token

    # --------------------------------------------------------------- the decode step, with the scores
    def _decode(self, model: Any, token: torch.Tensor, input_pos: torch.Tensor, *,
                cache_length: Optional[int] = None, ragged: Any = None, **sampling: Any) -> torch.Tensor:
        """`lit_gpt.generate.decode_one_token` (with the chunks riding along, `ragged`), keeping the scores of the
        tokens it takes."""
        if ragged is not None:  # each sequence's LoRA (lit_gpt.lora_bank), by tokens
            select_adapters(self.batch.gpt, [self.jobs[r] for r, _ in ragged.owners], [t for _, t in ragged.owners])
        else:  # each row's
            select_adapters(self.batch.gpt, self.jobs[: token.size(0)])
        logits = step_logits(model, token, input_pos, cache_length, ragged)
        token = sample(logits, **sampling)
        self.scores = score_tokens(logits, token) if self.scoring else None
        return token

    def _take(self, row: int, token: int, score: Optional[Score] = None) -> None:
        """A row's new token: end the job on a stop id, else pass on its text (held back while it might be the
        start of a stop string) and end it on a stop string or at max_tokens."""
        job = self.jobs[row]
        if job.cancelled:
            return self._leave(row)
        job.pending = token
        if token in job.stop_ids:
            return self._end(row, "stop", job.held + job.decoder.flush())
        if score is not None and job.logprobs is not None:  # a step scores every row when one row asks
            job.scores.append(score)
        job.generated_ids.append(token)
        job.generated += 1
        self.stats["tokens"] += 1
        if self.metrics is not None:
            now = time.perf_counter()
            if job.generated == 1:
                self.metrics.time_to_first_token.observe(now - job.submitted)
            else:
                self.metrics.inter_token_latency.observe(now - job.last_token_at)
            job.last_token_at = now
            self.metrics.generation_tokens.inc()
        text = job.held + job.decoder.step(token)
        if job.generated >= job.max_tokens:
            text += job.decoder.flush()
        for stop in job.stop_strings:
            at = text.find(stop)
            if at >= 0:
                return self._end(row, "stop", text[:at])
        if job.generated >= job.max_tokens:
            return self._end(row, "length", text)
        keep = partial_stop(text, job.stop_strings)
        job.held = text[len(text) - keep:] if keep else ""
        if len(text) > keep:
            job.emit("text", text[: len(text) - keep])

    def _end(self, row: int, reason: str, text: str) -> None:
        job = self.jobs[row]
        if text:
            job.emit("text", text)
        job.emit("end", reason, job.generated)
        self._leave(row, reason)

    def _leave(self, row: int, reason: str = "cancelled") -> None:
        if self.metrics is not None:
            self.metrics.finished.labels(reason).inc()
        self.batch.leave(row)
        if self.kv is not None:
            if self.prefix_cache:  # what the row holds stays reusable (its prompt and what it generated)
                self.kv.register(row, block_hashes(self.row_tokens[row], self.jobs[row].adapter), self.row_tokens[row])
            self.kv.release(row)
            self.row_tokens[row] = []
        with self.lock:
            self.jobs[row] = None

    # ----------------------------------------------------------------- warm-up
    def warm_up(self) -> Dict[str, float]:
        """Run every graph the loop will need once, so that no request waits for a compilation: on a static
        backend the prefill call (with and without the prompt's scores) and the decode step (sharing KV blocks runs
        no graph: it is the block table's entries); elsewhere one short request. Returns the compilations and the
        seconds it took."""
        t0, compiles = time.perf_counter(), self.runtime.compile_count()
        sampled = RowSampling(1.0, 0.9, torch.Generator().manual_seed(0))
        ids = [0] * min(PREFIX_BLOCK + 1, self.request_tokens - 1)

        def job(**kwargs: Any) -> Job:
            return Job(list(ids), emit=lambda *a: None, **{"max_tokens": min(2, self.request_tokens - len(ids)),
                                                             **kwargs})

        rounds = [[job(sampling=sampled)]]
        if self.static:
            rounds.append([job(max_tokens=0, logprobs=1, echo_scores=True)])
        with self.runtime.inference_context():
            for jobs in rounds:
                self.submit(jobs)
                while self.busy():
                    self.iterate()
        self.stats = self.new_stats()
        self.row_tokens = [[] for _ in range(self.slots)]
        if self.kv is not None:  # the warm-up's prompts are nobody's prefix
            self.kv.reset()
        self.warm_compiles = self.runtime.compile_count()
        return {"compiles": self.runtime.compile_count() - compiles, "seconds": time.perf_counter() - t0,
                "chunk": self.chunk, "rows": self.prefill_rows}
