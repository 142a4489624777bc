"""eval/lm_eval.py --devices 2 on the CPU: two processes over gloo, each evaluating its share of every task's examples,
the results gathered on rank 0 and written once: equal to the one-process run (accuracies and exact match identical,
perplexities within 1e-6 relative, every logged sample's response alike), with the per-sample files and the
seconds per task."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness_tasks import TASKS, write_tasks

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_two_cpu_processes_equal_one(tiny_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    procs = {}
    for devices in (1, 2):  # started together, read in turn
        cmd = [sys.executable, str(REPO / "eval/lm_eval.py"), "--tasks", ",".join(TASKS), "--include_path", str(tasks),
               "--checkpoint_dir", str(tiny_dir), "--out_dir", str(tmp_path / f"out{devices}"), "--batch_size", "3",
               "--bootstrap_iters", "0", "--accelerator", "cpu", "--devices", str(devices), "--log_samples", "true"]
        procs[devices] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"})
    results, samples = {}, {}
    for devices, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert out.count("|lit_mc ") == 1  # the table printed once (rank 0)
        folder = tmp_path / f"out{devices}"
        results[devices] = json.loads((folder / "lm_eval.json").read_text())
        samples[devices] = {task: sorted((json.loads(line) for f in folder.glob(f"samples_{task}_*.jsonl")
                                          for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
                            for task in TASKS}
    one, two = results[1], results[2]
    assert two["config"]["devices"] == 2 and one["config"]["devices"] == 1
    assert two["n-samples"] == one["n-samples"]
    for task in TASKS:
        for metric, value in one["results"][task].items():
            if isinstance(value, float):
                assert two["results"][task][metric] == pytest.approx(value, rel=1e-6), (task, metric)
        assert len(samples[2][task]) == len(samples[1][task]) == one["n-samples"][task]["effective"]
        for a, b in zip(samples[1][task], samples[2][task]):
            assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
            if task == "lit_gen":
                assert a["resps"] == b["resps"]
        assert two["task_seconds"][task] > 0
