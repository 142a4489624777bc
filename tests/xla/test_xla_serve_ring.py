"""The serving engine on XLA:CPU (1 device) with a model whose sliding-window layers keep a ring of their window
(every layer slides, window 8, in slots of 64 positions): prompts shorter and longer than the window and than the
chunk (6 tokens), prefilled in fixed-shape chunks between the decode steps of the rows in flight, some waiting for a
free row, get the greedy tokens of the CPU engine that prefills whole prompts; three compilations in the warm-up
(the prefill call, the same keeping every position's scores, the decode step) and none after."""

from typing import Any, Dict

import pytest
import torch

from child_env import ROOT, child_result

SCRIPT = r'''
import json, sys
from lit_gpt.recipes.evaluate import load_eval_model
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/.."]  # this module and tests/ (child_env)
from test_xla_serve_ring import run
print("RESULT " + json.dumps(run(load_eval_model(sys.argv[2], accelerator=sys.argv[1], precision="32-true"), 6)))
'''


def run(loaded: Any, chunk: int) -> Dict[str, Any]:
    """The engine's answers (its warm-up's and later compilations): one short stream first, then prompts of 3 to 40
    tokens while it decodes, more than the free rows."""
    from lit_gpt.recipes.serving import Engine, Job

    engine = Engine(loaded, slots=3, max_seq_length=64, max_queue=16, prefill_chunk=chunk)
    warm = engine.warm_up()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40_000, (n,), generator=gen).tolist() for n in (3, 17, 9, 40, 5)]
    jobs = [Job(p, max_tokens=m, emit=lambda *e: None) for p, m in zip(prompts, (14, 6, 9, 7, 5))]
    with engine.runtime.inference_context():
        engine.submit(jobs[:1])
        engine.iterate()
        engine.submit(jobs[1:])
        while engine.busy():
            engine.iterate()
    return {"tokens": [j.generated_ids for j in jobs], "calls": engine.stats["prefill_calls"], "ring": engine.ring,
            "chunk": engine.chunk, "warm": warm["compiles"], "after": engine.compiles_since_warm_up()}


@pytest.fixture(scope="module")
def ring_dir(smollm2_dir, tmp_path_factory):
    from tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ring"), smollm2_dir, sliding_window_size=8)


@pytest.mark.slow  # XLA:CPU's three compilations of the tiny model: ~25 s on a quiet 2-core machine
def test_ring_caches_are_prefilled_in_fixed_chunks_on_xla_with_the_cpu_tokens(ring_dir, xla_env):
    from lit_gpt.recipes.evaluate import load_eval_model

    xla = child_result(SCRIPT, ["xla", str(ring_dir), str(ROOT / "tests" / "xla")], xla_env(1))
    with torch.inference_mode():
        cpu = run(load_eval_model(ring_dir, accelerator="cpu", precision="32-true"), 0)
    assert xla["ring"] and cpu["ring"] and xla["chunk"] == 6
    assert xla["tokens"] == cpu["tokens"]
    assert xla["calls"] > cpu["calls"]  # in chunks of 6: the 40-token prompt alone takes 7 calls
    assert (xla["warm"], xla["after"]) == (3, 0), xla
