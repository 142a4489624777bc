"""GRPO's pieces that need no model loop: the loss (TRL 1.16's `grpo`, `dr_grpo` and `dapo`), group-relative
advantages, reward functions, and the prompt data of scripts/prepare_prompts.py. The objective that samples and
trains (`GRPO`, an objective of the one loop) is `lit_gpt.recipes.grpo`; it needs the generation loop.

The loss is TRL's `GRPOTrainer._compute_loss` (trl 1.16) with token-level importance sampling, term for term: per
completion token the ratio r = exp(logp - old_logp), the clipped surrogate -min(r A, clip(r, 1 - eps, 1 + eps_high) A)
plus beta x the k3 estimate of KL(policy || reference), exp(ref - logp) - (ref - logp) - 1 (times r: TRL's
`use_bias_correction_kl`, its default); then per loss type:

* `grpo`: each completion's mean over its tokens, averaged over the completions;
* `dr_grpo`: the sum over all completion tokens / (completions x max_completion_length);
* `dapo`: the sum over all completion tokens / the completion tokens of the whole step (TRL's default).

The one loop averages a step's summed loss over the step's units (`units`): completions for grpo and dr_grpo,
completion tokens for dapo, so a step split into micro-batches or devices gives TRL's mean over the whole step.

Advantages (TRL's `sum_then_normalize`): the weighted sum of the reward functions, minus its group's mean, divided by
(std + 1e-4) of the group (`scale_rewards="group"`), of the whole batch ("batch") or not at all ("none"); a
completion that no reward function scored (all None) gets advantage 0.
"""

import importlib
import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lit_gpt.batches import IGNORE_INDEX, Sample
from lit_gpt.utils import LitError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
KIND = "prompts"  # meta["kind"] of a prepared folder of prompts (scripts/prepare_prompts.py)


