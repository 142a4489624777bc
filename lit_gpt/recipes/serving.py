"""Continuous batching for the server (serve/base.py): requests share one `lit_gpt.generate.Batch`, the loop the
generation recipes run. A request joins at the next step boundary in a free row (its prompt prefilled there),
every decode step serves every request in flight, and a request leaves as soon as it ends (a stop token, a stop
string, `max_tokens`, or its client gone), freeing its row for the next one.

    engine = Engine(loaded, slots=8, max_seq_length=2048, max_queue=64)    # loaded: recipes.evaluate.EvalModel
    engine.warm_up()                                   # XLA: compiles every graph the serving loop will run
    job = Job(prompt_ids, max_tokens=64, sampling=RowSampling(0.7, 0.9, generator), ..., emit=callback)
    engine.submit([job])                               # any thread; QueueFull past max_queue
    engine.run(should_stop)                            # the thread that owns the device (the main thread)

`emit` receives `("text", str)` as text becomes final and then `("end", finish_reason, completion_tokens)`, on the
engine's thread: the HTTP layer (lit_gpt.recipes.openai_api) hands them to its event loop.

Scores (a job with `logprobs`): every step that serves such a job also returns, per row, the log-probability of
the token it took and the `MAX_LOGPROBS` most likely tokens with theirs (log-softmax of the model's logits, before
temperature or top-p: what OpenAI and vLLM report); a job with `echo_scores` gets its prompt's too, from a prefill
that keeps the logits of every prompt position. They are read on the host with the step's tokens and kept on the
job (`scores`, `prompt_scores`) for the HTTP layer; a job with `max_tokens` 0 ends after its prefill (a prompt
scored, nothing generated). On static backends the scores are part of every step's graph (one graph, whoever asks).

Shapes on XLA: the rows and the cache length are fixed, prompts are padded to power-of-two buckets, every step
runs all rows with per-row sampling settings (greedy rows included), so after `warm_up` (one prefill per bucket,
one decode step) nothing compiles. On the CPU and GPUs a step runs the rows up to the highest in use and the
cache positions in use (`Batch`).
"""

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from lit_gpt.generate import Batch, RowSampling
from lit_gpt.runtime import bucket_length
from lit_gpt.sampling import sample
from lit_gpt.utils import LitError

MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (vLLM's default bound; OpenAI's is 5)

Score = Tuple[float, List[Tuple[int, float]]]
"""One token's score: its log-probability and the most likely tokens at its position with theirs (best first)."""


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
    # the engine's bookkeeping
    row: Optional[int] = None
    generated: int = 0
    held: str = ""
    decoder: Any = None


