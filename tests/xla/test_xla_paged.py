"""The serving engine's paged KV cache on XLA:CPU (1 device): a cache of 160 tokens (10 blocks) for 4 slots of 128,
prompts sharing a 48-token prefix (its blocks shared through the block table), a long request that waits for blocks
and short ones, all submitted at once: the greedy tokens of the CPU engine, the same prefix tokens reused, three
compilations in the warm-up (the prefill call, the same keeping every position's scores, the decode step: the block
table is an input of fixed shape) and none after."""

from typing import Any, Dict

import pytest
import torch

from child_env import ROOT, child_result

SCRIPT = r'''
import json, sys
from lit_gpt.recipes.evaluate import load_eval_model
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/.."]  # this module and tests/ (child_env)
from test_xla_paged import run
print("RESULT " + json.dumps(run(load_eval_model(sys.argv[2], accelerator=sys.argv[1], precision="32-true"))))
'''


def run(loaded: Any) -> Dict[str, Any]:
    """The engine's answers to the jobs below, its stats and its compilations (in the warm-up and after it)."""
    from lit_gpt.recipes.serving import Engine, Job

    tok = loaded.tokenizer
    engine = Engine(loaded, slots=4, max_seq_length=128, max_queue=16, kv_cache_tokens=160, prefill_chunk=16)
    warm = engine.warm_up()
    system = tok.encode("You are a careful assistant who answers in one short sentence. " * 6).tolist()[:48]
    specs = [(system + tok.encode(f" Question {i}?").tolist(), 5) for i in range(3)]
    specs += [(specs[0][0], 5), (tok.encode("The capital of France is " * 12).tolist(), 40),
              (tok.encode("Once upon a time").tolist(), 6)]
    jobs = [Job(list(ids), max_tokens=m, emit=lambda *e: None) for ids, m in specs]
    engine.submit(jobs)
    waited = False
    with engine.runtime.inference_context():
        while engine.busy():
            engine.iterate()
            waited = waited or (engine.blocked and bool(engine.waiting))
    return {"tokens": [j.generated_ids for j in jobs], "cached": engine.stats["cached_tokens"], "waited": waited,
            "warm": warm["compiles"], "after": engine.compiles_since_warm_up(), "kv": engine.kv_blocks()}


@pytest.mark.slow  # XLA:CPU's three compilations of the tiny model: ~25 s on a quiet 2-core machine, more when loaded
def test_paged_engine_on_xla_gives_the_cpu_tokens_and_compiles_three_graphs_in_the_warm_up_only(tiny_dir, xla_env):
    from lit_gpt.recipes.evaluate import load_eval_model

    xla = child_result(SCRIPT, ["xla", str(tiny_dir), str(ROOT / "tests" / "xla")], xla_env(1))
    with torch.inference_mode():
        cpu = run(load_eval_model(tiny_dir, accelerator="cpu", precision="32-true"))
    assert xla["tokens"] == cpu["tokens"]
    assert xla["cached"] == cpu["cached"] >= 3 * 48 and xla["waited"]
    assert (xla["warm"], xla["after"]) == (3, 0), xla
    assert xla["kv"] == {"kv_blocks": 10, "kv_blocks_in_use": 0, "kv_blocks_cached": xla["kv"]["kv_blocks_cached"]}
