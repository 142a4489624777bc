"""Mixture-of-experts models (lit_gpt.moe) on XLA:CPU, 1 device and 8 (FSDP over SPMD): static shapes, sharded
experts, the real recipes against the CPU's. The tiny families are tests/words.py `MOE_FAMILIES` (Mixtral,
Qwen3-MoE with a dense first layer, gpt-oss with sinks, biased clamped-SwiGLU experts and sliding windows).

The default suite runs the refusals only (the suite's budget, tests/README.md; the CPU's MoE training, parity and
generation tests are in tests/test_moe_*.py); `-m slow` runs everything below, on 1 and on 8 devices (SLOW_DEVICES).

The runs on 1 and 8 devices:
* a probe (this file's `setup`, run as a worker job): four train steps of a directly driven model on different
  tokens (so different routing), cross-entropy plus the load-balancing loss: one compilation (the first step), no
  device->host transfer in any step and no op that falls back to the CPU (torch_xla's `aten::` counters: `nonzero`,
  boolean indexing and data-dependent sizes would); on 8 devices every expert weight (n_expert, out, in) is split
  8 ways by FSDPv2;
* the probe also shows why `--activation_checkpointing true` wraps MoE blocks with `lit_gpt.xla.scan.checkpoint_block`:
  under torch_xla's `checkpoint_module` the routing the layers keep has no gradient (the forward ran under no_grad),
  returned through the checkpoint it has;
* per family, one method (Mixtral LoRA on attention and the experts, Qwen3-MoE adapter, gpt-oss full) through
  `xla/finetune/<method>.py` on 1 and 8 devices, the router's load-balancing loss in the objective: the same
  logged losses as `finetune/<method>.py --precision 32-true` on the CPU (relative 1e-4), final weights within
  5e-5 (`WEIGHT_ATOL`), and the train step compiled once per padded length: 4 steps over two lengths (two steps each,
  other rows) compile 1, 1, 1, 0 (the run's first step also creates AdamW's state, a graph of its own, as for
  dense models). The forwards see the same rows on every backend (the load-balancing loss depends on which tokens
  share a forward): micro-batch 8 on the CPU and on one XLA device, 1 per device on 8 (one global forward);
* gpt-oss full finetuning stopped after step 1's checkpoint and resumed with `--resume auto` on XLA (1 and 8
  devices): bit-identical final weights, the same logged loss;
* per family, `xla/generate/base.py` on 1 and 8 devices: 2 compilations (prefill, decode) for the first prompt of a
  bucket, 0 for a second prompt of another length in it, and the same greedy text as `generate/base.py` on the CPU;
* no refusals (no XLA runtime needed): `--scan_layers true` and `--activation_checkpointing true` pass the recipes'
  checks on an MoE model with a load-balancing loss, and `--scan_layers auto` scans a deep one (their losses equal
  the loop's: tests/xla/test_scan.py).

The matrix: every family x LoRA / adapter / full on the three backends, and resume on XLA for each.

Cost: one worker process per device count runs every job the selected tests need (fixture `runs`): the runtime
starts once, and under -m slow the three training runs above (and gpt-oss's resume) are the matrix's own cells, run
once.
"""

import json
from pathlib import Path
from typing import Dict, List

import pytest
import torch

# this file also runs as a worker job (tests/xla/families_worker.py, launched with tests/ on PYTHONPATH as pytest has it)
from test_xla_families import (  # the families' helpers: same workers, same CPU runs
    METHODS, REPO, Workers, _cpu, _losses, _selected, _weights,
)
from words import GEN_PROMPT, MOE_FAMILIES, WORDS, family_checkpoints

