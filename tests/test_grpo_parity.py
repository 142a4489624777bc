"""Our GRPO loss (lit_gpt.grpo, lit_gpt.recipes.grpo) equals TRL's GRPOTrainer (trl 1.16, in the tests only): the
advantages, the loss and the gradients for the loss types `grpo`, `dr_grpo` and `dapo`, on a fixed batch.

How they are compared. TRL's side is its own code path from the rollout on: a real `GRPOTrainer` (the policy loaded
with transformers from our HF export of a tiny checkpoint with the SmolLM2 tokenizer) whose generation step,
`_generate`, is replaced by one that returns fixed prompt and completion token ids (completions of different lengths,
some ending with EOS, some cut at the limit); everything after it is TRL's: `_generate_and_score_completions` pads
the prompts (left) and completions (right), calls the reward function (it returns each row's fixed "score" column,
None for one completion: unscorable), computes the group-relative advantages with its `scale_rewards`, and
`compute_loss` computes the per-token log-probabilities (its fused LM head, at the sampling temperature) and the loss;
we call backward on it. The old and reference log-probabilities are fixed tensors (the policy's own plus noise, so
that ratios leave the clip range and the KL is not 0), put into TRL's inputs where it keeps them
(`old_per_token_logps`, `ref_per_token_logps`); one case leaves `old` out (TRL's on-policy default).

Our side takes the same token ids as prompt samples and completions through `GRPO._rows` (the rows the loop trains
on), the advantages from `group_advantages` on the same rewards, and the loss from `completion_logps` + `grpo_loss`
(the functions `GRPO.loss` calls) with the same old/reference tensors; the on-policy case runs `GRPO.count`,
`inputs` and `loss` over two micro-batches, each summed loss divided by the step's units as `training.fit` does.
Our gradients are exported with the checkpoint converter and compared by HF name (tests/test_dpo_parity.py's
helpers), with and without the labelled rows (`labelled_rows`: the loop's two code paths).
"""

import tempfile
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from test_dpo_parity import checkpoints, cpu_accelerate, hf_grads, rel  # noqa: F401  (fixtures and helpers)

TOL = 1e-5
G = 4
MAX_NEW = 7
PROMPTS = [[1, 504, 2365, 314, 216, 30], [1, 2743, 28, 11, 1073, 3213, 314, 4273, 30, 198]]
COMPLETIONS = [[355, 30, 2], [1073, 2], [12, 13, 14, 15, 16, 17, 18], [2],  # EOS = 2; the third is cut at the limit
               [8, 9, 2], [10, 11, 12, 13, 2], [7, 2], [99, 98, 97, 96]]
SCORES = [1.0, 0.0, 0.5, None, 2.0, 2.0, 0.0, 1.0]


@dataclass(frozen=True)
class Case:
    loss: str
    beta: float
    scale_rewards: str
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    old: bool = True  # fixed old log-probabilities (else on-policy: old = the policy's own, detached)
    bias_correction_kl: bool = True  # TRL's use_bias_correction_kl (its default): the KL term times the ratio
    temperature: float = 1.0


CASES = {
    "grpo": Case("grpo", 0.04, "group", temperature=0.7),
    "dr_grpo": Case("dr_grpo", 0.0, "none"),
    "dapo": Case("dapo", 0.1, "batch", epsilon_high=0.28),
    "dapo-on-policy": Case("dapo", 0.05, "group", old=False),
    "grpo-kl-uncorrected": Case("grpo", 0.1, "group", bias_correction_kl=False),
}


