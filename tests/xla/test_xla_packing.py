"""Packing on XLA:CPU (`--data.packing true`):

* a packed micro-batch gives the loss and gradients of the same samples unpacked, on 1 and on 8 devices (the rows
  split over the SPMD mesh), for full, LoRA and adapter models, fp32, within 1e-5 relative (tests/xla/
  packing_worker.py; the CPU's packed values beside them);
* `xla/finetune/lora.py --data.packing true` on 8 devices, epoch-driven: the CPU recipe's logged losses and
  validation (1e-4), and one train-step shape for the whole run: every micro-batch has max_seq_length positions, so
  the train step's graphs are those of one padded length (the accumulating micro-batch, the first optimizer step
  that creates AdamW's state, the steady step), all compiled in the first two steps, and validation one graph.

The TPU's flash-attention path with segment ids (lit_gpt/xla/flash.py) is not run. The worker's model has no
`segment_attention` (the dense mask on XLA); the recipe's strategy installs the blockwise path (one block at 128
positions), whose one-graph step at several blocks is tests/test_packed_attention.py's XLA test.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest
from fork_server import popen, run_captured

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 900
REL = 1e-5
RECIPE = ["--train.global_batch_size", "8", "--train.micro_batch_size", "1", "--train.epochs", "2",
          "--train.max_seq_length", "128", "--train.log_interval", "1", "--train.lr_warmup_steps", "2",
          "--train.save_interval", "100", "--data.packing", "true", "--eval.interval", "3", "--eval.max_iters", "100",
          "--eval.max_new_tokens", "0", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0",
          "--train.learning_rate", "0.02", "--accelerator", "cpu"]


@pytest.fixture(scope="module")
def workers(xla_env, tmp_path_factory, selected_devices, request, xla_forks):
    from child_env import python_path

    root = tmp_path_factory.mktemp("xla_packing")
    procs = {}
    for devices in selected_devices(request):  # 1; also 8 under -m slow
        env = xla_env(devices, PYTHONPATH=f"{python_path()}:{REPO / 'tests'}")
        # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
        with open(root / f"{devices}.log", "w") as log:
            procs[devices] = popen(xla_forks, [str(REPO / "tests/xla/packing_worker.py"), str(root / f"{devices}.json")],
                                   REPO, env, stdout=log, stderr=subprocess.STDOUT)
    yield root, procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("devices", [1, 8])
def test_packed_equals_unpacked_on_xla(workers, devices):
    root, procs = workers
    assert procs[devices].wait(TIMEOUT) == 0, (root / f"{devices}.log").read_text()[-3000:]
    result = json.loads((root / f"{devices}.json").read_text())
    assert result["devices"] == devices and result["rows"] < 12
    for method in ("full", "lora", "adapter"):
        entry = result[method]
        assert entry["grads"] > 0
        for key in ("cpu_packed_loss_rel", "cpu_packed_grad_rel", "xla_packed_loss_rel", "xla_packed_grad_rel",
                    "xla_unpacked_loss_rel"):
            assert entry[key] <= REL, (method, key, entry)


@pytest.fixture(scope="module")
def recipe_runs(xla_env, tmp_path_factory, forks, xla_forks):
    """xla/finetune/lora.py --data.packing true on 8 devices (a subprocess) and finetune/lora.py on the CPU (here)."""
    from jsonargparse import CLI
    from words import GEN_PROMPT, WORDS, make_word_checkpoint

    from test_finetune import load_recipe, read_metrics

    tmp = tmp_path_factory.mktemp("xla_packing_recipe")
    tiny_dir = make_word_checkpoint(tmp / "tiny-words")
    # 96 rows of 1 to 4 words each way: two or three to a row of 128 positions (the model's context)
    rows = [{"instruction": GEN_PROMPT, "input": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 4)),
             "output": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 4))} for i in range(96)]
    (tmp / "alpaca.json").write_text(json.dumps(rows))
    data_dir = tmp / "data"
    # forked from the fork servers (tests/conftest.py `forks`, `xla_forks`): processes without the imports' seconds
    prep = run_captured(forks, [str(REPO / "scripts/prepare_alpaca.py"), "--checkpoint_dir", str(tiny_dir),
                                "--data_file", str(tmp / "alpaca.json"), "--destination_path", str(data_dir),
                                "--val_split_fraction", str(8 / 96)], REPO, xla_env(1))
    assert prep.returncode == 0, prep.stderr
    common = ["--checkpoint_dir", str(tiny_dir), "--data.data_dir", str(data_dir), *RECIPE]
    with open(tmp / "xla8.log", "w") as log:
        proc = popen(xla_forks, [str(REPO / "xla/finetune/lora.py"), *common, "--out_dir", str(tmp / "xla8")], REPO,
                     xla_env(8), stdout=log, stderr=subprocess.STDOUT)
    CLI(load_recipe("lora").setup, args=[*common, "--out_dir", str(tmp / "cpu"), "--precision", "32-true"])
    proc.wait(timeout=TIMEOUT)
    out = (tmp / "xla8.log").read_text()
    assert proc.returncode == 0, out[-4000:]
    return out, {name: (read_metrics(tmp / name), read_metrics(tmp / name, "val_loss")) for name in ("cpu", "xla8")}


@pytest.mark.slow  # an 8-device recipe run (the default suite packs on 1 device above, and on the CPU)
def test_packed_recipe_on_8_devices_equals_the_cpu_and_compiles_one_shape(recipe_runs):
    out, metrics = recipe_runs
    (cpu_loss, cpu_val), (xla_loss, xla_val) = metrics["cpu"], metrics["xla8"]
    assert sorted(xla_loss) == sorted(cpu_loss) and len(cpu_loss) >= 6
    for step, value in cpu_loss.items():
        assert xla_loss[step] == pytest.approx(value, rel=1e-4), step
    assert xla_val.keys() == cpu_val.keys() and xla_val
    for step, value in cpu_val.items():
        assert xla_val[step] == pytest.approx(value, rel=1e-4), step
    m = re.search(r"XLA compilations: train step (\d+) for (\d+) padded length\(s\) \[128\].*; validation, sample"
                  r" generation and checkpoints (\d+)", out)
    assert m, out[-3000:]
    train_graphs, lengths, other = map(int, m.groups())
    assert lengths == 1
    assert train_graphs <= 3  # one shape: accumulate, first optimizer step, steady step
    assert other <= 1  # validation
    steady = re.search(r"over (\d+) steady step\(s\); (\d+) first or compiling step", out)
    assert steady and int(steady.group(2)) <= 2, out[-3000:]  # nothing compiles after the first two steps
    assert "rows of 128 positions" in out