FAMILIES = list(MOE_FAMILIES)
SLOW_DEVICES = (1, 8)  # every XLA run of this module is slow (tests/xla/conftest.py)
STEPS = 4  # two per padded length
GEN_TOKENS = 12
GEN_PROMPTS = {"a": "red green blue cat dog sun", "b": "moon tree river stone bird fish red green blue cat"}
DEFAULT_METHOD = {"mixtral": "lora", "qwen3_moe": "adapter", "gpt_oss": "full"}
RESUME_FAMILY = "gpt_oss"
# the forwards see the same 8 rows everywhere: one micro-batch of 8 on the CPU and on one XLA device, one row per
# device on 8 (one global forward)
MICRO = {"cpu": "8", "xla1": "8", "xla8": "1"}
COMMON = [
    "--train.global_batch_size", "8", "--train.max_steps", str(STEPS), "--train.save_interval", "1",
    "--train.log_interval", "1", "--train.lr_warmup_steps", "1", "--data.shuffle", "false",
    "--eval.interval", "1000", "--eval.final_validation", "false", "--accelerator", "cpu",
]
# LoRA on the experts too, once the recipes have the flag
LORA_EXPERTS = ["--lora_experts", "true"] if "lora_experts" in (REPO / "lit_gpt/recipes/flags.py").read_text() else []
PROBE = "tests/xla/test_xla_moe.py"


def moe_rows() -> List[dict]:
    """32 rows for 4 steps of 8 (--data.shuffle false): steps 1-2 of 61 tokens, steps 3-4 of 81, every row other
    words (so every step routes differently), one length per step (the padding is the only difference between
    backends: to the sample on the CPU, to the bucket on XLA)."""
    rows = []
    for i in range(32):
        n = 10 if i < 16 else 20
        ws = " ".join(WORDS[(5 * i + 7 * j) % len(WORDS)] for j in range(n))
        rows.append({"instruction": GEN_PROMPT, "input": ws, "output": ws})
    return rows


# final weights against the CPU's, every method: 5e-5 (the dense families' full / adapter bound; their LoRA's is
# 1e-5). 4 steps here, not 2: gpt-oss LoRA (lr 0.02, attention and experts) ended 1.6e-5 away in a LoRA A matrix
# with losses equal to 1e-4 (AdamW's first steps scale up the rounding of tiny gradients summed in another order)
WEIGHT_ATOL = 5e-5
# the adapters' lr: 0.02 here (the dense families' 0.05 over 2 steps): over 4 steps on 8 devices the adapter prompt
# of Qwen3-MoE ended 6.3e-5 from the CPU's at 0.05 (losses equal to 1e-4): AdamW scales the rounding of near-zero
# gradients summed in another order up to a step's size; at 0.02 the 5e-5 of the contract is 0.25% of one step
OWN_LR = {"adapter": ["--train.learning_rate", "0.02"]}


def _args(ckpt: Path, family: str, method: str, backend: str, out_dir: Path, *extra: str) -> List[str]:
    own = METHODS[method][0] + (LORA_EXPERTS if method == "lora" else []) + OWN_LR.get(method, [])
    args = ["--checkpoint_dir", str(ckpt / family), "--data.data_dir", str(ckpt / "data"), "--out_dir", str(out_dir),
            *COMMON, "--train.micro_batch_size", MICRO[backend], *own, *extra]
    return args + (["--precision", "32-true"] if backend == "cpu" else [])


def _dir(root: Path, family: str, method: str, backend: str, resumed: bool = False) -> Path:
    return root / f"{family}_{method}_{backend}{'_resumed' if resumed else ''}"


def _train_jobs(ckpt: Path, root: Path, family: str, method: str, devices: int, resume: bool) -> List[dict]:
    backend = f"xla{devices}"
    script = f"xla/finetune/{method}.py"
    full, resumed = _dir(root, family, method, backend), _dir(root, family, method, backend, resumed=True)
    jobs = [{"name": f"{family}_{method}", "script": script, "args": _args(ckpt, family, method, backend, full)}]
    if resume:
        jobs.append({"name": f"{family}_{method}_resumed", "script": script,
                     "copy_checkpoint": [str(full / "step-000001"), str(resumed / "step-000001")],
                     "args": _args(ckpt, family, method, backend, resumed, "--resume", "auto")})
    return jobs


