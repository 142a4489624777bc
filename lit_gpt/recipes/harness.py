"""Our model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`), so every harness task runs on a
lit checkpoint without converting it to transformers first. `eval/lm_eval.py` is the recipe around it.

What the harness asks, and how it is answered:
* `loglikelihood(context, continuation)`: tokenized as the harness's `--model hf` backend (HFLM) tokenizes them
  (`TemplateLM._encode_pair`: the pair encoded whole, then split after the context's tokens; an empty context gets
  the BOS id, else EOS). Requests are ordered and grouped with the harness's own `Collator` (longest first;
  requests that differ only in a one-token continuation share one row), right-padded and scored in one forward per
  batch. The device returns only what is scored: the log-probability of every target token, whether it was the
  greedy one, and the whole log-softmax row at each row's last position (for the rows' shared one-token
  continuations); never the (B, T, vocab) logits.
* `loglikelihood_rolling(text)`: the harness's disjoint rolling windows (`lm_eval.utils.get_rolling_token_windows`,
  `make_disjoint_window`) of at most `block_size` tokens, scored as above and summed per text in window order.
* `generate_until(context, gen_kwargs)`: the project's one generation loop (`lit_gpt.generate.Batch`, the server's
  continuous batch): every request a row of one batch of `batch_size` rows (one batch per sampling setting), each
  row with its own prompt length, positions, stop strings and `max_gen_toks`; a request joins a free row (its
  prompt prefilled there), every step decodes one token for every row, and a request leaves once its text holds a
  stop string, it produced a stop token or `max_gen_toks` tokens. Requests start longest first (as HFLM orders
  them); texts are cut at the first stop string, as HFLM cuts them. Greedy unless the task asks for sampling.
* Chat templates (`--apply_chat_template`): `apply_chat_template` renders the harness's chat history with the
  checkpoint's template as transformers does (`lit_gpt.prompts.ChatTemplate`), or with a named prompt style.
* Several processes (`--devices N`): `rank` / `world_size`, and the harness's `all_gather`, `gather_object`,
  `barrier` over the gloo group eval/lm_eval.py starts; the harness splits the examples and gathers the results.
* On a tracing backend (XLA) the shapes are bucketed: a scoring batch is padded to `batch_size` rows and its
  length to a power of two (`lit_gpt.runtime.bucket_length`), so the scoring step compiles once per length bucket;
  generation joins a prompt padded to its bucket (one prefill graph per bucket) into a batch whose KV cache has a
  power-of-two length (one decode graph): after the warm-up, nothing compiles (`compiles_per_bucket` counts it).
"""

import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from lit_gpt.generate import Batch, unwrap
from lit_gpt.runtime import Runtime, bucket_length
from lit_gpt.utils import LitError

Pair = Tuple[Optional[Tuple[str, str]], List[int], List[int]]  # (strings or None, context ids, continuation ids)
SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p")


