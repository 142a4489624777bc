"""serve/base.py --accelerator xla on XLA:CPU, 1 and 8 devices, driven by the real `openai` client: 32 concurrent
clients (chat and completions, streamed and not, mixed lengths) all get the answers the CPU server gives each
request alone (greedy), and nothing compiles after the warm-up (one prefill per prompt bucket and one decode step,
the slot count and cache length fixed).

The CPU and 8-device servers start together, each its own process (the XLA runtime reads PJRT_DEVICE and
CPU_NUM_DEVICES once); the 1-device run is marked slow (the 8-device one covers the same code, sharded)."""

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 600
LOAD_TIMEOUT = 300
SLOTS, LENGTH = 4, 128
BUCKETS = 4  # prompt lengths 16, 32, 64, 128


def requests() -> List[Dict[str, Any]]:
    """32 requests: chat and completions, streamed and not, 2 to 24 new tokens, greedy."""
    words = ["cat", "river", "robot", "storm", "king", "clock", "ship", "tree"]
    out = []
    for i in range(32):
        req: Dict[str, Any] = {"max_tokens": 2 + (i * 7) % 23, "temperature": 0, "stream": i % 2 == 1}
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


class Servers:
    """Servers started at once (each its own process); `url(name)` waits until that one listens."""

    def __init__(self, checkpoint: Path, xla_env: Any, root: Path) -> None:
        self.checkpoint, self.xla_env, self.root = checkpoint, xla_env, root
        self.procs: Dict[str, Tuple[subprocess.Popen, Path]] = {}

    def start(self, name: str, accelerator: str, devices: int = 1) -> None:
        from child_env import python_path

        cmd = [sys.executable, str(REPO / "serve/base.py"), "--checkpoint_dir", str(self.checkpoint), "--port", "0",
               "--accelerator", accelerator, "--slots", str(SLOTS), "--max_seq_length", str(LENGTH)]
        env = self.xla_env(devices, PYTHONPATH=python_path())
        if accelerator == "cpu":
            env = {k: v for k, v in env.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
        log = self.root / f"{name}.log"
        self.procs[name] = (subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT),
                            log)

    def url(self, name: str) -> Tuple[str, Path]:
        proc, log = self.procs[name]
        deadline = time.time() + START_TIMEOUT
        while True:
            found = re.search(r"on (http://\S+/v1)", log.read_text())
            if found:
                return found.group(1), log
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"the {name} server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def close(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def servers(tiny_dir, xla_env, tmp_path_factory):
    """The CPU server and the 8-device XLA one, started together (the 1-device one by its own test)."""
    servers = Servers(tiny_dir, xla_env, tmp_path_factory.mktemp("xla_serve"))
    servers.start("cpu", "cpu")
    servers.start("xla8", "xla", 8)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def reference(servers):
    """Each request alone on the CPU server (sequential)."""
    return run_load(servers.url("cpu")[0], "tiny-llama", concurrent=False)


def check_server(url: str, log: Path, reference: List[Tuple[str, str]]) -> None:
    answers = run_load(url, "tiny-llama", concurrent=True)
    assert len(answers) == 32
    assert [reason for _, reason in answers] == [reason for _, reason in reference]
    assert answers == reference
    health = json.load(urllib.request.urlopen(url[: -len("/v1")] + "/health", timeout=10))
    assert health["compilations_after_warm_up"] == 0, health
    warm = re.search(r"Warm-up: [\d.]+ s, (\d+) compilations \((\d+) prompt lengths\)", log.read_text())
    assert warm and int(warm.group(2)) == BUCKETS
    assert int(warm.group(1)) == BUCKETS + 1  # a prefill per bucket, the decode step


def test_8_devices_concurrent_clients_get_the_cpu_answers_and_nothing_compiles_after_warm_up(servers, reference):
    check_server(*servers.url("xla8"), reference)


@pytest.mark.slow
def test_1_device_concurrent_clients_get_the_cpu_answers_and_nothing_compiles_after_warm_up(servers, reference):
    servers.start("xla1", "xla", 1)
    check_server(*servers.url("xla1"), reference)


def test_cpu_server_concurrent_equals_alone(servers, reference):
    assert run_load(servers.url("cpu")[0], "tiny-llama", concurrent=True) == reference
    assert any(reason == "length" for _, reason in reference) and len({t for t, _ in reference}) > 16
