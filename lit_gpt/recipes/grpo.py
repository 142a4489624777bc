"""The GRPO recipes' own steps (finetune/grpo.py on CPU/CUDA, xla/finetune/grpo.py on XLA devices). GRPO is an
objective of the one training loop (`GRPO` here, `lit_gpt.training.fit`), not a second loop:

    run = finish(flags, run)              # --method lora|full, --grpo.*, --reward -> the run's method and objective
    data = load_run_data(runtime, run)    # prompts with their answers (scripts/prepare_prompts.py)
    model ...                             # LoRA on the frozen base, or every weight (as the SFT recipes)
    attach(run, ...)                      # the tokenizer (stop ids, texts for the rewards), a full run's reference
    fit(...)                              # the loop; checkpoints, resume and export as for SFT

Each optimizer step the loop hands the step's prompt batches to `GRPO.rollout`: every prompt joins `group_size`
rows of one batched generation (`lit_gpt.generate.Batch`, the one generation loop, on every backend: on XLA the
prompts right-padded to buckets, a fixed KV cache and fixed `max_new_tokens` columns, so generation compiles a
prefill per bucket and one decode step); the completions are decoded and scored by the reward functions, the
group-relative advantages computed over the whole step (`lit_gpt.grpo`), and the reference log-probabilities (beta >
0) computed without gradient: the same model with its LoRA adapters off, or a frozen copy of the base for full
finetuning (each process for its own rollouts only: with several processes every completion's reference is
computed once; nothing is precomputed, the completions being new each step). Then the loop runs `GRPO.loss` on each
micro-batch of prompt + completion rows (one forward with gradient), TRL's loss (`lit_gpt.grpo.grpo_loss`).
Validation generates one greedy completion per held-out prompt and logs its rewards (`val_reward`).
"""

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.batches import IGNORE_INDEX, Sample, pad_length
from lit_gpt.grpo import Reward, check_grpo, group_advantages, grpo_loss, load_prompts, load_rewards, score, units
from lit_gpt.objectives import Objective
from lit_gpt.peft import base_config
from lit_gpt.recipes.finetune import FinetuneRun
from lit_gpt.recipes.flags import Flag
from lit_gpt.utils import LitError


