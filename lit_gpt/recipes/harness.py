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
* `generate_until(context, gen_kwargs)`: the project's one generation loop (`lit_gpt.generate.generate_stream`),
  greedy unless the task asks for sampling; stopped once every row's text holds a stop string (or after
  `max_gen_toks`, or at a stop token), the text cut at the first stop string, as HFLM cuts it. The loop takes a
  batch of prompts of one length (it has no attention mask for left padding): prompts of equal token length run
  together, up to `batch_size`; others one at a time.
* On a tracing backend (XLA) the shapes are bucketed: a scoring batch is padded to `batch_size` rows and its
  length to a power of two (`lit_gpt.runtime.bucket_length`), so the scoring step compiles once per length bucket;
  generation pads the batch to `batch_size` rows too, and the loop pads prompts to buckets (2 graphs per bucket).
"""

import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from lit_gpt.generate import generate_stream, unwrap
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
                 progress: bool = True) -> None:
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
        self._device = self.runtime.device
        self._rank, self._world_size = 0, 1
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

    def get_model_info(self) -> Dict[str, Any]:
        return {"model_name": self.name, "model_num_parameters": sum(p.numel() for p in self.gpt.parameters()),
                "model_dtype": str(self.gpt.transformer.wte.weight.dtype), "max_length": self.max_length}

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> List[int]:
        """As HFLM: None follows the checkpoint (a BOS where its tokenizer adds one, not doubled); True/False
        force the special tokens on/off."""
        bos = None if add_special_tokens is None else (add_special_tokens and self.tokenizer.use_bos)
        return self.tokenizer.encode(string, bos=bos).tolist()

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def _count(self, key: Tuple[str, int], before: int) -> None:
        self.compiles_per_bucket[key] = self.compiles_per_bucket.get(key, 0) + self.runtime.compile_count() - before

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

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
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
    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        order = Collator([r.args for r in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.progress,
                   desc="Running generate_until requests")
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results: List[str] = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise LitError(f"the task asks for {max_gen} new tokens but the model's context is {self.max_length}"
                               " tokens: set max_gen_toks lower in the task's generation_kwargs")
            sampling = self._sampling(kwargs)
            encoded = [self.tok_encode(c)[-(self.max_length - max_gen):] for c in contexts]
            texts: List[Optional[str]] = [None] * len(encoded)
            for group in _equal_length_groups(encoded, self.generate_rows):
                for i, text in zip(group, self._generate([encoded[i] for i in group], max_gen, until, sampling)):
                    texts[i] = text
            for context, text in zip(contexts, texts):
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                results.append(text)
                bar.update(1)
        bar.close()
        return order.get_original(results)

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

    def _generate(self, prompts: List[List[int]], max_gen: int, until: List[str], sampling: Dict[str, Any]
                  ) -> List[str]:
        """Texts of a batch of equal-length prompts, each cut at its first stop string."""
        n = len(prompts)
        rows = prompts + [prompts[0]] * (self.generate_rows - n if self.bucketed else 0)
        prompt = torch.tensor(rows, dtype=torch.long)
        tokens: List[List[int]] = [[] for _ in rows]
        stops = [s for s in until if s]
        compiles = self.runtime.compile_count()
        stream = generate_stream(self.model, prompt, max_gen, stop_ids=self.tokenizer.stop_ids, runtime=self.runtime,
                                 **sampling)
        for chunk in stream:
            for row, ids in zip(tokens, chunk.tolist()):
                row.extend(ids)
            texts = [self._text(t) for t in tokens[:n]]
            if stops and all(any(s in t for s in stops) for t in texts):
                stream.close()
                break
        if self.bucketed:
            key = ("generate", self.runtime.prompt_bucket(prompt.size(1), self.max_length))
            self._count(key, compiles)
        return [postprocess_generated_text(self._text(t), until, None) for t in tokens[:n]]

    def _text(self, ids: List[int]) -> str:
        stop = set(self.tokenizer.stop_ids)
        cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
        return self.tok_decode(ids[:cut], skip_special_tokens=True)


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


def _equal_length_groups(encoded: List[List[int]], size: int) -> List[List[int]]:
    """Indices of the prompts, grouped by token length (the loop runs a batch of one length), `size` at most."""
    groups: Dict[int, List[int]] = {}
    for i, ids in enumerate(encoded):
        groups.setdefault(len(ids), []).append(i)
    return [g[k: k + size] for g in groups.values() for k in range(0, len(g), size)]


register_model("lit_gpt")(LitLM)


# ---------------------------------------------------------------------------------------------------------------
# the recipe's steps (eval/lm_eval.py)
# ---------------------------------------------------------------------------------------------------------------
RESULTS_FILE = "lm_eval.json"
LIST_HINT = "list them with `python eval/lm_eval.py --tasks list` (tasks of your own: --include_path DIR)"


def task_names(tasks: str) -> List[str]:
    names = [t.strip() for t in str(tasks or "").split(",") if t.strip()]
    if not names:
        raise LitError(f"--tasks is empty: name harness tasks, e.g. --tasks hellaswag,arc_easy ({LIST_HINT})")
    return names


def resolve_tasks(tasks: str, include_path: Optional[Any] = None,
                  include_defaults: bool = True) -> Tuple[Any, List[str]]:
    """(TaskManager, task names) for `--tasks a,b` and `--include_path DIR`; a name the harness does not know is one
    LitError line, before any model is loaded. The harness's own ~14,000 task files take half a minute to index:
    they are read only when a name is not among the `--include_path` tasks."""
    from lm_eval.tasks import TaskManager

    names = task_names(tasks)
    if include_path is not None:
        from pathlib import Path

        if not Path(include_path).is_dir():
            raise LitError(f"--include_path {str(include_path)!r} is not a folder: pass the folder of your task YAMLs")
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(manager.match_tasks(names)) >= set(names) or not include_defaults:
            return _checked(manager, names, include_path)
        # a name missing from --include_path because its own file there does not parse: said now, before the
        # harness's task files are indexed (which would only end in "unknown task")
        missing = [n for n in names if n not in manager.match_tasks(names)]
        broken = _broken_yaml(include_path, missing)
        if broken is not None:
            raise _yaml_error(broken, missing)
    manager = TaskManager(include_path=None if include_path is None else str(include_path),
                          include_defaults=include_defaults)
    return _checked(manager, names, include_path)


def _checked(manager: Any, names: List[str], include_path: Optional[Any] = None) -> Tuple[Any, List[str]]:
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known and not manager.match_tasks([n])]
    if unknown:
        # the harness skips a task file it cannot parse (a log line): its task is then "unknown", the wrong cause
        broken = _broken_yaml(include_path) if include_path is not None else None
        if broken is not None:
            raise _yaml_error(broken, unknown)
        raise LitError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: {LIST_HINT}")
    return manager, [m for n in names for m in ([n] if n in known else manager.match_tasks([n]))]


def _yaml_error(broken: Tuple[str, str], unknown: List[str]) -> LitError:
    return LitError(f"task file {broken[0]!r} is not valid YAML ({broken[1]}): fix it (the harness skips it, so"
                    f" {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} unknown)")


def _broken_yaml(include_path: Any, names: Optional[List[str]] = None) -> Optional[Tuple[str, str]]:
    """The first task file under `include_path` that is not valid YAML, and why (line and column); with `names`,
    only a file named after one of them or whose text says `task: NAME`."""
    import re
    from pathlib import Path

    import yaml

    class Loader(yaml.SafeLoader):  # the harness's tags (!function ...) are not syntax errors
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    for path in sorted(Path(include_path).rglob("*.yaml")):
        try:
            text = path.read_text(encoding="utf-8")
            if names is not None and path.stem not in names and not any(
                    re.search(rf"^task:\s*['\"]?{re.escape(n)}['\"]?\s*$", text, re.MULTILINE) for n in names):
                continue
            yaml.load(text, Loader=Loader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            return str(path), f"{getattr(e, 'problem', None) or e}{where}"
        except (OSError, UnicodeDecodeError) as e:
            return str(path), f"cannot read it: {e}"
    return None


def check_task_data(manager: Any, names: List[str], num_fewshot: Optional[int]) -> None:
    """Every task's data loads and holds enough examples for its few-shot prompts: found before the model is
    loaded (one LitError line), not as a traceback after it. The datasets library caches what is read here."""
    from lm_eval.tasks import get_task_dict

    try:
        tasks = get_task_dict(names, manager)
    except (OSError, ValueError) as e:  # a data file not found (FileNotFoundError), a dataset not cached offline
        raise LitError(f"cannot load the data of task(s) {', '.join(map(repr, names))}: {str(e).splitlines()[0]}"
                       " (check dataset_path / dataset_kwargs in the task's YAML)") from None

    def leaves(d: Any) -> Iterator[Any]:
        for value in d.values():
            if isinstance(value, dict):
                yield from leaves(value)
            else:
                yield value

    for task in leaves(tasks):
        shots = num_fewshot if num_fewshot is not None else getattr(task.config, "num_fewshot", None)
        if not shots:
            continue
        docs = task.fewshot_docs()
        available = len(docs) if docs is not None else 0
        # the harness draws shots + 1 examples and drops the one being evaluated
        if shots >= available:
            name = getattr(task.config, "task", "?")
            raise LitError(f"task {name!r} has {available} example(s) to draw few-shot prompts from, fewer than"
                           f" {shots} + 1 (the one evaluated is left out): pass --num_fewshot {max(available - 1, 0)}"
                           " or less")


def list_tasks(include_path: Optional[Any] = None) -> str:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=None if include_path is None else str(include_path)).list_all_tasks()


def evaluate(lm: LitLM, manager: Any, names: List[str], num_fewshot: Optional[int] = None,
             limit: Optional[float] = None, seed: int = 1234, bootstrap_iters: int = 100000) -> Dict[str, Any]:
    """The harness's `simple_evaluate` on `lm`: its results dict (without the per-sample log)."""
    from lm_eval import simple_evaluate

    if limit is not None and float(limit) == int(limit):
        limit = int(limit)
    results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, batch_size=lm.batch_size, limit=limit,
                              task_manager=manager, log_samples=False, bootstrap_iters=bootstrap_iters,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed)
    results.pop("samples", None)
    results["config"]["model"] = lm.name
    return results


def results_json(results: Dict[str, Any]) -> str:
    """The harness's results dict as the JSON text of lm_eval.json (eval/lm_eval.py writes it with
    `lit_gpt.recipes.outputs.write_results`: atomically, kept elsewhere if that fails)."""
    import json

    return json.dumps(results, indent=2, default=lm_utils.handle_non_serializable, ensure_ascii=False)


def results_table(results: Dict[str, Any]) -> str:
    table = lm_utils.make_table(results)
    if results.get("groups"):
        table += "\n" + lm_utils.make_table(results, "groups")
    return table