# ---------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------
def check_grpo(loss_type: str, beta: float, epsilon: float, epsilon_high: Optional[float], scale_rewards: str,
               group_size: int, temperature: float, top_p: float, max_new_tokens: int) -> None:
    """The GRPO settings, one line for a bad one (before anything loads)."""
    if loss_type not in LOSS_TYPES:
        raise LitError(f"--grpo.loss must be one of {', '.join(LOSS_TYPES)} (TRL's names), got {loss_type!r}")
    if scale_rewards not in SCALE_REWARDS:
        raise LitError(f"--grpo.scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    if beta < 0:
        raise LitError(f"--grpo.beta must be >= 0, got {beta}")
    if not 0 <= epsilon < 1 or (epsilon_high is not None and epsilon_high < 0):
        raise LitError(f"--grpo.epsilon must be in [0, 1) and --grpo.epsilon_high >= 0, got {epsilon}, {epsilon_high}")
    if group_size < 2:
        raise LitError(f"--grpo.group_size must be >= 2 (advantages compare completions of one prompt),"
                       f" got {group_size}")
    if not temperature > 0:
        raise LitError(f"--grpo.temperature must be > 0 (GRPO samples), got {temperature}")
    if not 0 < top_p <= 1:
        raise LitError(f"--grpo.top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise LitError(f"--grpo.max_new_tokens must be >= 1, got {max_new_tokens}")


def units(loss_type: str, mask: torch.Tensor) -> torch.Tensor:
    """What a step's loss is averaged over: completions (grpo, dr_grpo) or completion tokens (dapo). `mask` (R, C)."""
    if loss_type == "dapo":
        return mask.sum()
    return (mask.sum(-1) > 0).sum()


def _unit_sum(x: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The sum over the units of the per-unit value of x (R, C): each completion's token mean, or every token."""
    if loss_type == "dapo":
        return (x * mask).sum()
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()


def grpo_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
              advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: str, beta: float, epsilon: float,
              epsilon_high: Optional[float], max_completion_length: int, bias_correction_kl: bool = True
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, summed stats (KL, clip fraction)) over the units of (R, C) completion-aligned per-token
    log-probabilities (`mask` 1 on completion tokens). `old_logps` None: the policy's own, detached (one update per
    generation, TRL's default: the ratio is 1, its gradient that of logp). `ref_logps` None with beta 0.
    `bias_correction_kl` (TRL's `use_bias_correction_kl`, on by default in trl 1.16): the KL term times the ratio,
    which makes its gradient the unbiased reverse-KL gradient (DeepSeek-V3.2)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    kl = torch.zeros_like(per_token)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo_loss: beta > 0 needs the reference log-probabilities")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:
            kl = kl * coef_1
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / max_completion_length
    elif loss_type == "dapo":
        loss = (per_token * mask).sum()
    else:
        raise LitError(f"--grpo.loss must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    clipped = ((coef_1 < 1 - epsilon) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0))
    stats = torch.stack([_unit_sum(kl.detach(), mask, loss_type), _unit_sum(clipped.to(mask.dtype), mask, loss_type)])
    return loss, stats


def nanstd(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN for fewer than 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    return var.sqrt()


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int, scale_rewards: str,
                     real: Optional[torch.Tensor] = None, gather: Optional[Callable[[Any], List[Any]]] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), rewards (N,)) of N = prompts x group_size completions (each prompt's group consecutive)
    from (N, F) rewards per function (NaN: not scored), as TRL 1.16's `sum_then_normalize`. `scale_rewards`
    "batch": the std of the step's rewards, the rows of `real` only (padding prompts count nothing), over all
    processes when `gather` is given (`gather(obj)`: every process's obj in rank order), as TRL's is over the
    gathered global batch: 2 processes give the advantages of 1."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale_rewards == "batch":
        counted = rewards if real is None else rewards[real]
        if gather is not None:
            counted = torch.cat([torch.as_tensor(t, dtype=rewards.dtype) for t in gather(counted)])
        std = nanstd(counted).expand_as(rewards) if counted.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), rewards


# ---------------------------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------------------------
RewardFn = Callable[..., Sequence[Optional[float]]]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _number(text: str) -> Optional[float]:
    found = _NUMBER.findall(str(text).replace(",", ""))
    return float(found[-1]) if found else None


def answer_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **_: Any) -> List[float]:
    """1.0 when the completion is the answer (exactly, spaces aside) or its last number equals the answer's value,
    else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        if str(completion).strip() == str(expected).strip():
            out.append(1.0)
            continue
        got, want = _number(completion), _number(str(expected))
        out.append(1.0 if got is not None and want is not None and math.isclose(got, want) else 0.0)
    return out


_NUMBER_ONLY = re.compile(r"^\s*-?\d+(?:\.\d+)?\s*$")


def number_only(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> List[float]:
    """A format check: 1.0 when the completion is a number alone (no words around it), else 0.0."""
    return [1.0 if _NUMBER_ONLY.match(str(c)) else 0.0 for c in completions]


BUILTIN_REWARDS: Dict[str, RewardFn] = {"answer_match": answer_match, "number_only": number_only}


@dataclass
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0


def _import(spec: str) -> RewardFn:
    module, _, function = spec.rpartition(":")
    # a module beside where the command runs (`python finetune/grpo.py` puts the script's folder on sys.path, not
    # the working one): read as its file, sys.path left as it is
    beside = Path(f"{module}.py")
    if not module.endswith(".py") and "." not in module and beside.is_file() and importlib.util.find_spec(module) is None:
        module = str(beside)
    try:
        if module.endswith(".py"):
            loader = importlib.util.spec_from_file_location(Path(module).stem, module)
            if loader is None or not Path(module).is_file():
                raise ImportError(f"no file {module!r}")
            mod = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(mod)  # type: ignore[union-attr]
        else:
            mod = importlib.import_module(module)
    except Exception as e:  # any import failure is the user's reward module: one line
        raise LitError(f"--reward {spec}: cannot import {module!r} ({type(e).__name__}: {e})") from None
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise LitError(f"--reward {spec}: {module!r} has no function {function!r}")
    return fn


def load_rewards(specs: Sequence[str]) -> List[Reward]:
    """`NAME` or `NAME=WEIGHT`, NAME a built-in (answer_match, number_only) or `module:function` / `file.py:function`
    (called as TRL calls reward functions: prompts=, completions=, completion_ids=, and the row's fields as lists;
    returns one float or None per completion)."""
    if not specs:
        raise LitError(f"give at least one --reward (built in: {', '.join(BUILTIN_REWARDS)}, or module:function)")
    out = []
    for spec in specs:
        name, weight = spec, 1.0
        if "=" in spec:
            name, _, w = spec.rpartition("=")
            try:
                weight = float(w)
            except ValueError:
                raise LitError(f"--reward {spec}: the weight after '=' must be a number") from None
        if name in BUILTIN_REWARDS:
            fn = BUILTIN_REWARDS[name]
        elif ":" in name:
            fn = _import(name)
        else:
            raise LitError(f"--reward {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor"
                           " module:function")
        out.append(Reward(name, fn, weight))
    return out


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          completion_ids: Sequence[List[int]], fields: Sequence[Dict[str, Any]]) -> torch.Tensor:
    """(N, F) float32 rewards per function (None -> NaN). A function that raises or returns the wrong count is one
    line naming it."""
    keys = sorted({k for f in fields for k in f})
    columns = {k: [f.get(k) for f in fields] for k in keys}
    out = torch.full((len(completions), len(rewards)), float("nan"))
    for j, reward in enumerate(rewards):
        try:
            values = list(reward.fn(prompts=list(prompts), completions=list(completions),
                                    completion_ids=[list(c) for c in completion_ids], **columns))
        except Exception as e:  # the user's function: what failed and where, in one line
            raise LitError(f"reward function {reward.name!r} raised {type(e).__name__}: {e}") from None
        if len(values) != len(completions):
            raise LitError(f"reward function {reward.name!r} returned {len(values)} values for {len(completions)}"
                           " completions (one float or None per completion)")
        for i, v in enumerate(values):
            if v is not None:
                try:
                    out[i, j] = float(v)
                except (TypeError, ValueError):
                    raise LitError(f"reward function {reward.name!r} returned {v!r}, not a number or None") from None
    return out


# ---------------------------------------------------------------------------------------------------------------
# Prompt data (scripts/prepare_prompts.py writes it, the GRPO objective reads it)
# ---------------------------------------------------------------------------------------------------------------
def prompt_sample(prompt_ids: torch.Tensor, fields: Dict[str, Any]) -> Sample:
    """A prompt sample: its tokens, labels all masked (nothing to imitate), and the row's other fields (the answer),
    also as UTF-8 bytes so that the data's fingerprint covers them."""
    encoded = json.dumps(fields, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return {"input_ids": prompt_ids, "labels": torch.full_like(prompt_ids, IGNORE_INDEX), "fields": fields,
            "fields_utf8": torch.tensor(list(encoded), dtype=torch.int64)}


def load_prompts(data_dir: Path, checkpoint_dir: Optional[Path] = None) -> Any:
    """A folder written by scripts/prepare_prompts.py (checked as `lit_gpt.data.load_prepared` checks SFT data)."""
    from lit_gpt import data

    prepared = data.load_prepared(Path(data_dir), checkpoint_dir)
    if prepared.meta.get("kind") != KIND:
        raise LitError(
            f"{str(data_dir)!r} holds {prepared.meta.get('kind', 'instruction')} data, not prompts: prepare a file of"
            " {prompt, answer} rows with python scripts/prepare_prompts.py --data_file FILE --checkpoint_dir"
            f" {checkpoint_dir or '<model>'} --destination_path DIR")
    for split in (prepared.train, prepared.val):
        for s in split:
            if not isinstance(s.get("fields"), dict):
                raise LitError(f"{str(data_dir)!r}: a sample has no fields; prepare it again with"
                               " scripts/prepare_prompts.py")
    return prepared
