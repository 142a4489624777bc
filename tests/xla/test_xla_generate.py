"""XLA generation on XLA:CPU (1 and 8 virtual devices): greedy output equal to the CPU recipe token for token, the
real SmolLM2 answering "Paris", and the compile count (2 per prompt bucket, whatever max_new_tokens is; 0 for a
second prompt in the same bucket).

Every XLA run is its own process (the runtime reads PJRT_DEVICE / CPU_NUM_DEVICES once); they are all started
together by one fixture, since most of their time goes to imports and compilation."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from fork_server import Captured

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
TIMEOUT = 900

# Runs the library the recipe uses (same Fabric, loader and generate), for what a single CLI call cannot show:
# several prompts, lengths and max_new_tokens in one process, with the compilations of each call.
DRIVER = r"""
import json, sys
from pathlib import Path
import torch
from lit_gpt.generate import timed_generate, unwrap
from lit_gpt.recipes.xla_generate import load_base_staged
from lit_gpt.xla import make_fabric
from lit_gpt.xla.runtime import XLARuntime

checkpoint_dir, requests, out = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
fabric = make_fabric("auto", "32-true")

def main(fabric):
    model = load_base_staged(fabric, checkpoint_dir)  # as xla/generate/base.py loads it
    model = fabric.setup_module(model)
    runtime = XLARuntime(fabric)
    results = []
    for r in requests:
        prompt = torch.tensor(r["prompt"])
        g = timed_generate(model, prompt, r["max_new_tokens"], runtime, stop_ids=r["stop_ids"])
        bucket = runtime.prompt_bucket(prompt.numel(), unwrap(model).config.block_size)
        results.append({"tokens": g.tokens.tolist(), "compiles": g.compiles, "bucket": bucket})
    out.write_text(json.dumps({"devices": fabric.strategy.num_devices, "results": results}))

fabric.launch(main)
"""


def _cpu_reference(checkpoint_dir: Path, prompt: List[int], max_new_tokens: int, stop_ids: List[int]) -> List[int]:
    """What generate/base.py computes on the CPU (its `generate` call, greedy)."""
    from lit_gpt.generate import generate
    from lit_gpt.loading import load_model

    model = load_model(checkpoint_dir)
    return generate(model, torch.tensor(prompt), max_new_tokens, temperature=0.0, stop_ids=stop_ids).tolist()


def _cli(script: str, checkpoint_dir: Path, max_new_tokens: int, *extra: str) -> List[str]:
    return [sys.executable, str(REPO / script), "--checkpoint_dir", str(checkpoint_dir), "--prompt", PROMPT,
            "--prompt_style", "raw", "--temperature", "0", "--max_new_tokens", str(max_new_tokens), *extra]


@pytest.fixture(scope="module")
def runs(tiny_dir, smollm2_dir, xla_env, tmp_path_factory, selected_devices, request, forks, xla_forks):
    """Start every process the selected tests need at once (1 device; also 8 under -m slow); yield {name: Popen}."""
    from lit_gpt.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("xla_generate")
    tok = Tokenizer(tiny_dir)
    prompt = tok.encode(PROMPT).tolist()  # 5 tokens
    longer = tok.encode("The capital city of France, in Europe, is").tolist()  # 10 tokens: the same bucket (16)
    assert len(prompt) < len(longer) <= 16
    requests = [
        {"prompt": prompt, "max_new_tokens": 8, "stop_ids": tok.stop_ids},
        {"prompt": longer, "max_new_tokens": 8, "stop_ids": tok.stop_ids},
        {"prompt": prompt, "max_new_tokens": 64, "stop_ids": tok.stop_ids},
    ]
    procs: Dict[str, Captured] = {}
    logs = {}

    def start(name: str, cmd: List[str], env: dict, server=xla_forks) -> None:
        # each a process of its own, forked from a server with the imports done (tests/conftest.py `xla_forks`,
        # and `forks` for the CPU run)
        logs[name] = out / f"{name}.log"
        procs[name] = Captured(server, cmd[1:], REPO, env, out / f"{name}.out", logs[name])

    for devices in selected_devices(request):
        start(f"tiny{devices}", [sys.executable, "-c", DRIVER, str(tiny_dir), json.dumps(requests),
                                 str(out / f"tiny{devices}.json")], xla_env(devices))
        start(f"real{devices}", _cli("xla/generate/base.py", smollm2_dir, 8), xla_env(devices))
    start("real_cpu", _cli("generate/base.py", smollm2_dir, 8, "--accelerator", "cpu"), xla_env(1), forks)
    yield {"procs": procs, "logs": logs, "out": out, "requests": requests}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _finish(runs, name: str) -> str:
    proc = runs["procs"][name]
    try:
        stdout, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{name} timed out")
    log = runs["logs"][name].read_text()
    assert proc.returncode == 0, f"{name} failed:\n{log[-4000:]}"
    return stdout, log


@pytest.mark.parametrize("devices", [1, 8])
def test_tiny_compiles_twice_per_bucket_and_matches_cpu(runs, tiny_dir, devices):
    _finish(runs, f"tiny{devices}")
    got = json.loads((runs["out"] / f"tiny{devices}.json").read_text())
    assert got["devices"] == devices
    first, second_prompt, longer_run = got["results"]
    # prefill + decode compile once per bucket; another prompt length in the bucket compiles nothing
    assert [r["bucket"] for r in got["results"]] == [16, 16, 16]
    assert first["compiles"] == 2 and second_prompt["compiles"] == 0
    # 64 new tokens need a longer KV cache (a new decode graph, and a prefill that writes into it): again 2, not 64
    assert longer_run["compiles"] == 2
    for request, result in zip(runs["requests"], got["results"]):
        expected = _cpu_reference(tiny_dir, request["prompt"], request["max_new_tokens"], request["stop_ids"])
        assert result["tokens"] == expected
    assert len(longer_run["tokens"]) == 64  # the random model never emits a stop token here: all 64 compared


@pytest.mark.parametrize("devices", [1, 8])
def test_real_smollm2_answers_paris_like_the_cpu_recipe(runs, devices):
    cpu_text, _ = _finish(runs, "real_cpu")
    text, log = _finish(runs, f"real{devices}")
    assert "Paris" in text
    assert text == cpu_text  # the same greedy tokens decode to the same text
    assert "XLA compilations: 2 " in log, log[-2000:]
    assert "time to first token" in log and "steady decode" in log
