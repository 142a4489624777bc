"""serve/base.py --accelerator xla (XLA:CPU, 1 device) with chunked prefill and the prefix cache, driven by the real
`openai` client: prompts longer than the chunk, prompts sharing a prefix (their KV blocks shared through the block
table), `n` > 1 and a scored prompt, sent at once, get the greedy answers of the CPU server that prefills whole prompts
and shares nothing, and nothing compiles after the warm-up (three graphs: the prefill call, the same keeping every
position's scores, the decode step)."""

import asyncio
import re
from typing import Any, List, Tuple

import pytest

START_TIMEOUT = 600
FLAGS = ("--slots", "4", "--max_seq_length", "128")


def requests() -> List[dict]:
    system = "You are a helpful assistant who answers briefly and well. " * 3
    out: List[dict] = []
    for i in range(6):
        out.append({"prompt": system + f"Question {i}: name a color.", "max_tokens": 3 + i % 3})
    out.append({"prompt": system + "Question 0: name a color.", "max_tokens": 4, "n": 2})
    out.append({"prompt": "Once upon a time, " * 12, "max_tokens": 5, "stream": True})
    out.append({"prompt": system + "Score this.", "max_tokens": 0, "echo": True, "logprobs": 1})
    return out


def run_load(server: Any, concurrent: bool) -> List[Tuple[Any, ...]]:
    async def ask(client: Any, req: dict) -> Tuple[Any, ...]:
        r = await client.completions.create(model="tiny-llama", temperature=0, **req)
        if req.get("stream"):
            return ("".join([c.choices[0].text async for c in r if c.choices]),)
        lps = [c.logprobs.token_logprobs for c in r.choices] if req.get("logprobs") is not None else None
        return tuple(c.text for c in r.choices), lps

    async def main() -> List[Tuple[Any, ...]]:
        async with server.async_client(timeout=300) as client:
            if concurrent:
                return list(await asyncio.gather(*[ask(client, r) for r in requests()]))
            return [await ask(client, r) for r in requests()]

    return asyncio.run(main())


@pytest.mark.slow  # two server processes and XLA:CPU's three compilations: about a minute on 2 cores
def test_chunked_prefill_and_prefix_cache_on_xla_give_the_cpu_answers_and_compile_nothing_after_warm_up(
        tiny_dir, xla_env, xla_forks):
    from serve_client import ServerProcess

    env = {k: v for k, v in xla_env(1).items() if k.startswith(("PJRT_", "CPU_NUM", "XLA_", "TF_CPP"))}
    cpu = ServerProcess(tiny_dir, *FLAGS, "--prefill_chunk", "0", "--prefix_cache", "false").start()
    xla = ServerProcess(tiny_dir, *FLAGS, "--prefill_chunk", "16", accelerator="xla", env=env,
                        forks=xla_forks).start()  # forked from the XLA fork server: without the imports' ~8 s
    try:
        xla.ready(START_TIMEOUT)
        reference = run_load(cpu.ready(START_TIMEOUT), concurrent=False)
        answers = run_load(xla, concurrent=True)
        assert [a[0] for a in answers] == [r[0] for r in reference]
        for a, r in zip(answers, reference):
            if len(r) > 1 and r[1] is not None:
                for mine, ref in zip(a[1], r[1]):
                    assert [x for x in mine if x is not None] == pytest.approx([x for x in ref if x is not None],
                                                                               abs=1e-4)
        health = xla.health()
        assert health["compilations_after_warm_up"] == 0, health
        assert health["cached_prompt_tokens"] > 0, health  # the shared prefix's blocks were shared, not recomputed
        warm = re.search(r"Warm-up: [\d.]+ s, (\d+) compilations \(prefill calls of (\d+) rows x (\d+) tokens\)",
                         xla.log())
        assert warm and warm.groups() == ("3", "4", "16"), xla.log()[-2000:]
    finally:
        cpu.stop()
        xla.stop()