def _gen_args(ckpt: Path, family: str, prompt: str) -> List[str]:
    return ["--checkpoint_dir", str(ckpt / family), "--prompt", prompt, "--prompt_style", "raw",
            "--temperature", "0", "--max_new_tokens", str(GEN_TOKENS), "--accelerator", "cpu"]


def _compiles(out_dir: Path) -> Dict[int, int]:
    import csv

    values = {}
    for path in (out_dir / "logs" / "csv").glob("version_*/metrics.csv"):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("compiles"):
                    values[int(float(row["step"]))] = int(float(row["compiles"]))
    return values


# ---------------------------------------------------------------------------------------------------------------
# the probe: a worker job (families_worker.py calls `setup` through jsonargparse, like a recipe's)
# ---------------------------------------------------------------------------------------------------------------
def setup(checkpoint_dir: str = "", out: str = "", steps: int = 4) -> None:
    """Runs in an XLA worker: train steps of a directly driven MoE model (FSDPv2 on every device) with the
    load-balancing loss, counting compilations, device->host transfers and CPU fallbacks per step; the expert
    weights' shardings; whether the routing keeps a gradient under torch_xla's activation checkpointing. Writes
    OUT (JSON)."""
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.debug.metrics as met

    import lit_gpt.xla as lx
    from lit_gpt import GPT, Config
    from lit_gpt.moe import load_balancing_loss
    from lit_gpt.weights import check_checkpoint_dir
    from lit_gpt.xla.diagnostics import compile_count, metric_count

    config = Config.from_file(Path(checkpoint_dir) / "lit_config.json")
    fabric = lx.make_fabric()
    fabric.launch()
    model = lx.load_staged(config, check_checkpoint_dir(Path(checkpoint_dir)), fabric, progress=False)
    model.train()
    wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    shardings = {name: torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in wrapped.named_parameters()
                 if ".experts." in name and name.endswith("weight")}
    torch_xla.sync(wait=True)
    per_step, routed = [], []
    for step in range(steps):
        ids = torch.randint(3, config.vocab_size, (8, 65), generator=torch.Generator().manual_seed(step))
        x, y = lx.shard_batch(fabric, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
        c0, t0 = compile_count(), metric_count("TransferFromDeviceTime")
        logits, routing = wrapped(x, return_routing=True)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.02 * load_balancing_loss(routing)
        fabric.backward(loss)
        optimizer.step()  # ends with torch_xla.sync()
        optimizer.zero_grad()
        torch_xla.sync(wait=True)
        per_step.append({"compiles": compile_count() - c0,
                         "transfers_from_device": metric_count("TransferFromDeviceTime") - t0})
        routed.append([r.experts.cpu().tolist() for r in routing])  # after the step
    fallbacks = sorted(n for n in met.counter_names() if n.startswith("aten::"))

    # activation checkpointing by torch_xla's checkpoint_module on each block, and as the strategy applies it
    # (lit_gpt.xla.scan.checkpoint_block: the routing returned through the checkpoint)
    from torch_xla.distributed.fsdp import checkpoint_module

    from lit_gpt.xla.scan import checkpoint_block

    device = torch_xla.device()
    aux_grad = {}
    for checkpointed, wrap in (("none", None), ("checkpoint_module", checkpoint_module),
                               ("checkpoint_block", checkpoint_block)):
        torch.manual_seed(0)
        plain = GPT(config).to(device)
        plain.train()
        if wrap is not None:
            for i, block in enumerate(plain.transformer.h):
                plain.transformer.h[i] = wrap(block)
        _, routing = plain(ids[:, :-1].to(device), return_routing=True)
        aux = load_balancing_loss(routing)
        aux_grad[checkpointed] = bool(aux.requires_grad)
    Path(out).write_text(json.dumps({"shardings": shardings, "steps": per_step, "fallbacks": fallbacks,
                                     "routing_differs": routed[0] != routed[1], "aux_requires_grad": aux_grad}))


# ---------------------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return family_checkpoints(tmp_path_factory.mktemp("moe"), list(FAMILIES), moe_rows())


def _probe_job(ckpt: Path, root: Path, devices: int) -> dict:
    return {"name": "probe", "script": PROBE,
            "args": ["--checkpoint_dir", str(ckpt / "gpt_oss"), "--out", str(root / f"probe{devices}.json")]}


MATRIX = [(f, m) for f in FAMILIES for m in ("lora", "adapter", "full")]


@pytest.fixture(scope="module")
def runs(checkpoints, xla_env, request, xla_forks):
    """One XLA worker per device count that the selected tests need, running the union of their jobs once (under
    -m slow the default tests' training runs are cells of the matrix: each runs once, in the worker's one runtime):
    generation first (a fresh runtime: the first prompt's 2 compilations), then the probe, then the training runs
    (each a fresh recipe run whose graphs no earlier job traced: its own compilation counts); the CPU runs happen
    here meanwhile."""
    ckpt, root = checkpoints, checkpoints / "runs"
    root.mkdir()
    default, matrix = _selected(request, "default_runs"), _selected(request, "matrix")
    cells = [(f, m) for f, m in MATRIX if matrix or m == DEFAULT_METHOD[f]]
    jobs = {}
    for devices in sorted(set(default) | set(matrix), reverse=True):
        device_jobs = []
        if devices in default:
            device_jobs += [{"name": f"gen_{family}_{key}", "script": "xla/generate/base.py",
                             "args": _gen_args(ckpt, family, prompt)}
                            for family in FAMILIES for key, prompt in GEN_PROMPTS.items()]
            device_jobs.append(_probe_job(ckpt, root, devices))
        device_jobs += [job for family, method in cells
                        for job in _train_jobs(ckpt, root, family, method, devices,
                                               resume=bool(matrix) or family == RESUME_FAMILY)]
        jobs[devices] = device_jobs
    workers = Workers(xla_env, root / "workers", jobs, xla_forks)
    cpu_gen = {(family, key): _cpu("generate/base.py", _gen_args(ckpt, family, prompt))
               for family in FAMILIES for key, prompt in GEN_PROMPTS.items()} if default else {}
    for family, method in cells:
        _cpu(f"finetune/{method}.py", _args(ckpt, family, method, "cpu", _dir(root, family, method, "cpu")))
    yield {"ckpt": ckpt, "root": root, "workers": workers, "cpu_gen": cpu_gen}
    workers.stop()


@pytest.fixture(scope="module")
def default_runs(runs):
    """Generation, the probe and one method per family (`DEFAULT_METHOD`), with gpt-oss's resume, on the device
    counts the selected tests need."""
    return runs


def _assert_same_training(root: Path, family: str, method: str, workers: Workers, devices: int) -> None:
    """The CPU run's logged losses (relative 1e-4) and final weights (5e-5); the train step compiled once per
    padded length (steps 1 and 3 start a length, 2 and 4 reuse it with other rows)."""
    cpu_dir, out_dir = _dir(root, family, method, "cpu"), _dir(root, family, method, f"xla{devices}")
    weights_file = METHODS[method][1]
    reference = _losses(cpu_dir)
    assert sorted(reference) == list(range(1, STEPS + 1)), reference
    r = workers.result(devices, f"{family}_{method}")
    assert f"Saved the {method} weights of step {STEPS}" in r["stdout"], r["stdout"][-2000:]
    got = _losses(out_dir)
    assert sorted(got) == sorted(reference), got
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-4), (step, got, reference)
    # step 1 also creates AdamW's state (a graph of its own, as for dense models: the SGD probe compiles once);
    # step 3 starts the second length; step 4 (other rows, other routing) compiles nothing
    assert _compiles(out_dir) == {1: 1, 2: 1, 3: 1, 4: 0}
    line = "XLA compilations: train step 3 for 2 padded length(s) [64, 80] (per length: {64: 2, 80: 1})"
    assert line in r["stdout"], r["stdout"][-2000:]
    ref_weights, weights = _weights(cpu_dir / "final" / weights_file), _weights(out_dir / "final" / weights_file)
    assert weights.keys() == ref_weights.keys() and weights
    if method == "full" or (method == "lora" and LORA_EXPERTS):  # the experts' own tensors trained too
        assert any(".experts." in name for name in weights), sorted(weights)[:8]
    for name in weights:
        diff = (weights[name].float() - ref_weights[name].float()).abs().max().item()
        assert diff <= WEIGHT_ATOL, (name, diff)