@dataclass
class GRPOArgs:
    """Group relative policy optimisation (finetune/grpo.py, xla/finetune/grpo.py): TRL 1.16's GRPOTrainer settings
    under TRL's names where it has them."""

    group_size: int = 8
    """Completions sampled per prompt (TRL's num_generations); advantages compare the completions of one prompt."""
    max_new_tokens: int = 256
    """The longest completion (TRL's max_completion_length; dr_grpo divides by it). Also the fixed shape on XLA."""
    temperature: float = 1.0
    """Sampling temperature; the log-probabilities of the loss are taken at it too (as TRL does)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    loss: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    """How the per-token losses are averaged: "grpo" per completion then over completions, "dr_grpo" over
    completions x max_new_tokens, "dapo" over all completion tokens of the step (TRL's default)."""
    beta: float = 0.0
    """The weight of the KL to the reference (TRL's k3 estimator); 0 (TRL's default) needs no reference."""
    epsilon: float = 0.2
    """Clipping of the probability ratio below (and above unless epsilon_high)."""
    epsilon_high: Optional[float] = None
    """Clipping above (DAPO's clip-higher, e.g. 0.28); default: epsilon."""
    bias_correction_kl: bool = True
    """The KL term times the probability ratio (TRL's use_bias_correction_kl, its default): the unbiased gradient."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages divided by the std of the group's rewards, of the step's, or not at all (Dr. GRPO: "none")."""


METHOD = Flag("method", Literal["lora", "full"], "lora",
              '"lora": LoRA adapters on the frozen base (the --lora_* flags); "full": every weight trains.')
GRPO_FLAG = Flag("grpo", GRPOArgs, GRPOArgs(), "Sampling, the GRPO loss (TRL's names) and the KL to the reference.")
REWARD_FLAG = Flag("reward", Union[List[str], str], ["answer_match", "number_only"],
                   "The reward functions: NAME or NAME=WEIGHT, NAME a built-in (answer_match: the completion is the"
                   " row's answer, or its last number equals it; number_only: the completion is a number alone) or"
                   " module:function / file.py:function, called as TRL calls them (prompts=, completions=,"
                   " completion_ids= and the row's fields; one float or None per completion). One: --reward NAME;"
                   " several: --reward NAME --reward NAME2 (or --reward '[NAME, NAME2]').")
GRPO_FLAGS = [METHOD, GRPO_FLAG, REWARD_FLAG]


def check(flags: Dict[str, Any]) -> None:
    """The GRPO settings and the reward functions, before anything loads."""
    g: GRPOArgs = flags["grpo"]
    if flags["method"] not in ("lora", "full"):
        raise LitError(f"--method must be 'lora' or 'full', got {flags['method']!r}")
    check_grpo(g.loss, g.beta, g.epsilon, g.epsilon_high, g.scale_rewards, g.group_size, g.temperature, g.top_p,
               g.max_new_tokens)
    load_rewards(reward_specs(flags["reward"]))


def reward_argv(argv: Sequence[str]) -> List[str]:
    """The command line with a repeated `--reward NAME` accumulating: jsonargparse keeps the last value of a repeated
    flag and appends only with `--reward+`, so the second and later `--reward` (or `--reward=NAME`) become
    `--reward+` (the recipes' `__main__` passes their arguments through this)."""
    out, seen = [], False
    for arg in argv:
        if arg == "--reward" or arg.startswith("--reward="):
            if seen:
                arg = "--reward+" + arg[len("--reward"):]
            seen = True
        elif arg == "--reward+" or arg.startswith("--reward+="):
            seen = True
        out.append(arg)
    return out


def reward_specs(value: Union[List[str], str]) -> List[str]:
    """--reward's value as a list (one name on the command line is a string)."""
    return [value] if isinstance(value, str) else list(value)


def finish(flags: Dict[str, Any], run: FinetuneRun) -> FinetuneRun:
    """The run with the chosen method (a full finetune's config without the LoRA fields) and the GRPO objective."""
    method = flags["method"]
    specs = reward_specs(flags["reward"])
    objective = GRPO(flags["grpo"], load_rewards(specs), specs,
                     reference="adapters_off" if method == "lora" else "copy")
    config = run.config if method == "lora" else base_config(run.config)
    return replace(run, method=method, config=config, objective=objective)


def attach(run: FinetuneRun, raw_model: nn.Module, device: Any = None) -> None:
    """What the objective needs beside the model: the tokenizer (stop ids; texts for the rewards) and, for full
    finetuning with beta > 0, a frozen copy of the base model as the reference (before any step changes it)."""
    from lit_gpt.tokenizer import Tokenizer

    objective = run.objective
    if not isinstance(objective, GRPO):
        return
    objective.tokenizer = Tokenizer(run.checkpoint_dir)
    if objective.args.beta > 0 and objective.reference == "copy":
        ref = copy.deepcopy(raw_model)
        ref.requires_grad_(False)
        ref.eval()
        objective.ref_model = ref if device is None else ref.to(device)


@dataclass
class GRPO(Objective):
    """GRPO (see the module docstring). Units: completions (grpo, dr_grpo) or completion tokens (dapo)."""

    args: GRPOArgs = field(default_factory=GRPOArgs)
    rewards: List[Reward] = field(default_factory=list)
    reward_specs: List[str] = field(default_factory=list)
    reference: str = "adapters_off"
    tokenizer: Any = None
    ref_model: Optional[nn.Module] = None
    max_prompt: int = 0

    name = "grpo"
    stat_names = ("kl", "clip_fraction")

    def __post_init__(self) -> None:
        self._logs: Dict[str, List[float]] = {}

    @property
    def unit(self) -> str:  # type: ignore[override]
        return "completion token" if self.args.loss == "dapo" else "completion"

    @property
    def extra_forwards(self) -> int:  # type: ignore[override]
        return 1 if self.args.beta > 0 else 0

    # ---------------------------------------------------------------- data: prompts
    def load(self, data_dir: Any, checkpoint_dir: Any = None) -> Any:
        prepared = load_prompts(data_dir, checkpoint_dir)
        self.max_prompt = max(s["input_ids"].numel() for s in prepared.train + prepared.val)
        return prepared

    def length(self, sample: Sample) -> int:
        return sample["input_ids"].numel() + self.args.max_new_tokens

    def cropped(self, sample: Sample, max_seq_length: int) -> bool:
        return False  # a prompt is never cropped: one that leaves no room for the completion is left out

    def keep(self, sample: Sample, max_seq_length: int) -> bool:
        return self.length(sample) <= max_seq_length

    def collate(self, samples: Sequence[Sample], max_seq_length: int, pad_multiple: int = 1,
                pad_pow2: bool = False) -> Dict[str, Any]:
        """A prompt batch: the prompts and their fields (the completions come in `rollout`)."""
        return {"prompts": [s["input_ids"] for s in samples], "fields": [s["fields"] for s in samples],
                "real": len(samples), "pad": (max_seq_length, pad_multiple, pad_pow2)}

    def pad(self, batch: Dict[str, Any], rows: int) -> Dict[str, Any]:
        """`rows` prompts (fixed shapes): padding prompts repeat the first and count nothing."""
        if "prompts" not in batch or len(batch["prompts"]) >= rows:
            return batch
        missing = rows - len(batch["prompts"])
        return {**batch, "prompts": batch["prompts"] + [batch["prompts"][0]] * missing,
                "fields": batch["fields"] + [batch["fields"][0]] * missing}

    def count(self, batch: Dict[str, Any]) -> int:
        return int(units(self.args.loss, batch["mask"]))

    def inputs(self, batch: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
        ref = (batch["ref"],) if "ref" in batch else ()
        return (batch["input_ids"], batch["labels"], batch["index"], batch["mask"], batch["advantages"]) + ref

    # ---------------------------------------------------------------- the step
    def rollout(self, runtime: Any, model: nn.Module, batches: List[Dict[str, Any]], evaluate: bool = False
                ) -> List[Dict[str, Any]]:
        """The step's prompt batches -> batches of prompt + completion rows with their advantages (and reference
        log-probabilities); `evaluate`: one greedy completion per prompt (validation)."""
        G = 1 if evaluate else self.args.group_size
        t0 = time.perf_counter()
        completions = [self._sample(runtime, model, b, G, evaluate) for b in batches]
        gen_time = time.perf_counter() - t0
        # score every real completion of the step at once: advantages compare the groups of the whole step
        prompts, texts, ids, fields, real = [], [], [], [], []
        for b, comp in zip(batches, completions):
            for i, p in enumerate(b["prompts"]):
                prompt_text = self.tokenizer.decode(p, skip_special_tokens=False)
                for c in comp[i * G:(i + 1) * G]:
                    prompts.append(prompt_text)
                    texts.append(self.tokenizer.decode(torch.tensor(c), skip_special_tokens=True))
                    ids.append(c)
                    fields.append(b["fields"][i])
                    real.append(i < b["real"])
        per_func = score(self.rewards, prompts, texts, ids, fields)
        weights = torch.tensor([r.weight for r in self.rewards])
        real_t = torch.tensor(real)
        advantages, rewards = group_advantages(per_func, weights, G, self.args.scale_rewards, real=real_t,
                                               gather=None if evaluate else _process_gather(runtime))
        self._record(per_func[real_t], rewards[real_t], [len(c) for c, r in zip(ids, real) if r], gen_time,
                     "val_" if evaluate else "")
        out, start = [], 0
        for b, comp in zip(batches, completions):
            n = len(comp)
            batch = self._rows(b, comp, advantages[start:start + n], real_t[start:start + n],
                               static=runtime.compiles_graphs)
            if self.args.beta > 0:
                batch["ref"] = self._reference(runtime, model, batch)
            out.append(batch)
            start += n
        self._logs.setdefault("time_generation" if not evaluate else "val_time_generation", []).append(gen_time)
        self._logs.setdefault("time_scoring" if not evaluate else "val_time_scoring", []).append(
            time.perf_counter() - t0 - gen_time)
        return out

    @torch.no_grad()
    def _sample(self, runtime: Any, model: nn.Module, batch: Dict[str, Any], G: int, greedy: bool) -> List[List[int]]:
        """G completions of every prompt of `batch` (token lists, each cut after its first stop id)."""
        from lit_gpt.generate import Batch, unwrap

        gpt = unwrap(model)
        C = self.args.max_new_tokens
        block = gpt.config.block_size
        # one cache length for every step (a tracing backend keeps one decode graph): the longest prompt's bucket
        bucket = runtime.prompt_bucket(self.max_prompt, block)
        cache = min(block, runtime.cache_length(bucket, self.max_prompt, C, block))
        rows = len(batch["prompts"]) * G
        uniform = dict(temperature=0.0 if greedy else self.args.temperature, top_k=None,
                       top_p=1.0 if greedy else self.args.top_p, generator=None)
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            gen = Batch(model, rows, cache, runtime=runtime, exact_length=True, stop_ids=self.tokenizer.stop_ids,
                        uniform=uniform)
            first = [gen.join(range(i * G, (i + 1) * G), p.view(1, -1).expand(G, -1))
                     for i, p in enumerate(batch["prompts"])]
            tokens = [torch.cat([t.to(first[0].device) for t in first])]
            for step in range(1, C):
                if step % runtime.stop_check_every == 0 and gen.all_done():
                    break
                tokens.append(gen.step())
            out = runtime.to_host(tokens).cpu()
        finally:
            model.train(was_training)
        stops = set(self.tokenizer.stop_ids)
        completions = []
        for row in out.tolist():
            end = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            completions.append(row[:end])  # the stop token is part of the completion (it is learned), as in TRL
        return completions

    def _rows(self, batch: Dict[str, Any], completions: List[List[int]], advantages: torch.Tensor,
              real: torch.Tensor, static: bool = False) -> Dict[str, Any]:
        """Right-padded prompt + completion rows, shifted for next-token prediction; `index` (R, C) the label
        positions of each completion token, `mask` (R, C) which are real (padding prompts: none). `static` (a
        tracing backend): every batch is max_seq_length long (the longest prompt + max_new_tokens), so the train
        step has one shape whatever the sampled lengths."""
        max_seq_length, pad_multiple, pad_pow2 = batch["pad"]
        C = self.args.max_new_tokens
        G = len(completions) // len(batch["prompts"])
        seqs = [(batch["prompts"][r // G], completions[r]) for r in range(len(completions))]
        longest = max(p.numel() + len(c) for p, c in seqs) - 1
        T = max_seq_length if static else pad_length(longest, max_seq_length, pad_multiple, pad_pow2)
        R = len(seqs)
        input_ids = torch.zeros((R, T), dtype=torch.int64)
        labels = torch.full((R, T), IGNORE_INDEX, dtype=torch.int64)
        index = torch.zeros((R, C), dtype=torch.int64)
        mask = torch.zeros((R, C))
        n_tokens = 0
        for r, (p, c) in enumerate(seqs):
            ids = torch.cat([p, torch.tensor(c, dtype=torch.int64)])
            n = ids.numel() - 1
            input_ids[r, :n] = ids[:-1]
            P = p.numel()
            index[r, :len(c)] = torch.arange(P - 1, P - 1 + len(c))
            if real[r]:
                labels[r, P - 1:n] = ids[P:]
                mask[r, :len(c)] = 1.0
                n_tokens += n
        return {"input_ids": input_ids, "labels": labels, "index": index, "mask": mask,
                "advantages": advantages.float() * real.float(), "n_tokens": n_tokens}

    @torch.no_grad()
    def _reference(self, runtime: Any, model: nn.Module, batch: Dict[str, Any]) -> torch.Tensor:
        """(R, C) reference log-probabilities of the completion tokens, on the host."""
        from lit_gpt.lora import adapters_disabled
        from lit_gpt.losses import labelled_rows

        ref_model = self.ref_model if self.ref_model is not None else model
        was_training = ref_model.training
        ref_model.eval()
        try:
            rows = labelled_rows(batch["labels"]) if runtime.targets_only else None
            input_ids, labels, index = runtime.place((batch["input_ids"], batch["labels"], batch["index"]))
            rows = runtime.place(rows) if rows is not None else None
            with adapters_disabled(ref_model):  # LoRA: the base model; a frozen copy has no adapters
                logps = completion_logps(ref_model, input_ids, labels, index, self.args.temperature, rows)
            runtime.end_step()
            return logps.float().cpu()
        finally:
            ref_model.train(was_training)

    def loss(self, model: nn.Module, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        input_ids, labels, index, mask, advantages = inputs[:5]
        ref = inputs[5] if len(inputs) > 5 else None
        logps = completion_logps(model, input_ids, labels, index, self.args.temperature, rows)
        g = self.args
        return grpo_loss(logps, None, ref, advantages, mask, loss_type=g.loss, beta=g.beta, epsilon=g.epsilon,
                         epsilon_high=g.epsilon_high, max_completion_length=g.max_new_tokens,
                         bias_correction_kl=g.bias_correction_kl)

    @torch.no_grad()
    def eval_loss(self, model: nn.Module, inputs: Sequence[torch.Tensor]
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.loss(model, inputs)

    # ---------------------------------------------------------------- logs
    def _record(self, per_func: torch.Tensor, rewards: torch.Tensor, lengths: List[int], gen_time: float,
                prefix: str) -> None:
        logs = self._logs
        add = lambda k, v: logs.setdefault(prefix + k, []).append(float(v))  # noqa: E731
        add("reward", torch.nanmean(rewards))
        add("reward_std", torch.nan_to_num(_std(rewards)))
        for j, r in enumerate(self.rewards):
            name = r.name.split(":")[-1].split("=")[0]
            add(f"reward_{name}", torch.nanmean(per_func[:, j]))
            add(f"reward_{name}_std", torch.nan_to_num(_std(per_func[:, j])))
        add("completion_length", sum(lengths) / max(len(lengths), 1))

    def logged(self, prefix: str = "") -> Dict[str, float]:
        """The means of what the rollouts since the last call recorded (those with `prefix`), then forgotten."""
        keys = [k for k in self._logs if k.startswith(prefix) and (prefix or not k.startswith("val_"))]
        out = {k: sum(self._logs[k]) / len(self._logs[k]) for k in keys}
        for k in keys:
            del self._logs[k]
        return out

    def settings(self) -> Optional[Dict[str, Any]]:
        from dataclasses import asdict

        return {**asdict(self.args), "reward": list(self.reward_specs), "reference": self.reference}


def _process_gather(runtime: Any) -> Any:
    """A gather over the processes for the batch std of the rewards (every process calls `rollout` once per step:
    the collective is matched; validation's rollouts, whose counts may differ, never gather), or None for one
    process. Each process (a DDP rank, or an XLA host) scores only its own prompts, so this is also right on
    several XLA hosts; one XLA process already scores the prompts of all its devices."""
    fabric = getattr(runtime, "fabric", None)
    if fabric is None or fabric.world_size == 1:
        return None
    from lit_gpt.training import gather_objects

    return lambda obj: gather_objects(fabric, obj)


def _std(x: torch.Tensor) -> torch.Tensor:
    from lit_gpt.grpo import nanstd

    return nanstd(x) if x.numel() > 1 else torch.zeros(())


def completion_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor,
                     temperature: float, rows: Optional[torch.Tensor] = None, chunk_rows: int = 1024) -> torch.Tensor:
    """(R, C) float32 log-probabilities of each completion token (at `index` of the label positions) under the
    model at `temperature` (TRL scales the logits so). With `rows` the head runs on the labelled positions only."""
    R, T = labels.shape
    if rows is not None:
        logits = model(input_ids, head_rows=rows)  # (n, V)
        targets = labels.reshape(-1).index_select(0, rows)
        tok = torch.cat([-F.cross_entropy(lc.float() / temperature, tc, reduction="none")
                         for lc, tc in zip(logits.split(chunk_rows), targets.split(chunk_rows))])
        flat = torch.zeros(R * T, dtype=torch.float32, device=tok.device).index_copy(0, rows, tok)
    else:
        logits = model(input_ids).reshape(R * T, -1)
        flat_labels = labels.reshape(-1)
        flat = torch.cat([-F.cross_entropy(lc.float() / temperature, tc, ignore_index=IGNORE_INDEX, reduction="none")
                          for lc, tc in zip(logits.split(chunk_rows), flat_labels.split(chunk_rows))])
    return flat.view(R, T).gather(1, index)
