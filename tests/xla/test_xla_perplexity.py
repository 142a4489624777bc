"""eval/perplexity.py on XLA:CPU (1 and 8 virtual devices, SPMD): the same perplexity as the CPU within 1e-4 (base
model and base + LoRA file), and one compiled forward graph for all windows: the short windows and the last, partial
batch are padded to the one shape (window, batch rounded up to the devices); a second pass compiles nothing.

Every XLA run is its own process (the runtime reads PJRT_DEVICE / CPU_NUM_DEVICES once); both start together. Slow on
1 device too (SLOW_DEVICES; the suite's budget, tests/README.md): the default suite's XLA evaluation run is
tests/xla/test_xla_lm_eval.py's (the same loading of the model for evaluation: lit_gpt.recipes.evaluate)."""

import json
import shutil
import subprocess
from pathlib import Path
from typing import Dict

import pytest
import torch
from fork_server import Started, popen

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 900
SLOW_DEVICES = (1, 8)  # tests/xla/conftest.py
WINDOW, STRIDE, BATCH = 40, 15, 4
REL = 1e-4

# eval/perplexity.py's steps (lit_gpt.recipes.evaluate) with --accelerator xla, plus what one CLI call cannot show:
# a second pass over the same windows (no new graph) and a second model (base + LoRA) in the same process
DRIVER = r"""
import json, sys
from pathlib import Path
from lit_gpt.perplexity import score
from lit_gpt.recipes.evaluate import load_eval_model, perplexity_request, run_perplexity

checkpoint_dir, lora_path, data, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
flags = dict(accelerator="xla", window=%d, stride=%d, batch_size=%d)
results = {}
request = perplexity_request(data, checkpoint_dir, out_dir=out / "base", **flags)
loaded = load_eval_model(checkpoint_dir, accelerator="xla")
results["first"] = run_perplexity(loaded, request).to_dict()  # progress bar, table, JSON: the recipe's path
results["second"] = score(loaded.model, request.tokens, request.windows, loaded.runtime, request.batch_size).to_dict()
request = perplexity_request(data, checkpoint_dir, lora_path=lora_path, out_dir=out / "lora", **flags)
loaded = load_eval_model(checkpoint_dir, lora_path=lora_path, accelerator="xla")
results["lora"] = run_perplexity(loaded, request).to_dict()
results["devices"] = loaded.runtime.data_parallel_size
(out / "results.json").write_text(json.dumps(results))
""" % (WINDOW, STRIDE, BATCH)


def _words(n: int, seed: int) -> str:
    import random

    from words import WORDS

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def setup(tiny_dir, xla_env, tmp_path_factory, selected_devices, request, xla_forks):
    """A tiny model with O(1) logits and the SmolLM2 tokenizer, a LoRA file of it, a JSONL of three documents;
    the XLA processes started at once."""
    from tiny import tiny_llama_config, write_checkpoint
    from variants import randomize_, randomize_own_

    from lit_gpt import GPT, lora
    from lit_gpt.fingerprint import base_record
    from lit_gpt.peft import save_finetuned
    from lit_gpt.weights import load_weights

    root = tmp_path_factory.mktemp("xla_perplexity")
    torch.manual_seed(0)
    model = GPT(tiny_llama_config(block_size=64, vocab_size=49152))
    randomize_(model, seed=5)
    lit = write_checkpoint(model, root / "lit")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_dir / name, lit / name)
    variant = lora.GPT(lora.Config.from_checkpoint(lit, lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_mlp=True))
    variant.load_state_dict(load_weights(lit / "lit_model.safetensors"), strict=False)
    randomize_own_(variant)
    lora_path = save_finetuned(variant, root / "lora", base=base_record(lit))
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": _words(n, seed)}) + "\n" for seed, n in enumerate((60, 7, 100))))

    procs: Dict[int, Started] = {}
    for devices in selected_devices(request):  # 1; also 8 under -m slow
        out = root / f"out{devices}"
        out.mkdir()
        # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
        with open(out / "log.txt", "w") as log:
            procs[devices] = popen(xla_forks, ["-c", DRIVER, str(lit), str(lora_path), str(data), str(out)], REPO,
                                   xla_env(devices), stdout=log, stderr=subprocess.STDOUT)
    yield {"lit": lit, "lora": lora_path, "data": data, "root": root, "procs": procs}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _results(setup, devices: int) -> dict:
    proc, out = setup["procs"][devices], setup["root"] / f"out{devices}"
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the XLA run on {devices} device(s) timed out")
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, log[-4000:]
    return json.loads((out / "results.json").read_text()), log


def _cpu(setup, **model_flags):
    from lit_gpt.perplexity import score
    from lit_gpt.recipes.evaluate import load_eval_model, perplexity_request

    request = perplexity_request(setup["data"], setup["lit"], window=WINDOW, stride=STRIDE, batch_size=BATCH,
                                 accelerator="cpu", out_dir=setup["root"] / "cpu", **model_flags)
    loaded = load_eval_model(setup["lit"], accelerator="cpu", **model_flags)
    return score(loaded.model, request.tokens, request.windows, loaded.runtime, BATCH), request


@pytest.mark.parametrize("devices", [1, 8])
def test_same_perplexity_as_the_cpu_with_one_compiled_forward(setup, devices):
    got, log = _results(setup, devices)
    assert got["devices"] == devices
    cpu, request = _cpu(setup)
    # the windows need padding: some are shorter than the window, and the last batch is partial (8 devices: the
    # batch of 4 is 8 rows)
    assert any(w.end - w.begin < WINDOW for w in request.windows) and len(request.windows) % BATCH
    first, second = got["first"], got["second"]
    assert first["tokens_scored"] == second["tokens_scored"] == cpu.tokens_scored
    assert first["windows"] == cpu.windows and first["documents"] == 3
    assert first["perplexity"] == pytest.approx(cpu.perplexity, rel=REL)
    assert second["perplexity"] == pytest.approx(first["perplexity"], rel=1e-6)
    assert first["compiles"] == 1, log[-3000:]  # one forward graph for every window and batch
    assert second["compiles"] == 0
    # the recipe's output: the table, the JSON beside... here in --out_dir, with the compile count on stderr
    written = json.loads((setup["root"] / f"out{devices}" / "base" / "perplexity.json").read_text())
    assert written["perplexity"] == first["perplexity"] and written["device"].startswith("xla")
    assert "Wrote " in log and "(XLA compilations: 1)" in log


@pytest.mark.parametrize("devices", [1, 8])
def test_lora_file_same_as_the_cpu(setup, devices):
    got, _ = _results(setup, devices)
    cpu, _ = _cpu(setup, lora_path=setup["lora"])
    base, _ = _cpu(setup)
    assert got["lora"]["perplexity"] == pytest.approx(cpu.perplexity, rel=REL)
    assert abs(cpu.perplexity / base.perplexity - 1) > 100 * REL  # the LoRA weights change it: the test can fail
    assert got["lora"]["compiles"] <= 1  # the merged model has the base's shapes
