"""serve/base.py --accelerator xla on XLA:CPU, 1 and 8 devices, driven by the real `openai` client: 32 concurrent
clients (chat and completions, streamed and not, mixed lengths) all get the answers the CPU server gives each
request alone (greedy), and nothing compiles after the warm-up (one prefill per prompt bucket and one decode step,
the slot count and cache length fixed).

The CPU and 1-device servers start together, each its own process (the XLA runtime reads PJRT_DEVICE and
CPU_NUM_DEVICES once); the 8-device run (weights sharded over the mesh) is marked slow: on this machine's 2 cores
its 8 virtual devices take about a second per step. The loop's batch on 8 devices is in the default suite through
tests/xla/test_xla_lm_eval.py (batched generation, two graphs per bucket)."""

import asyncio
import os
import re
from typing import Any, Dict, List, Tuple

import pytest

START_TIMEOUT = 600
LOAD_TIMEOUT = 600  # a hang guard: the 8-device load takes ~150 s alone, twice that beside the other worker
SLOTS, LENGTH = 8, 128
BUCKETS = 4  # prompt lengths 16, 32, 64, 128


def requests() -> List[Dict[str, Any]]:
    """32 requests: chat and completions, streamed and not, 1 to 8 new tokens, greedy (8 virtual XLA:CPU devices on
    a small machine take about a second per step: the lengths are short)."""
    words = ["cat", "river", "robot", "storm", "king", "clock", "ship", "tree"]
    out = []
    for i in range(32):
        req: Dict[str, Any] = {"max_tokens": 1 + (i * 5) % 8, "temperature": 0, "stream": i % 2 == 1}
        if i % 3 == 0:
            req["messages"] = [{"role": "user", "content": f"Tell me about the {words[i % 8]} {i}."}]
        else:
            req["prompt"] = f"Once upon a time, a {words[i % 8]} " + "and then " * (i % 9)
        out.append(req)
    return out


async def ask(client: Any, model: str, req: Dict[str, Any]) -> Tuple[str, str]:
    """(text, finish_reason) of one request, streamed or not."""
    kwargs = {k: v for k, v in req.items() if k not in ("messages", "prompt")}
    chat = "messages" in req
    create = client.chat.completions.create if chat else client.completions.create
    response = await create(model=model, **({"messages": req["messages"]} if chat else {"prompt": req["prompt"]}),
                            **kwargs)
    if not req["stream"]:
        choice = response.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason
    text, reason = "", None
    async for chunk in response:
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            reason = choice.finish_reason or reason
    return text, reason


def run_load(url: str, model: str, concurrent: bool) -> List[Tuple[str, str]]:
    from openai import AsyncOpenAI

    async def main() -> List[Tuple[str, str]]:
        client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=LOAD_TIMEOUT)
        if concurrent:
            return list(await asyncio.wait_for(asyncio.gather(*[ask(client, model, r) for r in requests()]),
                                               LOAD_TIMEOUT))
        return [await ask(client, model, r) for r in requests()]

    return asyncio.run(main())


def xla_vars(xla_env: Any, devices: int) -> Dict[str, str]:
    """The XLA:CPU variables of the suite's XLA environment (PJRT_DEVICE, CPU_NUM_DEVICES, flags), and for 8 devices
    the lock that keeps such processes one at a time (tests/xla/conftest.py `xla_env`)."""
    from child_env import python_path

    env = xla_env(devices)
    found = {k: v for k, v in env.items() if k.startswith(("PJRT_", "CPU_NUM", "XLA_", "TF_CPP", "LIT_GPT_TEST_XLA"))}
    if "LIT_GPT_TEST_XLA_LOCK" in env:
        found["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"].split(os.pathsep)[0], python_path()])
    return found


def _one_device_selected(request) -> bool:
    """Whether a selected test of this module talks to the 1-device server (`-m slow` selects the 8-device test
    only: then the 1-device server, ~9 compilations of warm-up, is not started for nothing)."""
    return any(item.module is request.module and "1_device" in item.name for item in request.session.items)


@pytest.fixture(scope="module")
def servers(tiny_dir, xla_env, request, xla_forks):
    """The CPU server and the 1-device XLA one (if a selected test needs it), started together (the 8-device one by
    its own, slow, test)."""
    from serve_client import ServerProcess

    flags = ("--slots", str(SLOTS), "--max_seq_length", str(LENGTH))
    started = {"cpu": ServerProcess(tiny_dir, *flags).start()}
    if _one_device_selected(request):
        # forked from the XLA fork server (tests/conftest.py `xla_forks`): a process without the imports' ~8 s
        started["xla1"] = ServerProcess(tiny_dir, *flags, accelerator="xla", env=xla_vars(xla_env, 1),
                                        forks=xla_forks).start()
    started["flags"], started["tiny_dir"], started["forks"] = flags, tiny_dir, xla_forks
    yield started
    for server in started.values():
        if hasattr(server, "stop"):
            server.stop()


