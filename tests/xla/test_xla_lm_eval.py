"""eval/lm_eval.py --accelerator xla on XLA:CPU, 1 and 8 devices (SPMD: each device scores its rows of a batch):
the CPU's scores on the three local harness tasks (tests/harness_tasks.py), and bounded compilations: one scoring
graph per length bucket (batches padded to --batch_size rows, lengths to powers of two) and two generation graphs
(a prefill per prompt bucket, one decode step per cache bucket), however many batches or joins fall in a bucket;
generation of mixed prompt lengths (several buckets) compiles only while warming up.

Both runs are started together by one fixture (each its own process: the XLA runtime reads PJRT_DEVICE and
CPU_NUM_DEVICES once)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fork_server import Captured, popen

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 900
REL = 1e-4
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
BATCH = 8


@pytest.fixture(scope="module")
def runs(tiny_dir, xla_env, tmp_path_factory, selected_devices, request, xla_forks):
    from harness_tasks import write_tasks

    root = tmp_path_factory.mktemp("xla_lm_eval")
    tasks = write_tasks(root / "tasks")
    procs = {}
    for devices in selected_devices(request):  # 1; also 8 under -m slow
        out = root / f"out{devices}"
        cmd = [sys.executable, str(REPO / "eval/lm_eval.py"), "--tasks", "lit_mc,lit_gen,lit_ppl", "--include_path",
               str(tasks), "--checkpoint_dir", str(tiny_dir), "--out_dir", str(out), "--batch_size", str(BATCH),
               "--bootstrap_iters", "0", "--accelerator", "xla"]
        # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
        with open(root / f"{devices}.log", "w") as log:
            procs[devices] = (popen(xla_forks, cmd[1:], REPO, xla_env(devices, **OFFLINE), stdout=log, stderr=log),
                              out, root / f"{devices}.log")
    yield {"procs": procs, "tasks": tasks}
    for proc, _, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cpu_results(tiny_dir, runs, monkeypatch_module):
    """The same evaluation on the CPU, in this process (equal to the harness's HF backend: tests/test_lm_eval.py)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from lit_gpt.recipes.evaluate import load_eval_model
    from lit_gpt.recipes.harness import LitLM

    loaded = load_eval_model(tiny_dir, accelerator="cpu")
    lm = LitLM(loaded.model, loaded.tokenizer, loaded.runtime, batch_size=BATCH, progress=False)
    manager = TaskManager(include_path=str(runs["tasks"]), include_defaults=False)
    return simple_evaluate(model=lm, tasks=["lit_mc", "lit_gen", "lit_ppl"], task_manager=manager, bootstrap_iters=0,
                           log_samples=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    import datasets.config

    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
        yield mp


@pytest.mark.parametrize("devices", [1, 8])
def test_xla_scores_equal_the_cpu_and_compilations_are_bounded_per_bucket(runs, cpu_results, devices):
    proc, out, log = runs["procs"][devices]
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the XLA run on {devices} devices timed out")
    assert rc == 0, log.read_text()[-4000:]
    results = json.loads((out / "lm_eval.json").read_text())
    config = results["config"]
    assert config["accelerator"] == "xla"
    for task in ("lit_mc", "lit_gen", "lit_ppl"):
        got, expected = results["results"][task], cpu_results["results"][task]
        for metric, value in expected.items():
            if metric.startswith(("acc", "exact_match")) and "stderr" not in metric:
                assert got[metric] == value, (task, metric)
            elif metric.endswith("perplexity,none") or metric.startswith("bits_per_byte,"):
                assert got[metric] == pytest.approx(value, rel=REL), (task, metric)
    # lit_mc's 31 requests are 4 batches of 8 rows in the 16-token bucket; the long lit_ppl text fills 256-token
    # windows; the 6 generation prompts all join the continuous batch in the 16-token prompt bucket (one prefill
    # graph for the 6 joins) and its rows decode in one graph over a 32-position cache (16 + max_gen_toks 16)
    per_bucket = config["xla_compilations_per_bucket"]
    assert per_bucket == {"prefill 16": 1, "decode 32": 1, "score 16": 1, "score 256": 1}, per_bucket
    assert config["xla_compilations"] == sum(per_bucket.values())
    assert f"XLA compilations: {config['xla_compilations']}" in log.read_text()


MIXED_SCRIPT = """
import json, sys
from lm_eval.api.instance import Instance
from lit_gpt.recipes.evaluate import load_eval_model
from lit_gpt.recipes.harness import LitLM

requests = json.loads(sys.argv[2])
loaded = load_eval_model(sys.argv[1], accelerator=sys.argv[3])
lm = LitLM(loaded.model, loaded.tokenizer, loaded.runtime, batch_size=4, progress=False)
make = lambda order: [Instance("generate_until", {}, tuple(requests[i]), i) for i in order]
c0 = loaded.runtime.compile_count()
first = lm.generate_until(make(range(len(requests))), disable_tqdm=True)
c1 = loaded.runtime.compile_count()
second = lm.generate_until(make(reversed(range(len(requests)))), disable_tqdm=True)[::-1]
print(json.dumps({"first": first, "second": second, "warm_up": c1 - c0, "after": loaded.runtime.compile_count() - c1,
                  "per_bucket": {f"{k[0]} {k[1]}": v for k, v in lm.compiles_per_bucket.items()}}))
"""


@pytest.mark.slow
def test_xla_generation_of_mixed_lengths_compiles_only_in_the_warm_up(tiny_dir, xla_env, tmp_path, forks, xla_forks):
    """generate_until on XLA:CPU: prompts of 1 to 52 tokens (three prompt buckets), two settings of stop strings and
    max_gen_toks, 4 rows for 6 requests: one prefill graph per prompt bucket and one decode graph while warming up,
    none in a second call (other order, the same buckets); the texts are the CPU's (which are the harness's HF
    backend's: tests/test_lm_eval.py)."""
    long = " ".join(f"word{i}" for i in range(12))
    settings = [{"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False},
                {"until": [","], "max_gen_toks": 5, "do_sample": False}]
    prompts = ["a", "one two three", long, long + " " + long, "Bees make honey and", long[:30]]
    requests = json.dumps([[p, settings[i % 2]] for i, p in enumerate(prompts)])
    script = tmp_path / "mixed.py"
    script.write_text(MIXED_SCRIPT)

    def launch(accelerator, env, server):  # forked from a fork server (tests/conftest.py): the imports done
        return Captured(server, [str(script), str(tiny_dir), requests, accelerator], REPO, env,
                        tmp_path / f"{accelerator}.out", tmp_path / f"{accelerator}.err")

    procs = [launch("xla", xla_env(1), xla_forks),
             launch("cpu", {k: v for k, v in xla_env(1).items() if k != "PJRT_DEVICE"}, forks)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    xla, cpu = outs
    assert xla["first"] == xla["second"] == cpu["first"] and sum(bool(t) for t in xla["first"]) >= 4
    assert xla["per_bucket"] == {"prefill 16": 1, "prefill 32": 1, "prefill 64": 1, "decode 64": 1}, xla["per_bucket"]
    assert xla["warm_up"] == 4 and xla["after"] == 0, xla