def _assert_exact_resume(full: Path, resumed: Path, weights_file: str) -> None:
    assert (resumed / "step-000001").is_dir() and (resumed / f"step-{STEPS:06d}").is_dir()
    ref, got = _weights(full / "final" / weights_file), _weights(resumed / "final" / weights_file)
    assert ref.keys() == got.keys() and ref
    for name in ref:
        assert torch.equal(ref[name], got[name]), (name, (ref[name].float() - got[name].float()).abs().max())
    full_losses = _losses(full)
    assert _losses(resumed) == {s: full_losses[s] for s in range(2, STEPS + 1)}


# ---------------------------------------------------------------------------------------------------------------
# default tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("devices", [1, 8])
def test_moe_train_step_compiles_once_without_host_transfers_or_cpu_fallbacks(default_runs, devices):
    default_runs["workers"].result(devices, "probe")
    probe = json.loads((default_runs["root"] / f"probe{devices}.json").read_text())
    assert probe["routing_differs"]  # other tokens, other routing, the same graph
    assert [s["compiles"] for s in probe["steps"]] == [1, 0, 0, 0], probe["steps"]
    assert [s["transfers_from_device"] for s in probe["steps"]] == [0, 0, 0, 0], probe["steps"]
    assert probe["fallbacks"] == [], probe["fallbacks"]


