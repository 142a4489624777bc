"""Our DPO objective (lit_gpt.objectives.DPO) equals TRL's DPOTrainer (trl 1.16, in the tests only): loss, gradients
and logged rewards, on a tiny Llama with the real SmolLM2 tokenizer and a fixed batch of preference pairs.

TRL's side is its own code end to end: a real `DPOTrainer` (policy and a separate reference model loaded with
transformers from our HF export of two tiny checkpoints, seeds 1 and 0, so the log-ratios are not 0) tokenizes the
string pairs itself (`train_dataset`: prompt_ids / chosen_ids / rejected_ids, EOS appended), batches them with its
`data_collator` and computes the loss with `compute_loss` (its fused LM head, the reference forward, the loss and
`_metrics`); we call backward on that loss. Our side takes the same token ids as preference samples, the reference
log-probabilities of our reference model (`reference_logps`, precomputed), `DPO.collate` / `inputs` / `loss` with
and without the labelled rows (`labelled_rows`: both code paths of the loop), divided by the step's pair count as
`training.fit` does, and our gradients go through the checkpoint exporter (`convert_lit_checkpoint`: the fused qkv
split as for the weights) to be compared by HF name.

One thing is switched off, not stubbed: with torch_xla installed (it is, here), accelerate picks its XLA backend
whatever `use_cpu` says (accelerate 1.x `PartialState._prepare_backend`), and the trainer then puts the models on
the XLA device. `cpu_accelerate` applies accelerate's and transformers' documented switch for that,
USE_TORCH_XLA=false, in-process for the test only (both read the variable at import, so the flags they derived
from it are patched and their caches cleared) and resets accelerate's singleton state before and after.

Also: the micro-batch accounting (pairs split over micro-batches, a padding pair included, each micro-batch's sum
divided by the step's pairs equals TRL's mean over one batch), and the LoRA reference (adapters switched off)
equals the precomputed log-probabilities of the base model.
"""

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from tiny import random_model, tiny_llama_config, write_checkpoint

TOL = 1e-5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")
PAIRS = [  # different prompt and reply lengths; tokenized by TRL itself
    {"prompt": "What is 2+2?", "chosen": " It is four.", "rejected": " Five, I think, or maybe six."},
    {"prompt": "Name the colour of the sky on a clear day.", "chosen": " Blue.", "rejected": " Green"},
    {"prompt": "Hi", "chosen": " Hello there, how can I help you today?", "rejected": " Go away."},
    {"prompt": "Translate 'chat' from French to English, please, in one word.", "chosen": " Cat.",
     "rejected": " It means to talk."},
]


@dataclass(frozen=True)
class Case:
    loss_type: str
    beta: float
    label_smoothing: float = 0.0
    micro_batch: Optional[int] = None  # pairs per micro-batch on our side (None: one micro-batch of all pairs)


