"""The hosts of a multi-host XLA run agree on config, data and checkpoint (lit_gpt/xla/hosts.py), or every host says
in one line what differs and where.

Multi-process XLA collectives hang on XLA:CPU, so the comparison is tested as the pure function it is, with the
hosts' facts injected (`disagreement`), and through `check_hosts_agree` with the gather replaced by the other
hosts' answers; a contract test checks that every XLA finetune recipe calls it before the weights load. The real
gather (torch.distributed's gloo group, what a slice's hosts share) runs in two processes under slow.
"""

import ast
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.lora import Config
from lit_gpt.recipes.finetune import FinetuneRun
from lit_gpt.utils import LitError, cli
from lit_gpt.xla.hosts import check_hosts_agree, disagreement, host_facts

REPO = Path(__file__).resolve().parents[1]
TAIL = ("Start the same command on every host (gcloud compute tpus tpu-vm ssh NAME --worker=all --command ...) from"
        " the same checkout, with the same data and base weights on each (copied from one bucket)")


def facts(host: str, lr: float = 3e-4, data: str = "d0", base: str = "b0", resume: str = "--resume auto",
          **config) -> dict:
    return {"host": host, "config": {"train.learning_rate": lr, "model.lora_r": 8, **config},
            "data": {"prepared data": data}, "checkpoint": {"base weights": base, "resume": resume}}


def test_hosts_that_agree_give_no_line():
    assert disagreement([facts("w-0")]) is None  # one host: nothing to compare
    assert disagreement([facts(f"w-{i}") for i in range(4)]) is None  # the host names themselves may differ


def test_a_host_with_other_arguments_is_named_with_the_entry_and_both_values():
    line = disagreement([facts("w-0"), facts("w-1"), facts("w-2", lr=1e-3), facts("w-3")])
    assert line == ("the 4 hosts disagree on the config: train.learning_rate is 0.0003 on hosts 0-1, 3 but 0.001 on"
                    f" host 2 (w-2). {TAIL}")
    assert "\n" not in line


def test_data_and_checkpoint_disagreements_are_named_in_one_line():
    line = disagreement([facts("w-0"), facts("w-1", base="b1"), facts("w-2"),
                         facts("w-3", data="d9", resume="step-000010 (saved 2026-11-28 10:00:00 UTC)")])
    assert line.startswith("the 4 hosts disagree on the data and the checkpoint: ")
    assert '"prepared data" is' not in line  # entries are named bare, values quoted
    assert 'prepared data is "d0" on hosts 0-2 but "d9" on host 3 (w-3)' in line
    assert 'base weights is "b0" on hosts 0, 2-3 but "b1" on host 1 (w-1)' in line
    assert ('resume is "--resume auto" on hosts 0-2 but "step-000010 (saved 2026-11-28 10:00:00 UTC)" on host 3'
            ' (w-3)') in line


def test_many_differing_entries_are_cut_and_unnamed_hosts_go_by_rank():
    many = {f"train.k{i}": i for i in range(5)}
    line = disagreement([facts("", **many), facts("", **{k: v + 1 for k, v in many.items()}), facts("", **many)])
    assert line.startswith("the 3 hosts disagree on the config: train.k0 is 0 on hosts 0, 2 but 1 on host 1; ")
    assert "train.k2 is" in line and "train.k3 is" not in line and "and 2 more config entries" in line
    assert "(" not in line.split(". Start")[0]  # no host names to give
    # an entry one host lacks (an older checkout without the flag) differs too
    line = disagreement([facts("a", **{"train.new_flag": True}), facts("b")])
    assert "train.new_flag is true on host 0 but (not set) on host 1 (b)" in line


def run_of(tmp_path: Path, **changes) -> FinetuneRun:
    """A real FinetuneRun as the XLA recipes build it (the model config with the method's settings)."""
    settings = dict(checkpoint_dir=tmp_path / "ckpt", lora_r=8, lr=3e-4, data_dir=tmp_path / "data", resume="auto",
                    fingerprint="f" * 16)
    settings.update(changes)
    config = Config(name="tiny", block_size=32, n_layer=1, n_head=2, n_embd=8, vocab_size=64,
                    lora_r=settings["lora_r"])
    return FinetuneRun("lora", settings["checkpoint_dir"], tmp_path / "out", config,
                       DataArgs(data_dir=settings["data_dir"]), TrainArgs(learning_rate=settings["lr"]), EvalArgs(),
                       settings["resume"], platform="xla",
                       base={"fingerprint": settings["fingerprint"], "checkpoint_dir": str(settings["checkpoint_dir"])})


def data_of(fingerprint: str = "p0") -> SimpleNamespace:
    return SimpleNamespace(prepared=SimpleNamespace(meta={"fingerprint": fingerprint, "source": "alpaca.json",
                                                          "counts": {"samples": 24}}))