@pytest.mark.parametrize("devices", [8])
def test_expert_weights_are_sharded_over_8_devices(default_runs, devices):
    default_runs["workers"].result(8, "probe")
    shardings = json.loads((default_runs["root"] / "probe8.json").read_text())["shardings"]
    # gpt-oss: 2 MoE layers x fc_1, fc_2, proj, each (n_expert, out, in) split along its largest dimension
    assert len(shardings) == 6, shardings
    for name, spec in shardings.items():
        assert spec.startswith("{devices=[") and "0,1,2,3,4,5,6,7}" in spec, (name, spec)
        split = [int(n) for n in spec[len("{devices=["):spec.index("]")].split(",")]
        assert sorted(split) == [1, 1, 8], (name, spec)


@pytest.mark.parametrize("devices", [1, 8])
def test_activation_checkpointing_keeps_the_routing_gradient(default_runs, devices):
    """Under torch_xla's checkpoint_module the routing a layer keeps has no gradient (its first forward runs under
    no_grad); returned through the checkpoint (`checkpoint_block`, what the strategy wraps blocks with) it has. The
    checkpointed losses equal the unwrapped ones: tests/xla/test_scan.py."""
    default_runs["workers"].result(devices, "probe")
    probe = json.loads((default_runs["root"] / f"probe{devices}.json").read_text())
    assert probe["aux_requires_grad"] == {"none": True, "checkpoint_module": False, "checkpoint_block": True}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("devices", [1, 8])
def test_moe_family_trains_the_same_on_cpu_and_xla(default_runs, family, devices):
    _assert_same_training(default_runs["root"], family, DEFAULT_METHOD[family], default_runs["workers"], devices)