@torch.no_grad()
def score_step(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, last: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scoring forward of a (B, L) batch. `targets` (B, L): the token each position predicts. `rows`: the
    flattened positions to score (None: all; eager backends skip the unscored ones' vocabulary head). `last` (B,):
    each row's last scored position, as an index into the scored positions.

    Returns (log-prob of each scored position's target, whether it is the argmax, the log-softmax rows at `last`
    (B, vocab), their argmax (B,)), all float32 log-probabilities."""
    if rows is None:
        logits = model(inputs).flatten(0, 1)
        targets = targets.reshape(-1)
    else:
        logits = model(inputs, head_rows=rows)
        targets = targets.reshape(-1).index_select(0, rows)
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # log-softmax = logits - lse, taken where needed: no 2nd (N, vocab) tensor
    token_logp = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    greedy = logits.argmax(dim=-1) == targets
    last_rows = logits.index_select(0, last) - lse.index_select(0, last).unsqueeze(1)
    return token_logp, greedy, last_rows, last_rows.argmax(dim=-1)


class LitLM(TemplateLM):
    """A lit_gpt `GPT` (possibly Fabric-wrapped, on its device) and its `lit_gpt.tokenizer.Tokenizer` as a harness
    model. `runtime`: `lit_gpt.runtime.Runtime` (CPU/CUDA, the default) or `lit_gpt.xla.runtime.XLARuntime` (then
    shapes are bucketed). `batch_size`: rows per forward (and per generation batch)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, runtime: Optional[Runtime] = None,
                 batch_size: int = 1, max_gen_toks: int = 256, name: str = "lit_gpt", seed: int = 1234,
                 progress: bool = True, prompt_style: Optional[Any] = None, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        if int(batch_size) < 1:
            raise LitError(f"--batch_size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.gpt = unwrap(model)
        self.tokenizer = tokenizer
        self.runtime = runtime or Runtime(None, self.gpt.transformer.wte.weight.device)
        self.bucketed = bool(getattr(self.runtime, "compiles_graphs", False))
        self.batch_size = int(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self.name = name
        self.seed = seed
        self.progress = progress
        # what `apply_chat_template` renders with, when the harness asks for a chat template (--apply_chat_template):
        # a `lit_gpt.prompts.PromptStyle`, or its name; None: the checkpoint's own chat template
        self.prompt_style = prompt_style
        self._device = self.runtime.device
        # data parallel over processes (eval/lm_eval.py --devices N: a gloo group): the harness gives each rank its
        # share of every task's examples and gathers the results on rank 0 (all_gather / gather_object below)
        self._rank, self._world_size = int(rank), int(world_size)
        self.task_seconds: Dict[str, float] = {}  # model time per task (`_timed`)
        self.compiles_per_bucket: Dict[Tuple[str, int], int] = {}  # (step, padded length) -> compilations seen
        # prompts per generation batch (on XLA padded to this many rows: one graph per prompt bucket)
        self.generate_rows = self.batch_size
        if self.gpt.max_seq_length < self.max_length:  # full-length windows need RoPE tables that long
            self.runtime.set_rope(self.gpt, self.max_length)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "LitLM":
        """`lm_eval --model lit_gpt --model_args checkpoint_dir=DIR[,lora_path=F,precision=P,accelerator=A]`: loads
        the checkpoint as `eval/lm_eval.py` does (`lit_gpt.recipes.evaluate.load_eval_model`)."""
        from lit_gpt.recipes.evaluate import load_eval_model

        args = lm_utils.simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v is not None}
        if "prompt_style" in args:  # a named style (--model_args prompt_style=alpaca): resolved on first use
            args["prompt_style"] = str(args["prompt_style"])
        loader = {k: args.pop(k) for k in ("checkpoint_dir", "lora_path", "adapter_path", "precision", "accelerator",
                                           "allow_other_base") if k in args}
        if "checkpoint_dir" not in loader:
            raise LitError("--model lit_gpt needs --model_args checkpoint_dir=DIR")
        ev = load_eval_model(**loader)
        return cls(ev.model, ev.tokenizer, ev.runtime, name=ev.name, **{**extra, **args})

    # ------------------------------------------------------------------ what the harness reads
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """BOS where the tokenizer has one, else EOS (HFLM's choice): what an empty context is."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.gpt.config.block_size

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.checkpoint_dir).replace("/", "__")

    # ------------------------------------------------------------------ chat templates (--apply_chat_template)
    def style(self) -> Any:
        """The prompt style chat histories are rendered with: `prompt_style` (a name is resolved against the
        checkpoint: "chat" is its template), else the checkpoint's chat template."""
        from lit_gpt.prompts import ChatTemplate, PromptStyle

        if self.prompt_style is None:
            self.prompt_style = ChatTemplate.from_checkpoint(self.tokenizer.checkpoint_dir)
        elif isinstance(self.prompt_style, str):
            self.prompt_style = PromptStyle.from_name(self.prompt_style, self.tokenizer.checkpoint_dir)
        return self.prompt_style

    def chat_template(self, chat_template: Any = False) -> Optional[str]:
        """What the harness records as the chat template: the template's source, or the prompt style's name. A
        string names a prompt style (`lit_gpt.prompts`: "chat", "alpaca", "raw")."""
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str):
            self.prompt_style = chat_template
        style = self.style()
        return getattr(style, "template_source", None) or style.name

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat history as the prompt text, as HFLM renders it with transformers' `apply_chat_template`
        (`continue_final_message` when no generation prompt is added: the text ends with the last message's
        content); a template that refuses a system message is retried without it, as HFLM does."""
        from lit_gpt.prompts import ChatTemplate

        style = self.style()
        if not isinstance(style, ChatTemplate):
            return _apply_style(style, chat_history)
        try:
            text = style.render(chat_history, add_generation_prompt=add_generation_prompt)
        except LitError:
            chat_history = [m for m in chat_history if m["role"] != "system"]
            text = style.render(chat_history, add_generation_prompt=add_generation_prompt)
        if not add_generation_prompt:  # transformers' continue_final_message: cut after the final message
            final = chat_history[-1]["content"].strip()
            if final and final in text:
                text = text[: text.rindex(final) + len(final)]
        return text

    def get_model_info(self) -> Dict[str, Any]:
        return {"model_name": self.name, "model_num_parameters": sum(p.numel() for p in self.gpt.parameters()),
                "model_dtype": str(self.gpt.transformer.wte.weight.dtype), "max_length": self.max_length}

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> List[int]:
        """As HFLM: None follows the checkpoint (a BOS where its tokenizer adds one, not doubled: a chat-templated
        text that starts with the BOS gets no second one); True/False force the special tokens on/off."""
        bos = None if add_special_tokens is None else (add_special_tokens and self.tokenizer.use_bos)
        return self.tokenizer.encode(string, bos=bos).tolist()

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def _count(self, key: Tuple[str, int], before: int) -> None:
        self.compiles_per_bucket[key] = self.compiles_per_bucket.get(key, 0) + self.runtime.compile_count() - before

    # ------------------------------------------------------------------ several processes (the harness's DP API)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        t = tensor.detach().cpu().reshape(-1)  # gloo: host tensors
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return torch.cat(out)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[List[Any]]:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # ------------------------------------------------------------------ time per task
    def _timed(self, requests: List[Any], run: Any) -> Any:
        """`run()` (one of the harness's request calls), its seconds shared among the requests' tasks in
        proportion to their requests' text length (the requests of several tasks are batched together)."""
        t0 = time.perf_counter()
        out = run()
        spent = time.perf_counter() - t0
        weights: Dict[str, float] = {}
        for r in requests:
            name = getattr(r, "task_name", None) or "?"
            weights[name] = weights.get(name, 0.0) + 1.0 + sum(len(a) for a in r.args if isinstance(a, str))
        total = sum(weights.values()) or 1.0
        for name, w in weights.items():
            self.task_seconds[name] = self.task_seconds.get(name, 0.0) + spent * w / total
        return out

    def loglikelihood(self, requests: List[Any], disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        return self._timed(requests, lambda: super(LitLM, self).loglikelihood(requests, disable_tqdm=disable_tqdm))

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        return self._timed(requests, lambda: self._loglikelihood_rolling(requests, disable_tqdm))

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        return self._timed(requests, lambda: self._generate_until(requests, disable_tqdm))

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: List[Pair], disable_tqdm: bool = False, **kwargs: Any
                              ) -> List[Tuple[float, bool]]:
        def sort_key(req: Pair) -> Tuple[int, Tuple[int, ...]]:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        order = Collator(requests, sort_fn=sort_key, group_by="contexts", group_fn=lambda r: r[1] + r[2][:-1])
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.progress,
                   desc="Running loglikelihood requests")
        results: List[Tuple[float, bool]] = []
        for chunk in order.get_batched(n=self.batch_size):
            for (strings, ctx, cont), answer in zip(chunk, self._score_chunk(chunk), strict=True):
                members = list(order.get_cache(req_str=strings, cxt_toks=ctx, cont_toks=cont,
                                               logits=torch.zeros(1, 1, 1)))
                for member_strings, member_cont, _ in members:
                    result = answer(member_cont)
                    results.append(result)
                    if member_strings is not None:
                        self.cache_hook.add_partial("loglikelihood", member_strings, result)
                    bar.update(1)
        bar.close()
        return order.get_original(results)

    def _score_chunk(self, chunk: Sequence[Pair]) -> Iterator[Any]:
        """One forward for the chunk; yields, per request, a function of a continuation (the request's own or one
        sharing all its tokens but the last) -> (log-prob, is greedy)."""
        seqs, spans = [], []
        for _, ctx, cont in chunk:
            if not ctx or not cont:
                raise LitError("a harness request has an empty context or continuation: check the task's YAML")
            full = (ctx + cont)[-(self.max_length + 1):]  # too long: cut from the left, as HFLM does
            seqs.append(full)
            spans.append(min(len(cont), len(full) - 1))
        B = len(seqs)
        longest = max(len(s) - 1 for s in seqs)
        rows_out = self.batch_size if self.bucketed else B
        L = bucket_length(longest, self.max_length) if self.bucketed else longest
        inputs = torch.zeros(rows_out, L, dtype=torch.long)
        targets = torch.zeros(rows_out, L, dtype=torch.long)
        for b, s in enumerate(seqs):
            inputs[b, : len(s) - 1] = torch.tensor(s[:-1])
            targets[b, : len(s) - 1] = torch.tensor(s[1:])
        # the scored positions of row b: the last `span` of its input (its continuation)
        starts = [len(s) - 1 - span for s, span in zip(seqs, spans)]
        if self.bucketed:
            rows = None
            last = torch.tensor([b * L + len(seqs[b]) - 2 if b < B else b * L for b in range(rows_out)])
        else:
            picked = [torch.arange(b * L + starts[b], b * L + len(seqs[b]) - 1) for b in range(B)]
            rows = torch.cat(picked)
            last = torch.cumsum(torch.tensor([len(p) for p in picked]), 0) - 1
        compiles = self.runtime.compile_count()
        if self.bucketed and self.runtime.data_parallel_size > 1 and rows_out % self.runtime.data_parallel_size == 0:
            placed = self.runtime.place((inputs, targets))  # SPMD: each device scores its rows
        else:
            placed = (self.runtime.to_device(inputs), self.runtime.to_device(targets))
        out = score_step(self.model, *placed, self.runtime.to_device(last),
                         None if rows is None else self.runtime.to_device(rows))
        if self.bucketed:
            out = tuple(_replicated(t) for t in out)
        self.runtime.end_step()
        token_logp, greedy, last_rows, last_arg = (t.cpu() for t in out)
        if self.bucketed:
            key = ("score", L)
            self._count(key, compiles)
            token_logp, greedy = token_logp.view(rows_out, L), greedy.view(rows_out, L)
            where = [(b, starts[b], len(seqs[b]) - 1) for b in range(B)]
        else:
            offsets = [0] + torch.cumsum(torch.tensor([len(p) for p in picked]), 0).tolist()
            token_logp, greedy = token_logp.unsqueeze(0), greedy.unsqueeze(0)
            where = [(0, offsets[b], offsets[b + 1]) for b in range(B)]

        for b, (r, lo, hi) in enumerate(where):
            def answer(cont: List[int], b: int = b, r: int = r, lo: int = lo, hi: int = hi) -> Tuple[float, bool]:
                k = min(len(cont), hi - lo)  # a shared one-token continuation is scored on the same positions
                logp = token_logp[r, hi - k: hi - 1].tolist() + [float(last_rows[b, cont[-1]])]
                ok = bool(greedy[r, hi - k: hi - 1].all()) and int(last_arg[b]) == cont[-1]
                return float(torch.tensor(logp).sum()), ok  # float32, summed as HFLM sums

            yield answer

    def _loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        windows: List[Tuple[int, Pair]] = []
        for i, (text,) in enumerate(r.args for r in requests):
            token_windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)
            windows += [(i, (None, *lm_utils.make_disjoint_window(w))) for w in token_windows]
        scores = self._loglikelihood_tokens([w for _, w in windows], disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for (i, _), (logp, _) in zip(windows, scores, strict=True):
            totals[i] += logp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def _generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        """Every request a row of one continuous `Batch` (per setting of sampling): rows join as rows free up, each
        with its own prompt length, stop strings and `max_gen_toks`, and leave when they end."""
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.progress,
                   desc="Running generate_until requests")
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs: List[GenJob] = []
        for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise LitError(f"the task asks for {max_gen} new tokens but the model's context is {self.max_length}"
                               " tokens: set max_gen_toks lower in the task's generation_kwargs")
            ids = self.tok_encode(context)
            # too long: cut from the left to leave room for the new tokens, as HFLM does
            jobs.append(GenJob(i, ids[-(self.max_length - max_gen):], until, max_gen, self._sampling(kwargs),
                               (context, gen_kwargs)))
        texts: List[Optional[str]] = [None] * len(jobs)
        groups: Dict[str, List[GenJob]] = {}
        for job in jobs:
            groups.setdefault(repr(sorted((k, v) for k, v in job.sampling.items() if k != "generator")), []).append(job)
        for group in groups.values():
            # longest first, as HFLM orders them (its first batch is its longest: memory errors come at once)
            group.sort(key=lambda j: (-len(j.prompt), j.args[0]))
            for job, text in self._generate(group):
                texts[job.index] = text
                self.cache_hook.add_partial("generate_until", job.args, text)
                bar.update(1)
        bar.close()
        return texts  # type: ignore[return-value]

    def _sampling(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """greedy, or the task's temperature / top_k / top_p (seeded); other generation kwargs are not supported."""
        ignored = sorted(set(kwargs) - set(SAMPLING_KWARGS))
        if ignored and not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn(f"generation kwargs {', '.join(ignored)} are ignored (supported:"
                          f" {', '.join(SAMPLING_KWARGS)})")
        if not kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) == 0.0:
            return {"temperature": 0.0}
        generator = torch.Generator(self.device if self.device.type != "xla" else "cpu").manual_seed(self.seed)
        top_k = kwargs.get("top_k")
        return {"temperature": float(kwargs["temperature"]), "top_k": int(top_k) if top_k else None,
                "top_p": float(kwargs.get("top_p", 1.0)), "generator": generator if self.device.type != "xla" else None}

    def _cache_length(self, jobs: Sequence["GenJob"]) -> int:
        """KV-cache positions for these rows: every prompt's bucket and its new tokens fit; on XLA a power of two
        (the decode step's shape: one graph per cache bucket)."""
        prompt_bucket = (lambda n: self.runtime.prompt_bucket(n, self.max_length)) if self.bucketed else (lambda n: n)
        need = max(max(prompt_bucket(len(j.prompt)), len(j.prompt) + j.max_gen) for j in jobs)
        return bucket_length(need, self.max_length) if self.bucketed else need

    @torch.no_grad()
    def _generate(self, jobs: List["GenJob"]) -> Iterator[Tuple["GenJob", str]]:
        """Continuous batching of `jobs` (one sampling setting) through the generation loop's `Batch` of
        `batch_size` rows: a job joins a free row (its prompt prefilled there, at its own length), every step
        decodes one token for every row, and a job leaves once its text holds a stop string, it produced a stop
        token, or it has `max_gen` tokens. Yields (job, its text cut at the first stop string) as jobs end."""
        length = self._cache_length(jobs)
        waiting = list(reversed(jobs))  # popped from the end: the longest first
        running: Dict[int, GenJob] = {}
        stop_ids = set(self.tokenizer.stop_ids)
        with self.runtime.inference_context():
            batch = Batch(self.model, self.generate_rows, length, runtime=self.runtime, stop_ids=None,
                          uniform=jobs[0].sampling)
            while waiting or running:
                for row in batch.free_rows():
                    if not waiting:
                        break
                    job = waiting.pop()
                    before = self.runtime.compile_count()
                    first = batch.join([row], torch.tensor([job.prompt], dtype=torch.long))
                    if self.bucketed:
                        self._count(("prefill", self.runtime.prompt_bucket(len(job.prompt), length)), before)
                    running[row] = job
                    if self._take(job, int(first.cpu()[0]), stop_ids):
                        batch.leave(row)
                        del running[row]
                        yield job, job.text(self)
                if not running:
                    continue
                before = self.runtime.compile_count()
                tokens = batch.step().cpu().tolist()  # the one host read per step: every row's new token
                if self.bucketed:
                    self._count(("decode", length), before)
                for row, job in list(running.items()):
                    if self._take(job, tokens[row], stop_ids):
                        batch.leave(row)
                        del running[row]
                        yield job, job.text(self)

    def _take(self, job: "GenJob", token: int, stop_ids: Any) -> bool:
        """A job's new token; whether the job has ended (a stop token, a stop string in its text, or max_gen)."""
        if token in stop_ids:
            return True
        job.tokens.append(token)
        if len(job.tokens) >= job.max_gen:
            return True
        stops = [s for s in job.until if s]
        return bool(stops) and any(s in self.tok_decode(job.tokens) for s in stops)


class GenJob:
    """One generate_until request in the continuous batch: its prompt ids, stop strings, new-token budget,
    sampling setting, and the tokens generated so far."""

    def __init__(self, index: int, prompt: List[int], until: List[str], max_gen: int, sampling: Dict[str, Any],
                 args: Tuple[str, Dict[str, Any]]) -> None:
        self.index, self.prompt, self.until, self.max_gen, self.sampling, self.args = (
            index, prompt, until, max_gen, sampling, args)
        self.tokens: List[int] = []

    def text(self, lm: LitLM) -> str:
        """The new text, cut at the first stop string (as HFLM cuts it)."""
        return postprocess_generated_text(lm.tok_decode(self.tokens, skip_special_tokens=True), self.until, None)


def _apply_style(style: Any, chat_history: List[Dict[str, str]]) -> str:
    """A chat history through a prompt style without a template (alpaca, raw): the last user message is the
    prompt, the turns before it its history (system messages go first, as the style's history); an assistant
    message after it (a prefilled answer) is appended to the prompt text."""
    messages = list(chat_history)
    tail = ""
    if messages and messages[-1]["role"] == "assistant":
        tail = messages.pop()["content"]
    prompt = messages.pop()["content"] if messages and messages[-1]["role"] == "user" else ""
    history = [(m["role"], m["content"]) for m in messages]
    return style.apply(prompt, history) + tail


def _replicated(t: torch.Tensor) -> torch.Tensor:
    """Under SPMD, the step's outputs gathered inside its graph (the host reads them as plain transfers; reading a
    sharded tensor would compile a gather graph per output)."""
    import torch_xla.runtime as xr

    if xr.is_spmd():
        import torch_xla.distributed.spmd as xs

        mesh = xs.get_global_mesh()
        if mesh is not None:
            xs.mark_sharding(t, mesh, (None,) * t.dim())
    return t


register_model("lit_gpt")(LitLM)