def fixed_logps(policy_logps: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return policy_logps + scale * torch.randn(policy_logps.shape, generator=g)


def trl_step(checkpoints, case: Case, old: Optional[torch.Tensor], ref: Optional[torch.Tensor]):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    policy = AutoModelForCausalLM.from_pretrained(checkpoints["policy_hf"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["policy_hf"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [{"prompt": f"prompt {i}", "score": SCORES[i * G + j]} for i in range(len(PROMPTS)) for j in range(G)]

    def score(prompts, completions, score, **kwargs):
        return list(score)

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, loss_type=case.loss, beta=case.beta, epsilon=case.epsilon,
                          epsilon_high=case.epsilon_high, scale_rewards=case.scale_rewards, num_generations=G,
                          per_device_train_batch_size=len(COMPLETIONS), max_completion_length=MAX_NEW,
                          temperature=case.temperature, use_bias_correction_kl=case.bias_correction_kl,
                          report_to="none", use_cpu=True, bf16=False, seed=0)
        trainer = GRPOTrainer(model=policy, reward_funcs=[score], args=args,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    assert trainer.args.device.type == "cpu" and trainer.loss_type == case.loss

    def fixed_generate(prompts):
        ids = [PROMPTS[i // G] for i in range(len(prompts))]
        texts = [tokenizer.decode(c) for c in COMPLETIONS]
        return ids, COMPLETIONS, None, texts, None, {}, None, None

    trainer._generate = fixed_generate
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    C = batch["completion_ids"].size(1)
    assert C == MAX_NEW and batch["completion_mask"].sum() == sum(map(len, COMPLETIONS))
    assert "old_per_token_logps" not in batch  # one update per generation: TRL's default is on-policy
    if old is not None:
        batch["old_per_token_logps"] = old[:, :C]
    if case.beta:
        batch["ref_per_token_logps"] = ref[:, :C]
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": loss.detach(), "grads": grads, "advantages": batch["advantages"].cpu(), "metrics": metrics}


def prompt_batch(objective, prompts):
    return objective.collate([{"input_ids": torch.tensor(p), "fields": {}} for p in prompts], 64)


@pytest.mark.slow  # TRL's trainer per case: ~5-10 s each (and ~20 s to import trl) on 2 cores
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_advantages_loss_and_gradients_equal_trl(case, checkpoints, cpu_accelerate, tmp_path):  # noqa: F811
    from lit_gpt.grpo import group_advantages, grpo_loss
    from lit_gpt.loading import load_model
    from lit_gpt.losses import labelled_rows
    from lit_gpt.recipes.grpo import GRPO, GRPOArgs, completion_logps

    args = GRPOArgs(group_size=G, max_new_tokens=MAX_NEW, temperature=case.temperature, loss=case.loss,
                    beta=case.beta, epsilon=case.epsilon, epsilon_high=case.epsilon_high,
                    scale_rewards=case.scale_rewards, bias_correction_kl=case.bias_correction_kl)
    objective = GRPO(args)
    policy = load_model(checkpoints["policy"]).train()
    policy.requires_grad_(True)
    per_func = torch.tensor([[float("nan") if s is None else s] for s in SCORES])
    advantages, _ = group_advantages(per_func, torch.ones(1), G, case.scale_rewards)
    batch = objective._rows(prompt_batch(objective, PROMPTS), COMPLETIONS, advantages,
                            torch.ones(len(COMPLETIONS), dtype=torch.bool))
    with torch.no_grad():
        own = completion_logps(policy, batch["input_ids"], batch["labels"], batch["index"], case.temperature)
    old = fixed_logps(own, 1, 0.5) if case.old else None
    ref = fixed_logps(own, 2, 0.5)
    batch["ref"] = ref

    trl = trl_step(checkpoints, case, old, ref)
    assert torch.allclose(advantages, trl["advantages"], atol=1e-6, rtol=1e-6), (advantages, trl["advantages"])
    assert advantages[3] == 0.0 and (advantages != 0).sum() >= 6  # the unscored completion, and the others
    if case.old:  # the fixed old log-probabilities move ratios out of the clip range: the clipping is exercised
        assert trl["metrics"]["clip_ratio/region_mean"] > 0
    loss_scale = float((batch["advantages"].abs().unsqueeze(1) * batch["mask"]).sum() / batch["mask"].sum())
    for with_rows in (False, True):
        policy.zero_grad(set_to_none=True)
        rows_of = lambda b: labelled_rows(b["labels"]) if with_rows else None  # noqa: E731
        if case.old:
            logps = completion_logps(policy, batch["input_ids"], batch["labels"], batch["index"], case.temperature,
                                     rows_of(batch))
            loss, stats = grpo_loss(logps, old, ref if case.beta else None, batch["advantages"], batch["mask"],
                                    loss_type=case.loss, beta=case.beta, epsilon=case.epsilon,
                                    epsilon_high=case.epsilon_high, max_completion_length=MAX_NEW,
                                    bias_correction_kl=case.bias_correction_kl)
            total = loss / objective.count(batch)
            total.backward()
        else:  # the loop's accounting: two micro-batches (one prompt each), each sum divided by the step's units
            halves = [{k: (v[i * G:(i + 1) * G] if torch.is_tensor(v) else v) for k, v in batch.items()}
                      for i in range(2)]
            step_units = sum(objective.count(h) for h in halves)
            total = torch.zeros(())
            for h in halves:
                loss, _ = objective.loss(policy, objective.inputs(h), rows_of(h))
                (loss / step_units).backward()
                total = total + loss.detach() / step_units
        # the loss sums terms of both signs (advantages average 0): exact to float32 rounding of its terms, ~1e-7 of
        # the summed magnitudes, not of the (small) result itself; so that is its absolute tolerance
        assert abs(float(total) - float(trl["loss"])) <= TOL * abs(float(trl["loss"])) + 1e-6 * loss_scale, (
            with_rows, float(total), float(trl["loss"]))
        grads = hf_grads(policy, tmp_path / f"rows{int(with_rows)}")
        assert set(trl["grads"]) <= set(grads)
        flat = lambda g: torch.cat([g[n].reshape(-1) for n in sorted(trl["grads"])])  # noqa: E731
        assert flat(trl["grads"]).norm() > 0
        assert rel(flat(grads), flat(trl["grads"])) < TOL, (with_rows, rel(flat(grads), flat(trl["grads"])))
        for name, theirs in trl["grads"].items():
            assert rel(grads[name], theirs) < 1e-4, (with_rows, name, rel(grads[name], theirs))
