"""Sliding-window KV caches on XLA:CPU (1 device): the sliding layers' caches hold their window (a ring,
lit_gpt.kv_cache), the prompt (longer than the window, padded to its bucket) compiles one prefill graph and the decode
steps one graph, a second prompt in the same bucket compiles nothing, and the tokens equal the CPU loop's."""

import json
from pathlib import Path

import pytest
import torch
from fork_server import run_captured

REPO = Path(__file__).resolve().parents[2]
WINDOW = 8
NEW = 12  # new tokens (the prompts of 20 and 27 tokens are already past the window)
TIMEOUT = 900

DRIVER = r"""
import json, sys
from pathlib import Path
import torch
from lit_gpt.generate import timed_generate, unwrap
from lit_gpt.recipes.xla_generate import load_base_staged
from lit_gpt.xla import make_fabric
from lit_gpt.xla.runtime import XLARuntime

checkpoint_dir, prompts, out, NEW = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
fabric = make_fabric("auto", "32-true")

def main(fabric):
    model = fabric.setup_module(load_base_staged(fabric, checkpoint_dir))
    runtime = XLARuntime(fabric)
    results = []
    for prompt in prompts:
        g = timed_generate(model, torch.tensor(prompt), NEW, runtime)
        results.append({"tokens": g.tokens.tolist(), "compiles": g.compiles})
    caches = [[b.attn.sliding_window, b.attn.kv_cache.k.size(2)] for b in unwrap(model).transformer.h]
    out.write_text(json.dumps({"results": results, "caches": caches}))

fabric.launch(main)
"""


@pytest.mark.slow  # one XLA process: ~50 s of imports and compilations on 2 cores
def test_sliding_caches_hold_the_window_with_one_decode_graph(tmp_path, xla_env, xla_forks):
    from tiny import random_model, tiny_llama_config, write_checkpoint

    from lit_gpt.generate import generate

    # Gemma's pattern at toy size: layer 0 slides (window 8), layer 1 is global
    config = tiny_llama_config(sliding_window_size=WINDOW, layer_types=["sliding_attention", "full_attention"])
    model = random_model(config, seed=1)
    with torch.no_grad():  # weights large enough that greedy continuations vary
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.4)
    write_checkpoint(model, tmp_path / "ckpt")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 27)]  # both in the 32 bucket
    # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
    proc = run_captured(xla_forks, ["-c", DRIVER, str(tmp_path / "ckpt"), json.dumps(prompts), str(tmp_path / "out.json"),
                                    str(NEW)], REPO, xla_env(1), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    # the sliding layer: the window; the global layer: the cache the bucket asks for (32 + 12 -> 64)
    assert got["caches"] == [[WINDOW, WINDOW], [None, 64]]
    first, second = got["results"]
    assert first["compiles"] == 2 and second["compiles"] == 0  # one prefill graph per bucket, one decode graph
    for prompt, result in zip(prompts, got["results"]):
        assert result["tokens"] == generate(model.eval(), torch.tensor(prompt), NEW).tolist()