CASES = {
    "sigmoid": Case("sigmoid", 0.1),
    "robust": Case("robust", 0.1, label_smoothing=0.2),
    "hinge": Case("hinge", 0.5),
    "ipo": Case("ipo", 0.1),
    "sigmoid-3+1-micro-batches": Case("sigmoid", 0.1, micro_batch=3),
    "ipo-3+1-micro-batches": Case("ipo", 0.1, micro_batch=3),
}
METRICS = {"rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected",
           "reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


# ---------------------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory) -> Dict[str, Path]:
    """Lit and HF folders of the reference (`tiny_dir`: seed 0) and the policy (the same model drawn with seed 1),
    both with the SmolLM2 tokenizer."""
    from lit_gpt import Config
    from lit_gpt.convert import convert_lit_checkpoint

    root = tmp_path_factory.mktemp("dpo_parity")
    policy = write_checkpoint(random_model(Config.from_checkpoint(tiny_dir), seed=1), root / "policy")
    for name in TOKENIZER_FILES:
        if (tiny_dir / name).is_file():
            shutil.copy(tiny_dir / name, policy / name)
    out = {"reference": tiny_dir, "policy": policy}
    for name in ("reference", "policy"):
        out[f"{name}_hf"] = convert_lit_checkpoint(out[name], root / f"{name}_hf")
    return out


@pytest.fixture
def cpu_accelerate():
    """USE_TORCH_XLA=false for accelerate and transformers, in-process (see the module docstring)."""
    import accelerate.utils.imports as acc_imports
    import transformers.utils.import_utils as tf_imports
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        acc_imports.is_torch_xla_available.cache_clear()
        tf_imports.is_torch_xla_available.cache_clear()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    environ = dict(os.environ)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(acc_imports, "_torch_xla_available", False)
            mp.setattr(tf_imports, "USE_TORCH_XLA", "0")
            reset()
            yield
    finally:
        reset()
        for key in set(os.environ) - set(environ):  # what accelerate's state set for the trainer
            del os.environ[key]
        os.environ.update(environ)


# ---------------------------------------------------------------------------------------------------------------
# the two sides
# ---------------------------------------------------------------------------------------------------------------
def trl_step(checkpoints: Dict[str, Path], case: Case) -> Tuple[List[dict], dict]:
    """TRL's tokenized pairs, and its loss, gradients (by HF name) and logged metrics for one batch of all pairs."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    policy = AutoModelForCausalLM.from_pretrained(checkpoints["policy_hf"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["reference_hf"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["policy_hf"])
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, beta=case.beta, loss_type=[case.loss_type],
                         label_smoothing=case.label_smoothing, report_to="none", use_cpu=True, bf16=False,
                         precompute_ref_log_probs=False, per_device_train_batch_size=len(PAIRS), max_length=None,
                         seed=0)
        trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                             train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=tokenizer)
    assert trainer.args.device.type == "cpu" and next(trainer.model.parameters()).device.type == "cpu"
    assert trainer.ref_model is not None and trainer.loss_types == [case.loss_type]
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    batch = trainer.data_collator(rows)
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return rows, {"loss": loss.detach(), "grads": grads, "metrics": metrics}


def preference_samples(rows: List[dict]) -> List[Dict[str, torch.Tensor]]:
    """TRL's token ids as our preference samples (prompt masked in the labels)."""
    samples = []
    for r in rows:
        prompt = r["prompt_ids"]
        chosen, rejected = prompt + r["chosen_ids"], prompt + r["rejected_ids"]
        mask = [-100] * len(prompt)
        samples.append({"input_ids": torch.tensor(chosen), "labels": torch.tensor(mask + r["chosen_ids"]),
                        "rejected_input_ids": torch.tensor(rejected),
                        "rejected_labels": torch.tensor(mask + r["rejected_ids"])})
    return samples


def our_step(model, objective, samples, micro_batch: Optional[int], with_rows: bool, max_seq_length: int = 128):
    """The loop's accounting (lit_gpt.training.fit): the step's micro-batches (padded to `micro_batch` pairs), each
    summed loss divided by the step's pair count; stats summed the same way. Returns (loss, stats means)."""
    from lit_gpt.losses import labelled_rows

    size = micro_batch or len(samples)
    batches = [objective.pad(objective.collate(samples[i : i + size], max_seq_length), size)
               for i in range(0, len(samples), size)]
    units = sum(objective.count(b) for b in batches)
    model.zero_grad(set_to_none=True)
    total, stats = torch.zeros(()), None
    for batch in batches:
        rows = labelled_rows(batch["labels"]) if with_rows else None
        if with_rows:
            assert rows is not None  # prompts and padding are masked: the head runs on the labelled rows only
        loss, s = objective.loss(model, objective.inputs(batch), rows)
        (loss / units).backward()
        total = total + loss.detach()
        stats = s if stats is None else stats + s
    return total / units, objective.metrics(stats.tolist(), units)


def hf_grads(model, tmp: Path) -> Dict[str, torch.Tensor]:
    """Our gradients by HF name: written as a lit checkpoint and exported as the weights are."""
    from safetensors.torch import load_file

    from lit_gpt.convert import convert_lit_checkpoint
    from lit_gpt.weights import save_weights

    state = {k: v.grad.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}  # tied: one grad
    lit = tmp / "grads"
    save_weights(state, lit)
    model.config.save(lit)
    out = convert_lit_checkpoint(lit, tmp / "grads_hf")
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_loss_gradients_and_rewards_equal_trl(case, checkpoints, cpu_accelerate, tmp_path):
    from lit_gpt.loading import load_model
    from lit_gpt.objectives import DPO, reference_logps

    rows, trl = trl_step(checkpoints, case)
    samples = preference_samples(rows)
    lengths = [s[k].numel() for s in samples for k in ("input_ids", "rejected_input_ids")]
    assert len(set(lengths)) >= 5  # rows of different lengths: the padding and its masks matter
    objective = DPO(case.beta, case.loss_type, case.label_smoothing, reference="precomputed")
    reference = load_model(checkpoints["reference"])
    ref = reference_logps(reference, objective, samples, rows=2, max_seq_length=128, place=lambda t: t,
                          end_step=lambda: None)
    samples = [{**s, "ref_logps": r} for s, r in zip(samples, ref)]

    policy = load_model(checkpoints["policy"]).train()
    policy.requires_grad_(True)
    # the log-ratios are not 0 (another seed), and not all of one sign: the rewards and accuracy say something
    assert 0 < trl["metrics"]["rewards/accuracies"] < 1 and abs(trl["metrics"]["rewards/margins"]) > 1e-3
    for with_rows in (False, True):
        loss, metrics = our_step(policy, objective, samples, case.micro_batch, with_rows)
        assert rel(loss, trl["loss"]) < TOL, (with_rows, float(loss), float(trl["loss"]))
        # a reward is beta x a difference of two float32 sums of ~-60: exact to ~1e-7 of those sums, not of itself
        # (the means here are near 0.01, partly of rewards of both signs), so that is its tolerance
        logps = max(abs(trl["metrics"]["logps/chosen"]), abs(trl["metrics"]["logps/rejected"]))
        reward_tol = 1e-6 * case.beta * logps
        assert metrics["reward_accuracy"] == trl["metrics"]["rewards/accuracies"]
        for ours, theirs in METRICS.items():
            assert metrics[ours] == pytest.approx(trl["metrics"][theirs], rel=TOL, abs=reward_tol), (with_rows, ours)
        grads = hf_grads(policy, tmp_path / f"rows{int(with_rows)}")
        assert set(grads) == set(trl["grads"])
        for name, theirs in trl["grads"].items():
            assert theirs.norm() > 0, name
            assert rel(grads[name], theirs) < TOL, (with_rows, name, rel(grads[name], theirs))
        flat = lambda g: torch.cat([g[n].reshape(-1) for n in sorted(g)])  # noqa: E731
        assert rel(flat(grads), flat(trl["grads"])) < TOL


# ---------------------------------------------------------------------------------------------------------------
# the LoRA reference: the adapters switched off equals the base model's precomputed log-probabilities
# ---------------------------------------------------------------------------------------------------------------
LORA_CASES = {"sigmoid": ("sigmoid", 0.1, 0.0), "robust": ("robust", 0.2, 0.1), "ipo": ("ipo", 0.1, 0.0)}


@pytest.mark.parametrize("loss_type, beta, label_smoothing", list(LORA_CASES.values()), ids=list(LORA_CASES))
def test_lora_adapters_off_reference_equals_precomputed_base(loss_type, beta, label_smoothing):
    from lit_gpt.lora import Config as LoRAConfig
    from lit_gpt.lora import GPT as LoRAGPT
    from lit_gpt.lora import mark_only_lora_as_trainable
    from lit_gpt.objectives import DPO, reference_logps

    config = tiny_llama_config(LoRAConfig, lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_query=True,
                               lora_value=True, lora_projection=True, lora_mlp=True)
    torch.manual_seed(0)
    model = LoRAGPT(config)
    model.apply(model._init_weights)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # B is 0 at init: the adapters would change nothing
                p.copy_(torch.randn_like(p) * 0.3)
    mark_only_lora_as_trainable(model)
    base = random_model(tiny_llama_config(), seed=123)  # other weights first, so the load below is what counts
    base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})

    g = torch.Generator().manual_seed(0)
    samples = []
    for prompt_len, chosen_len, rejected_len in ((3, 5, 2), (6, 2, 7), (1, 4, 4)):
        prompt = torch.randint(1, 256, (prompt_len,), generator=g)
        chosen = torch.cat([prompt, torch.randint(1, 256, (chosen_len,), generator=g)])
        rejected = torch.cat([prompt, torch.randint(1, 256, (rejected_len,), generator=g)])
        masked = lambda t: torch.cat([torch.full((prompt_len,), -100), t[prompt_len:]])  # noqa: E731
        samples.append({"input_ids": chosen, "labels": masked(chosen), "rejected_input_ids": rejected,
                        "rejected_labels": masked(rejected)})

    adapters_off = DPO(beta, loss_type, label_smoothing, reference="adapters_off")
    precomputed = DPO(beta, loss_type, label_smoothing, reference="precomputed")
    # all pairs in one forward, the shape of the training forward: without `rows` the two are then bitwise equal
    ref = reference_logps(base, precomputed, samples, rows=len(samples), max_seq_length=32, place=lambda t: t,
                          end_step=lambda: None)
    with_ref = [{**s, "ref_logps": r} for s, r in zip(samples, ref)]
    lora_params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora_params and all("lora_" in n for n in lora_params)
    model.train()
    for with_rows in (False, True):
        results = []
        for objective, data in ((adapters_off, samples), (precomputed, with_ref)):
            batch = objective.collate(data, max_seq_length=32)
            assert ("ref" in batch) == (objective is precomputed)
            loss, metrics = our_step(model, objective, data, None, with_rows, max_seq_length=32)
            results.append((loss, metrics, {n: p.grad.clone() for n, p in lora_params.items()}))
        (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
        assert abs(metrics_a["rewards_chosen"]) > 1e-3  # the adapters do change the log-probabilities
        # with `rows` the adapters-off reference runs the head on the labelled rows only, the precomputed one on
        # all (reference_logps): float32 rounding of other matmul shapes, ~1e-7 of the log-probabilities, which
        # the cancelling pair gradients amplify to ~2e-6 (sigmoid, qkv lora_A)
        grad_tol = 1e-5 if with_rows else 1e-6
        assert rel(loss_a, loss_b) < 1e-6, (with_rows, float(loss_a), float(loss_b))
        reward_tol = 1e-6 * beta * float(torch.stack(ref).abs().max())  # as in the test above
        for k in metrics_a:
            assert metrics_a[k] == pytest.approx(metrics_b[k], rel=1e-6, abs=reward_tol), (with_rows, k)
        for n in grads_a:
            assert grads_a[n].norm() > 0, n
            assert rel(grads_a[n], grads_b[n]) < grad_tol, (with_rows, n, rel(grads_a[n], grads_b[n]))
