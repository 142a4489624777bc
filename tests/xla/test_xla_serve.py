"""serve/base.py --accelerator xla on XLA:CPU, 1, 2 and 8 devices, driven by the real `openai` client: 32 concurrent
clients (chat and completions, streamed and not, mixed lengths) all get the answers the CPU server gives each
request alone (greedy), and nothing compiles after the warm-up (the prefill call, the decode step, ...; the slot
count and cache length fixed).

The CPU and 1-device servers start together, each its own process (the XLA runtime reads PJRT_DEVICE and
CPU_NUM_DEVICES once). Slow: the weights' placement (lit_gpt/xla/serve_placement.py), read from the optimized HLO
that XLA dumps (--xla_dump_to): a 2-device server with --weights replicated compiles no all-gather at all, and the
8-device one (--weights tensor_parallel) none of a weight, only all-reduces of activations (under the training
layout, FSDP, every decode step all-gathered every weight: ~0.35 s a step on 8 virtual devices on 2 cores). The
loop's batch on 8 devices is in the default suite through tests/xla/test_xla_lm_eval.py (batched generation, two
graphs per bucket)."""

import asyncio
import os
import re
from pathlib import Path
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


def check_server(server: Any, reference: List[Tuple[str, str]], compiles: int = 3) -> None:
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
    # (echo with logprobs), the decode step; no prompt-length buckets, and no block copy (the paged cache shares a
    # prefix's blocks through the block table)
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

def collectives(dump: Path) -> Dict[str, List[Tuple[str, Tuple[int, ...]]]]:
    """The collectives of every program XLA compiled from the model's first forward on (XLA_FLAGS=--xla_dump_to: the
    SPMD-partitioned, optimized HLO of each), by program: [(op, result shape), ...]. The programs before it are the
    load's: each parameter resharded once from the loader's FSDP layout (all-gathers, once, not per step)."""
    found, serving = {}, False
    for path in sorted(dump.glob("*after_optimizations.txt")):
        text = path.read_text()
        serving = serving or " dot(" in text  # the first forward (the warm-up's prefill call)
        if serving:
            found[path.name.split(".")[0]] = [(op, tuple(int(d) for d in dims.split(",") if d))
                                              for dims, op in COLLECTIVE.findall(text)]
    assert found, f"no optimized HLO of a forward was dumped in {dump}"
    return found


COLLECTIVE = re.compile(r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                        r"(?:-start)?\(")


def dump_vars(xla_env: Any, devices: int, dump: Path) -> Dict[str, str]:
    env = xla_vars(xla_env, devices)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
    return env


@pytest.mark.slow  # a 2-device server's warm-up: ~30 s
def test_replicated_weights_compile_no_all_gather(servers, reference, xla_env, tmp_path):
    """--weights replicated (what auto chooses on XLA:CPU): every graph the server compiles (the warm-up compiles all
    of them: the prefill calls, the decode step) holds no all-gather, and its answers are the CPU's. Two devices (no
    8-device lock): replicated weights need no more to show that nothing is gathered."""
    from serve_client import ServerProcess

    server = ServerProcess(servers["tiny_dir"], *servers["flags"], "--weights", "replicated", accelerator="xla",
                           env=dump_vars(xla_env, 2, tmp_path), forks=servers["forks"]).start()
    try:
        server.ready(START_TIMEOUT)
        assert "Weights replicated on every device (--weights replicated)" in server.log()
        found = collectives(tmp_path)
        assert not [op for ops in found.values() for op in ops if op[0] == "all-gather"], found
        client = server.client()
        for i in (0, 1, 2, 4):  # a few of the load's requests, alone: the CPU server's answers
            req = requests()[i]
            if "prompt" in req and not req["stream"]:
                r = client.completions.create(model="tiny-llama", prompt=req["prompt"], temperature=0,
                                              max_tokens=req["max_tokens"])
                assert (r.choices[0].text, r.choices[0].finish_reason) == reference[i]
    finally:
        server.stop()


@pytest.mark.slow  # 8 virtual devices on 2 cores
def test_8_devices_concurrent_clients_get_the_cpu_answers_and_nothing_compiles_after_warm_up(servers, reference,
                                                                                            xla_env, tmp_path):
    """The weights tensor-parallel over the mesh (--weights tensor_parallel: the tiny model's 2 KV heads make it 2-way,
    4 replicas), the KV cache split on heads, the batch's state replicated: the CPU answers, nothing recompiles per
    step, and no compiled graph all-gathers anything (the partitioner all-reduces activations instead). Started after
    the others are idle: its 8 device threads must not starve (XLA:CPU aborts a collective that waits for a thread
    over 10 s)."""
    from serve_client import ServerProcess

    servers["xla8"] = ServerProcess(servers["tiny_dir"], *servers["flags"], "--weights", "tensor_parallel",
                                    accelerator="xla", env=dump_vars(xla_env, 8, tmp_path),
                                    forks=servers["forks"]).start()
    # the traced graphs of 1 device and nothing else: the 2 more programs the FSDP layout compiled here (the SPMD
    # runtime's, for state the warm-up placed sharded) are gone with it
    check_server(servers["xla8"], reference)
    assert "Weights tensor-parallel over 2 devices, 4 replica(s) (--weights tensor_parallel)" in servers["xla8"].log()
    found = collectives(tmp_path)
    # no all-gather at all, of a weight or otherwise (the embedding and head are replicated: sampling needs no
    # gathered logits); what moves is the activations: an all-reduce after each output projection and the fused
    # qkv's rows to their heads (collective-permutes of one token's q/k/v per step)
    assert not [(name, shape) for name, ops in found.items() for op, shape in ops if op == "all-gather"], found
    # the step's two all-reduces per layer (after attention's and the MLP's output projections; 2 layers)
    assert max(sum(op == "all-reduce" for op, _ in ops) for ops in found.values()) >= 2 * 2, found



def test_cpu_server_concurrent_equals_alone(servers, reference):
    assert run_load(servers["cpu"].ready(START_TIMEOUT).url, "tiny-llama", concurrent=True) == reference
    assert any(reason == "length" for _, reason in reference) and len({t for t, _ in reference}) > 16