@pytest.fixture(scope="module")
def reference(servers):
    """Each request alone on the CPU server (sequential), once the XLA server has warmed up (one heavy job at a time
    on a small machine)."""
    if "xla1" in servers:
        servers["xla1"].ready(START_TIMEOUT)
    return run_load(servers["cpu"].ready(START_TIMEOUT).url, "tiny-llama", concurrent=False)


def check_server(server: Any, reference: List[Tuple[str, str]], compiles: int = 4) -> None:
    url = server.ready(START_TIMEOUT).url
    answers = run_load(url, "tiny-llama", concurrent=True)
    assert len(answers) == 32
    assert [reason for _, reason in answers] == [reason for _, reason in reference]
    assert answers == reference
    health = server.health()
    assert health["compilations_after_warm_up"] == 0, health
    warm = re.search(r"Warm-up: [\d.]+ s, (\d+) compilations \(prefill calls of (\d+) rows x (\d+) tokens\)",
                     server.log())
    assert warm and warm.group(2, 3) == ("4", "32"), server.log()[-2000:]  # --prefill_chunk's default, 4 rows
    # chunked prefill (lit_gpt/recipes/serving.py): the prefill call, the same keeping every position's scores
    # (echo with logprobs), the decode step, the prefix cache's block copy; no prompt-length buckets
    assert int(warm.group(1)) == compiles


def test_1_device_concurrent_clients_get_the_cpu_answers_and_nothing_compiles_after_warm_up(servers, reference):
    check_server(servers["xla1"], reference)



def test_1_device_scores_equal_the_cpu_servers_and_compile_nothing(servers, reference):
    """`logprobs` with `echo` (a prompt scored: the warm-up's second prefill graph per bucket) and without, and
    `max_tokens: 0`: the log-probabilities of the CPU server within float32 noise, and no compilation."""
    scores = {}
    for name in ("cpu", "xla1"):
        client = servers[name].ready(START_TIMEOUT).client()
        out = []
        for prompt, kwargs in (("Once upon a time, a cat", {"max_tokens": 3, "logprobs": 2, "echo": True}),
                               ("Once upon a time, a cat " * 5, {"max_tokens": 2, "logprobs": 1}),
                               ("Tell me about the river.", {"max_tokens": 0, "logprobs": 0, "echo": True})):
            r = client.completions.create(model="tiny-llama", prompt=prompt, temperature=0, **kwargs)
            out.append((r.choices[0].text, r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs))
        scores[name] = out
    for (text, tokens, lps), (xtext, xtokens, xlps) in zip(scores["cpu"], scores["xla1"]):
        assert (xtext, xtokens) == (text, tokens)
        assert xlps == pytest.approx(lps, abs=1e-4)
    assert servers["xla1"].health()["compilations_after_warm_up"] == 0

@pytest.mark.slow  # 8 virtual devices on 2 cores: about a second per decode step, 4 minutes in all
def test_8_devices_concurrent_clients_get_the_cpu_answers_and_nothing_compiles_after_warm_up(servers, reference,
                                                                                            xla_env):
    """The weights sharded over the SPMD mesh, the batch's state replicated: nothing recompiles per step. Started
    after the others are idle: its 8 device threads must not starve (XLA:CPU aborts a collective that waits for a
    thread over 10 s)."""
    from serve_client import ServerProcess

    servers["xla8"] = ServerProcess(servers["tiny_dir"], *servers["flags"], accelerator="xla",
                                    env=xla_vars(xla_env, 8), forks=servers["forks"]).start()
    # 4 traced graphs as on 1 device (PT_XLA_DEBUG_LEVEL=1 reports the same four, each from a torch_xla.sync), and 2
    # compilations no traced step triggers: the SPMD runtime's programs for the state the warm-up places sharded
    check_server(servers["xla8"], reference, compiles=6)


def test_cpu_server_concurrent_equals_alone(servers, reference):
    assert run_load(servers["cpu"].ready(START_TIMEOUT).url, "tiny-llama", concurrent=True) == reference
    assert any(reason == "length" for _, reason in reference) and len({t for t, _ in reference}) > 16
