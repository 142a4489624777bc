"""eval/lm_eval.py --accelerator xla on XLA:CPU, 1 and 8 devices (SPMD: each device scores its rows of a batch):
the CPU's scores on the three local harness tasks (tests/harness_tasks.py), and bounded compilations: one scoring
graph per length bucket (batches padded to --batch_size rows, lengths to powers of two) and two generation graphs
(prefill, decode) per prompt bucket, however many batches fall in a bucket.

Both runs are started together by one fixture (each its own process: the XLA runtime reads PJRT_DEVICE and
CPU_NUM_DEVICES once)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 900
REL = 1e-4
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
BATCH = 8


@pytest.fixture(scope="module")
def runs(tiny_dir, xla_env, tmp_path_factory, selected_devices, request):
    from harness_tasks import write_tasks

    root = tmp_path_factory.mktemp("xla_lm_eval")
    tasks = write_tasks(root / "tasks")
    procs = {}
    for devices in selected_devices(request):  # 1; also 8 under -m slow
        out = root / f"out{devices}"
        cmd = [sys.executable, str(REPO / "eval/lm_eval.py"), "--tasks", "lit_mc,lit_gen,lit_ppl", "--include_path",
               str(tasks), "--checkpoint_dir", str(tiny_dir), "--out_dir", str(out), "--batch_size", str(BATCH),
               "--bootstrap_iters", "0", "--accelerator", "xla"]
        log = open(root / f"{devices}.log", "w")
        procs[devices] = (subprocess.Popen(cmd, env=xla_env(devices, **OFFLINE), cwd=REPO, stdout=log, stderr=log),
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
    # windows; the generation prompts are all in the 16-token prompt bucket
    per_bucket = config["xla_compilations_per_bucket"]
    assert per_bucket == {"generate 16": 2, "score 16": 1, "score 256": 1}, per_bucket
    assert config["xla_compilations"] == sum(per_bucket.values())
    assert f"XLA compilations: {config['xla_compilations']}" in log.read_text()