class Engine:
    """The serving loop: one `Batch` of `slots` rows over a KV cache of `max_seq_length` positions each, a bounded
    queue of jobs waiting for a row, and the loop that admits, steps and ends them (`run`, on one thread)."""

    def __init__(self, loaded: Any, slots: int, max_seq_length: int, max_queue: int,
                 log: Callable[[str], None] = lambda line: None) -> None:
        if slots < 1:
            raise LitError(f"--slots must be >= 1, got {slots}")
        if max_queue < 0:
            raise LitError(f"--max_queue must be >= 0, got {max_queue}")
        block_size = loaded.block_size
        if not 1 < max_seq_length <= block_size:
            raise LitError(f"--max_seq_length must be between 2 and the model's context ({block_size}),"
                           f" got {max_seq_length}")
        self.loaded, self.tokenizer, self.runtime = loaded, loaded.tokenizer, loaded.runtime
        self.slots, self.max_seq_length, self.max_queue = slots, max_seq_length, max_queue
        self.log = log
        self.static = bool(self.runtime.compiles_graphs)
        # the step's scores (device tensors, see _score), computed when a job in flight wants them (always when
        # static: one graph), and whether the next prefill keeps every prompt position's logits
        self.scoring, self.score_prompt = self.static, False
        self.scores: Optional[Tuple[torch.Tensor, ...]] = None
        self.prompt_scores: Optional[Tuple[torch.Tensor, ...]] = None
        with self.runtime.inference_context():
            self.batch = Batch(loaded.model, slots, max_seq_length, runtime=self.runtime, static=self.static,
                               exact_length=True, decode_fn=self._decode, prefill_fn=self._prefill)
        self.jobs: List[Optional[Job]] = [None] * slots
        self.waiting: Deque[Job] = collections.deque()
        self.lock = threading.Condition()
        self.stats = {"steps": 0, "tokens": 0, "admitted": 0}
        self.warm_compiles = self.runtime.compile_count()
        self.metrics: Any = None  # lit_gpt.recipes.serve_metrics.ServeMetrics once serving (not in the warm-up)

    def compiles_since_warm_up(self) -> int:
        """Graphs compiled after the warm-up (XLA; 0 on eager backends): what a request may have waited for."""
        return self.runtime.compile_count() - self.warm_compiles

    # ----------------------------------------------------------------- from the HTTP threads
    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue jobs (a request's choices, all or none); raises QueueFull when they would pass the bound."""
        with self.lock:
            if len(self.waiting) + len(jobs) > self.max_queue + self.free_rows():
                raise QueueFull(f"{len(self.waiting)} requests are waiting for a free slot (--max_queue"
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
        return sum(self.batch.next_pos[r] for r, job in enumerate(list(self.jobs)) if job is not None)

    def busy(self) -> bool:
        with self.lock:
            return bool(self.waiting) or any(job is not None for job in self.jobs)

    # ----------------------------------------------------------------- the loop (the device's thread)
    def run(self, should_stop: Callable[[], bool], idle_wait: float = 0.05) -> None:
        """Admit, step and end jobs until `should_stop()` is true and nothing is in flight or waiting."""
        with self.runtime.inference_context():
            while True:
                with self.lock:
                    if not self.waiting and all(job is None for job in self.jobs):
                        if should_stop():
                            return
                        self.lock.wait(idle_wait)
                        continue
                self.iterate()

    def iterate(self) -> None:
        """One step boundary: drop cancelled jobs, admit waiting ones into free rows, then one decode step."""
        for row, job in enumerate(self.jobs):
            if job is not None and job.cancelled:
                self._leave(row)
        while True:
            with self.lock:  # the row is taken under the lock: `submit` counts free rows and waiting jobs
                free = [r for r, job in enumerate(self.jobs) if job is None]
                job = self.waiting.popleft() if free and self.waiting else None
                if job is not None and not job.cancelled:
                    self.jobs[free[0]] = job
            if job is None:
                break
            if job.cancelled:
                if self.metrics is not None:
                    self.metrics.finished.labels("cancelled").inc()
                continue
            self._admit(job, free[0])
        rows = [r for r, job in enumerate(self.jobs) if job is not None]
        if not rows:
            return
        wanted = any(self.jobs[r].logprobs is not None for r in rows)
        self.scoring = self.static or wanted
        tokens = self.batch.step().tolist()  # the one host read per step: every row's new token
        scores = _read_scores(self.scores) if wanted else None
        self.stats["steps"] += 1
        for row in rows:
            self._take(row, tokens[row], scores[row] if scores is not None else None)

    def _admit(self, job: Job, row: int) -> None:
        job.row, job.decoder = row, self.tokenizer.stream_decoder(skip_special_tokens=True)
        self.stats["admitted"] += 1
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        prompt = torch.tensor([job.prompt_ids], dtype=torch.long)
        pad_to = bucket_length(prompt.size(1), self.max_seq_length) if self.static else None
        self.scoring = self.static or job.logprobs is not None
        self.score_prompt = job.echo_scores
        try:
            token = self.batch.join([row], prompt, sampling=[job.sampling], pad_to=pad_to)
        finally:
            self.score_prompt = False
        if job.echo_scores:
            job.prompt_scores = _read_scores(self.prompt_scores)[0][: len(job.prompt_ids) - 1]
            self.prompt_scores = None
        if job.max_tokens == 0:  # the prompt's scores were all it asked for
            return self._end(row, "length", "")
        scores = _read_scores(self.scores)[0] if job.logprobs is not None else None
        self._take(row, int(token.cpu()[0]), scores)

    # --------------------------------------------------------------- the two steps, with the scores
    def _prefill(self, model: Any, prompt: torch.Tensor, input_pos: torch.Tensor, last: torch.Tensor, *,
                 slots: Optional[torch.Tensor] = None, cache_length: Optional[int] = None,
                 **sampling: Any) -> torch.Tensor:
        """`lit_gpt.generate.prefill`, keeping the scores: of the first new token, and with `score_prompt` of every
        prompt token given the ones before it (then the logits of every position are computed, not the last
        only)."""
        if self.score_prompt:
            logits = model(prompt, input_pos, slots=slots, cache_length=cache_length)
            self.prompt_scores = _score(logits[:, :-1], prompt[:, 1:])  # position t scores token t + 1
            logits = logits.index_select(1, last)[:, -1]
        else:
            logits = model(prompt, input_pos, last_only=last, slots=slots, cache_length=cache_length)[:, -1]
        token = sample(logits, **sampling)
        self.scores = _score(logits, token) if self.scoring else None
        return token

    def _decode(self, model: Any, token: torch.Tensor, input_pos: torch.Tensor, *,
                cache_length: Optional[int] = None, **sampling: Any) -> torch.Tensor:
        """`lit_gpt.generate.decode_one_token`, keeping the scores of the tokens it takes."""
        logits = model(token.view(-1, 1), input_pos, cache_length=cache_length)[:, -1]
        token = sample(logits, **sampling)
        self.scores = _score(logits, token) if self.scoring else None
        return token

    def _take(self, row: int, token: int, score: Optional[Score] = None) -> None:
        """A row's new token: end the job on a stop id, else pass on its text (held back while it might be the
        start of a stop string) and end it on a stop string or at max_tokens."""
        job = self.jobs[row]
        if job.cancelled:
            return self._leave(row)
        if token in job.stop_ids:
            return self._end(row, "stop", job.held + job.decoder.flush())
        if score is not None:
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
        keep = _partial_stop(text, job.stop_strings)
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
        with self.lock:
            self.jobs[row] = None

    # ----------------------------------------------------------------- warm-up
    def prompt_buckets(self) -> List[int]:
        """The padded prompt lengths a static backend compiles a prefill for."""
        buckets, b = [], bucket_length(1, self.max_seq_length)
        while True:
            buckets.append(b)
            if b >= self.max_seq_length:
                return buckets
            b = bucket_length(b + 1, self.max_seq_length)

    def warm_up(self) -> Dict[str, float]:
        """Run every graph the loop will need once, so that no request waits for a compilation: on a static
        backend a prefill per prompt bucket and the decode step; elsewhere one short request. Returns the
        compilations and the seconds it took."""
        t0, compiles = time.perf_counter(), self.runtime.compile_count()
        lengths = self.prompt_buckets() if self.static else [1]
        sampled = RowSampling(1.0, 0.9, torch.Generator().manual_seed(0))
        with self.runtime.inference_context():
            for i, length in enumerate(lengths):
                ids = [0] * min(length, self.max_seq_length - 1)
                jobs = [Job(ids, max_tokens=2, emit=lambda *a: None, sampling=sampled if i == 0 else RowSampling())]
                if self.static:  # a prompt scored (echo with logprobs) is another prefill graph per bucket
                    jobs.append(Job(ids, max_tokens=0, emit=lambda *a: None, logprobs=1, echo_scores=True))
                for job in jobs:
                    self.submit([job])
                    while self.busy():
                        self.iterate()
        self.stats = {"steps": 0, "tokens": 0, "admitted": 0}
        self.warm_compiles = self.runtime.compile_count()
        return {"compiles": self.runtime.compile_count() - compiles, "seconds": time.perf_counter() - t0,
                "buckets": len(lengths)}


def _score(logits: torch.Tensor, chosen: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities (float32) of the `chosen` tokens under `logits` (..., vocab), and the MAX_LOGPROBS most
    likely tokens' (values, ids), best first; on the device, no host read."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(MAX_LOGPROBS, logp.size(-1)), dim=-1)
    return logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1), top.values, top.indices


def _read_scores(scores: Tuple[torch.Tensor, ...]) -> List[Any]:
    """`_score`'s tensors on the host as Scores, one per row (a list of Scores per row for (rows, T) inputs)."""
    chosen, values, ids = (t.cpu().tolist() for t in scores)

    def rows(c: Any, v: Any, i: Any) -> Any:
        if isinstance(c, list):
            return [rows(*x) for x in zip(c, v, i)]
        return (c, list(zip(i, v)))

    return rows(chosen, values, ids)


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could begin a stop string (held back until the next token says)."""
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), keep, -1):
            if text.endswith(stop[:k]):
                keep = k
                break
    return keep


def new_generator(seed: Optional[int], device: torch.device, on_host: bool) -> torch.Generator:
    """A request's own generator: seeded by the request's `seed`, else from the OS. On the device where draws are
    cheap (CPU, CUDA); on the host where the device has none of its own (XLA: the draws are transferred)."""
    where = torch.device("cpu") if on_host else device
    return torch.Generator(device=where).manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