@pytest.mark.parametrize("devices", [1, 8])
def test_moe_full_finetuning_resumes_exactly_on_xla(default_runs, devices):
    root, method = default_runs["root"], DEFAULT_METHOD[RESUME_FAMILY]
    default_runs["workers"].result(devices, f"{RESUME_FAMILY}_{method}")
    default_runs["workers"].result(devices, f"{RESUME_FAMILY}_{method}_resumed")
    backend = f"xla{devices}"
    _assert_exact_resume(_dir(root, RESUME_FAMILY, method, backend),
                         _dir(root, RESUME_FAMILY, method, backend, resumed=True), METHODS[method][1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("devices", [1, 8])
def test_moe_generation_compiles_twice_per_bucket_and_matches_cpu(default_runs, family, devices):
    from lit_gpt import Config
    from lit_gpt.generate import bucket_length
    from lit_gpt.tokenizer import Tokenizer

    ckpt = default_runs["ckpt"]
    config = Config.from_checkpoint(ckpt / family)
    tokenizer = Tokenizer(ckpt / family)
    lengths = {key: tokenizer.encode(p).numel() for key, p in GEN_PROMPTS.items()}
    assert len(set(lengths.values())) == 2 and len({bucket_length(n, config.block_size) for n in lengths.values()}) == 1
    for key, prompt in GEN_PROMPTS.items():
        r = default_runs["workers"].result(devices, f"gen_{family}_{key}")
        compiles = 2 if key == "a" else 0  # the first prompt of the bucket: prefill + decode; then nothing new
        assert f"XLA compilations: {compiles} (" in r["stderr"], r["stderr"][-2000:]
        cpu_text = default_runs["cpu_gen"][(family, key)]
        assert r["stdout"] == cpu_text
        prompt_text = tokenizer.decode(tokenizer.encode(prompt))
        assert cpu_text.startswith(prompt_text)
        assert len(cpu_text.split()) - len(prompt_text.split()) == GEN_TOKENS, cpu_text


# ---------------------------------------------------------------------------------------------------------------
# what was refused before the routing returned through the scan and the checkpoint (in this process, no XLA runtime)
# ---------------------------------------------------------------------------------------------------------------
def test_check_moe_passes_scan_and_checkpointing_with_the_router_loss():
    from lit_gpt import Config
    from lit_gpt.args import MoEArgs
    from lit_gpt.recipes.xla_finetune import check_moe
    from words import family_config

    config = family_config("mixtral", 64)
    assert config.router_aux_loss_coef > 0
    for scan in (True, "auto", False):
        check_moe(config, scan, activation_checkpointing=True)
        check_moe(MoEArgs(router_aux_loss_coef=0.5).apply(config), scan, activation_checkpointing=True)
    check_moe(Config.from_name("Qwen3-0.6B", n_layer=1), True, activation_checkpointing=True)


def test_scan_layers_scans_moe_models_like_dense_ones():
    from lit_gpt import GPT
    from lit_gpt.xla.scan import AUTO_MIN_LAYERS, resolve_scan_layers
    from words import family_config

    config = family_config("mixtral", 64)
    config.n_layer = AUTO_MIN_LAYERS  # deep enough for "auto" to scan a dense model
    with torch.device("meta"):
        model = GPT(config)
    assert resolve_scan_layers("auto", model, spmd=False) is True
    assert resolve_scan_layers(True, model, spmd=False) is True
    config.n_layer = AUTO_MIN_LAYERS - 1
    with torch.device("meta"):
        assert resolve_scan_layers("auto", GPT(config), spmd=False) is False


# ---------------------------------------------------------------------------------------------------------------
# slow: every family x method, resume on XLA for each
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matrix(runs):
    """Every family x method on 1 and 8 devices, each resumed on XLA, and its CPU run (from the module's one worker
    per device count: `runs`)."""
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("family, method", MATRIX)
def test_every_moe_method_trains_the_same_and_resumes_exactly_on_xla(matrix, family, method):
    root, workers = matrix["root"], matrix["workers"]
    for devices in (1, 8):
        _assert_same_training(root, family, method, workers, devices)
        workers.result(devices, f"{family}_{method}_resumed")
        backend = f"xla{devices}"
        _assert_exact_resume(_dir(root, family, method, backend), _dir(root, family, method, backend, resumed=True),
                             METHODS[method][1])