def test_real_runs_compare_resolved_arguments_and_files_by_content(tmp_path):
    a = host_facts(run_of(tmp_path), data_of())
    assert a["host"] == socket.gethostname()
    assert a["config"]["train.learning_rate"] == 3e-4 and a["config"]["model.lora_r"] == 8
    assert a["checkpoint"] == {"base weights": "f" * 16, "resume": "--resume auto"}
    assert a["data"] == {"prepared data": "p0 (24 samples from 'alpaca.json')"}
    # the same base and data under other paths (another worker's home folder) are the same run
    moved = host_facts(run_of(tmp_path / "elsewhere", checkpoint_dir=tmp_path / "w1" / "ckpt",
                              data_dir=tmp_path / "w1" / "data"), data_of())
    moved["config"]["out_dir"] = a["config"]["out_dir"]  # only because the test's two "hosts" have other tmp dirs
    assert disagreement([a, moved]) is None
    # the method's setting from the model config, the data's and the base's fingerprints
    other = host_facts(run_of(tmp_path, lora_r=16, fingerprint="0" * 16), data_of("p1"))
    line = disagreement([a, other])
    assert line.startswith("the 2 hosts disagree on the config, the data and the checkpoint: model.lora_r is 8 on"
                           " host 0 but 16 on host 1")
    assert 'prepared data is "p0 (24 samples from \'alpaca.json\')" on host 0 but "p1 (24 samples' in line
    assert f'base weights is "{"f" * 16}" on host 0 but "{"0" * 16}" on host 1' in line


def test_an_explicit_step_folder_is_identified_by_its_save_time(tmp_path):
    step = tmp_path / "out" / "step-000010"
    step.mkdir(parents=True)
    (step / "lit_checkpoint.json").write_text(json.dumps({"saved_at": 1795000000.0}))
    here = host_facts(run_of(tmp_path, resume=step), data_of())["checkpoint"]["resume"]
    assert here == "step-000010 (saved 2026-11-18 11:06:40 UTC)"
    missing = host_facts(run_of(tmp_path, resume=tmp_path / "gone" / "step-000010"), data_of())
    assert missing["checkpoint"]["resume"] == "step-000010 (no readable lit_checkpoint.json on this host)"
    assert host_facts(run_of(tmp_path, resume=False), data_of())["checkpoint"]["resume"] == \
        "a fresh start (--resume false)"


def test_every_host_prints_the_same_one_error_line(tmp_path, monkeypatch, capsys):
    """check_hosts_agree with the other host's answer injected where the gather is: one `error:` line, exit 1, on
    this host (each host computes the same line from the same gathered facts)."""
    run = run_of(tmp_path)
    mine = host_facts(run, data_of())
    theirs = json.loads(json.dumps(mine))
    theirs["host"], theirs["config"]["train.learning_rate"] = "t1v-n-w-1", 1e-3
    monkeypatch.setattr("lit_gpt.xla.integrity._all_gather", lambda obj: [obj, theirs])
    with pytest.raises(SystemExit) as e:
        cli(lambda: check_hosts_agree(run, data_of()))()
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert err.startswith("error: the 2 hosts disagree on the config: train.learning_rate is 0.0003 on host 0 but"
                          " 0.001 on host 1 (t1v-n-w-1). Start the same command on every host")
    monkeypatch.setattr("lit_gpt.xla.integrity._all_gather", lambda obj: [obj, json.loads(json.dumps(obj))])
    check_hosts_agree(run, data_of())  # agreeing hosts: nothing raised


@pytest.mark.parametrize("recipe", sorted((REPO / "xla" / "finetune").glob("*.py")), ids=lambda p: p.name)
def test_every_xla_finetune_recipe_checks_its_hosts_before_loading_weights(recipe):
    """Contract: each XLA recipe's main calls check_hosts_agree(run, data) right after reading the data and before
    anything that the hosts must do together (loading and sharding the weights, fabric.setup, the loop)."""
    main = next(n for n in ast.parse(recipe.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = [(n.lineno, ast.unparse(n.func)) for n in ast.walk(main) if isinstance(n, ast.Call)]
    line_of = {name: min(ln for ln, n in calls if n == name) for _, name in calls}
    assert "check_hosts_agree" in line_of, f"{recipe.name}: main does not call check_hosts_agree(run, data)"
    check = next(n for n in ast.walk(main) if isinstance(n, ast.Call) and ast.unparse(n.func) == "check_hosts_agree")
    assert [ast.unparse(a) for a in check.args] == ["run", "data"]
    assert line_of["load_run_data"] < line_of["check_hosts_agree"]
    for later in ("load_model", "fabric.setup", "fit"):
        assert line_of["check_hosts_agree"] < line_of[later], (recipe.name, later)


GLOO_HOST = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from types import SimpleNamespace
    from lit_gpt.utils import cli
    from lit_gpt.xla import hosts

    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # this host's facts as host_facts builds them, with host 1's learning rate and data changed
    facts = {"host": f"worker-{rank}", "config": {"train.learning_rate": 3e-4 if rank == 0 else 1e-3},
             "data": {"prepared data": "p0" if rank == 0 else "p1"}, "checkpoint": {"resume": "--resume auto"}}
    hosts.host_facts = lambda run, data: facts
    cli(lambda: hosts.check_hosts_agree(None, None))()
""")


@pytest.mark.slow  # two processes with torch and a gloo group: ~5 s
def test_two_hosts_over_gloo_both_print_the_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_HOST, str(r), str(port)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 1 and "terminate called" not in err, err  # both leave the group cleanly
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert lines == [
            "error: the 2 hosts disagree on the config and the data: train.learning_rate is 0.0003 on host 0 but"
            ' 0.001 on host 1 (worker-1); prepared data is "p0" on host 0 but "p1" on host 1 (worker-1). ' + TAIL
        ], err
