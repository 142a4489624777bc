"""serve/base.py as users run it: a real server process (`--port 0`, the CPU, the real SmolLM2 in fp32) driven with the
real `openai` client. Load (32 concurrent clients, streaming and not, chat and completions, each answer equal to the
same request sent alone), throughput under continuous batching, a client that goes away mid-stream, bad requests,
the queue bound, Ctrl-C, `n` / `seed` / `stop`, scores (`logprobs`, `echo`: equal to a direct forward; slow: lm-eval's
`local-completions` equal to eval/lm_eval.py's model), `GET /metrics` read with prometheus_client's parser.

The servers this module's selected tests need are started at once, when the module starts (they import and load in
parallel), and killed when it ends (tests/serve_client.py)."""

import asyncio
import json
import random
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import httpx
import openai
import pytest

from serve_client import ServerProcess

# the servers of this module: fixture name -> serve/base.py flags (after --checkpoint_dir, --port 0, --accelerator cpu)
SERVERS: Dict[str, Tuple[str, ...]] = {
    "server": ("--slots", "8", "--max_seq_length", "256"),
    "one_slot": ("--slots", "1", "--max_queue", "1", "--max_seq_length", "512"),
}


@pytest.fixture(scope="module")
def launch(request, smollm2_dir):
    """`launch(name)`: the running ServerProcess `name` of SERVERS (started anew when there is none, or it exited).
    Every server a selected test of this module uses is started here, at once; all are killed when the module ends.
    The one-slot server loads the bf16 Hub-style checkpoint (what users bring; served in fp32 on the CPU), the other
    the fp32 one the reference answers come from."""
    started: Dict[str, List[ServerProcess]] = {}
    checkpoints = {"server": smollm2_dir}

    def get(name: str) -> ServerProcess:
        runs = started.setdefault(name, [])
        if not runs or runs[-1].proc.poll() is not None:
            runs.append(ServerProcess(checkpoints[name], *SERVERS[name]).start())
        return runs[-1]

    wanted = {name for item in request.session.items if getattr(item, "module", None) is request.module
              for name in SERVERS if name in getattr(item, "fixturenames", ())}
    if "one_slot" in wanted:  # the bf16 checkpoint is built only for a run that serves it (-m slow: none)
        checkpoints["one_slot"] = request.getfixturevalue("smollm2_bf16_dir")
    try:
        for name in sorted(wanted):
            get(name)
        yield get
    finally:
        for process in (p for runs in started.values() for p in runs):
            process.stop()


@pytest.fixture(scope="module")
def server(launch) -> ServerProcess:
    """SmolLM2 with 8 slots of 256 positions."""
    return launch("server").ready()


@pytest.fixture
def one_slot(launch) -> ServerProcess:
    """SmolLM2 with 1 slot of 512 positions and a queue of 1 (the Ctrl-C test ends it: the next test gets another)."""
    return launch("one_slot").ready()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from lit_gpt.tokenizer import Tokenizer

    return Tokenizer(smollm2_dir)


# ---------------------------------------------------------------------------------------------- requests, answers
@dataclass(frozen=True)
class Ask:
    """One request: a chat message or a completion prompt (greedy unless the call says otherwise)."""

    kind: str  # "chat" or "completion"
    text: str
    max_tokens: int

    def kwargs(self, served: str, **over: Any) -> Dict[str, Any]:
        body: Dict[str, Any] = {"model": served, "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        return {**body, **over}


@dataclass
class Answer:
    texts: List[str]
    reasons: List[Optional[str]]
    usage: Tuple[int, int, int]  # prompt, completion, total
    chunks: int = field(default=0, compare=False)

    @property
    def text(self) -> str:
        assert len(self.texts) == 1, self.texts
        return self.texts[0]

    @property
    def reason(self) -> Optional[str]:
        assert len(self.reasons) == 1, self.reasons
        return self.reasons[0]


def usage_of(usage: Any) -> Tuple[int, int, int]:
    assert usage is not None, "no usage in the response"
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def from_response(response: Any, chat: bool) -> Answer:
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(len(choices)))
    texts = [(c.message.content if chat else c.text) or "" for c in choices]
    if chat:
        assert all(c.message.role == "assistant" for c in choices)
    return Answer(texts, [c.finish_reason for c in choices], usage_of(response.usage))


class Assembler:
    """A streamed answer put together from its chunks (the deltas of each choice, its finish reason, the usage)."""

    def __init__(self, chat: bool) -> None:
        self.chat, self.texts, self.reasons, self.usage, self.chunks = chat, {}, {}, None, 0

    def add(self, chunk: Any) -> None:
        self.chunks += 1
        for c in chunk.choices:
            piece = c.delta.content if self.chat else c.text
            self.texts[c.index] = self.texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                assert c.index not in self.reasons, f"choice {c.index} finished twice"
                self.reasons[c.index] = c.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage

    def answer(self) -> Answer:
        n = len(self.texts)
        assert sorted(self.texts) == list(range(n)) and sorted(self.reasons) == list(range(n)), (self.texts,
                                                                                                self.reasons)
        return Answer([self.texts[i] for i in range(n)], [self.reasons[i] for i in range(n)], usage_of(self.usage),
                      self.chunks)


def create(client: Any, ask: Ask) -> Any:
    return client.chat.completions.create if ask.kind == "chat" else client.completions.create


def call(client: Any, model: str, ask: Ask, stream: bool = False, **over: Any) -> Answer:
    """`ask` sent with the openai client (sync), its answer (reassembled from the deltas when streamed)."""
    kwargs = ask.kwargs(model, **over)
    if not stream:
        return from_response(create(client, ask)(**kwargs), ask.kind == "chat")
    assembler = Assembler(ask.kind == "chat")
    for chunk in create(client, ask)(stream=True, **kwargs):
        assembler.add(chunk)
    return assembler.answer()


async def acall(client: Any, model: str, ask: Ask, stream: bool) -> Answer:
    """`call` with the AsyncOpenAI client."""
    kwargs = ask.kwargs(model)
    if not stream:
        return from_response(await create(client, ask)(**kwargs), ask.kind == "chat")
    assembler = Assembler(ask.kind == "chat")
    async for chunk in await create(client, ask)(stream=True, **kwargs):
        assembler.add(chunk)
    return assembler.answer()


def check_usage(answer: Answer, ask: Ask, tokenizer: Any) -> None:
    """Usage consistent with a greedy answer without stop strings: prompt_tokens those of the prompt (> 0), total =
    prompt + completion, completion_tokens the tokens of the text: max_tokens when it ended by length, fewer when by
    the end of text (not counted)."""
    prompt, completion, total = answer.usage
    assert prompt > 0 and total == prompt + completion, answer.usage
    if ask.kind == "completion":
        assert prompt == len(tokenizer.encode(ask.text)), (answer.usage, ask)
    assert completion == len(tokenizer.encode(answer.text, bos=False)), (answer, ask)
    if answer.reason == "length":
        assert completion == ask.max_tokens, (answer, ask)
    else:
        assert answer.reason == "stop" and completion < ask.max_tokens, (answer, ask)


def story(word: str, max_tokens: int = 48) -> Ask:
    """A completion SmolLM2 continues past 64 tokens without an end of text."""
    return Ask("completion", f"Once upon a time, there was a {word} who", max_tokens)


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout} s")


# ---------------------------------------------------------------------------------------------- the basics
def test_models_and_health(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"] == [server.model]
    health = server.health()
    assert {k: health.get(k) for k in ("status", "model", "slots", "waiting", "free_slots")} == {
        "status": "ok", "model": "SmolLM2-135M-Instruct", "slots": 8, "waiting": 0, "free_slots": 8}, health



def scrape(server: ServerProcess) -> Dict[str, float]:
    """GET /metrics parsed with prometheus_client's own parser: sample name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(server.url.rsplit("/v1", 1)[0] + "/metrics", timeout=30, trust_env=False)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain"), response
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            le = sample.labels.get("le")
            out[sample.name + (f"{{{labels}}}" if labels else "") + (f"[le={le}]" if le else "")] = sample.value
    return out


def test_metrics(server, tokenizer):
    """GET /metrics (Prometheus' text format): a greedy request of 6 tokens adds one request, its prompt and 6
    generated tokens, one time to first token and 5 inter-token latencies; idle, nothing is queued or in use."""
    client = server.client()
    before = scrape(server)
    ask = story("fox", max_tokens=6)
    answer = call(client, server.model, ask)
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert answer.usage[1] == 6
    assert delta("lit_gpt_requests_total{endpoint=completions}") == 1
    assert delta("lit_gpt_completions_finished_total{finish_reason=length}") == 1
    assert delta("lit_gpt_prompt_tokens_total") == answer.usage[0] == len(tokenizer.encode(ask.text))
    assert delta("lit_gpt_generation_tokens_total") == 6
    assert delta("lit_gpt_time_to_first_token_seconds_count") == 1
    assert delta("lit_gpt_inter_token_latency_seconds_count") == 5
    assert delta("lit_gpt_inter_token_latency_seconds_sum") > 0
    ttft = "lit_gpt_time_to_first_token_seconds"
    assert after[f"{ttft}_bucket[le=+Inf]"] == after[f"{ttft}_count"]
    assert (after["lit_gpt_queue_depth"], after["lit_gpt_kv_cache_slots_in_use"],
            after["lit_gpt_kv_cache_positions_in_use"]) == (0, 0, 0)
    assert (after["lit_gpt_kv_cache_slots"], after["lit_gpt_kv_cache_positions"]) == (8, 8 * 256)

# ---------------------------------------------------------------------------------------------- bad requests
@dataclass
class Bad:
    id: str
    endpoint: str  # "chat" or "completion"
    body: Dict[str, Any]  # over a good request's body; a value None removes the key
    param: Optional[str]
    message: str
    code: Optional[str] = None
    raw: Any = None  # sent with httpx (bytes as is, else as JSON), not through the openai client (which refuses it)


LONG_PROMPT = "the cat sat on the mat " * 60  # 360 tokens > 256
BAD = [
    # an unknown model is a 404 (OpenAI's NotFoundError), not a 400: tests/test_serve_multi_lora.py
    Bad("malformed-json", "chat", {}, None, "not valid JSON", raw=b'{"model": "SmolLM2-135M-Instruct", "messages": ['),
    Bad("max-tokens-over-context", "completion", {"max_tokens": 300}, "max_tokens",
        "exceeds this server's context of 256 tokens", "context_length_exceeded"),
    Bad("chat-max-tokens-over-context", "chat", {"max_tokens": 250}, "max_tokens", "set max_tokens <=",
        "context_length_exceeded"),
    Bad("max-tokens-zero", "completion", {"max_tokens": 0}, "max_tokens", "max_tokens=0 generates nothing"),
    Bad("chat-max-tokens-zero", "chat", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    Bad("negative-temperature", "chat", {"temperature": -0.5}, "temperature", "greater than or equal to 0"),
    Bad("prompt-over-context", "completion", {"prompt": LONG_PROMPT}, "prompt", "context is 256",
        "context_length_exceeded"),
    Bad("chat-prompt-over-context", "chat", {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        "messages", "context is 256", "context_length_exceeded"),
    Bad("n-zero", "completion", {"n": 0}, "n", "greater than or equal to 1"),
    Bad("n-over-slots", "completion", {"n": 9}, "n", "more than the server's 8 slots"),
    Bad("logprobs-over-20", "completion", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    Bad("logprobs-streamed", "completion", {"logprobs": 1, "stream": True}, "logprobs", "with stream is not supported",
        "unsupported_parameter", raw={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "logprobs": 1, "stream": True}),
    Bad("token-id-beyond-vocab", "completion", {"prompt": [1, 49152]}, "prompt", "49152 is not in the model's vocab"),
    Bad("chat-logprobs", "chat", {"logprobs": True}, "logprobs", "not supported", "unsupported_parameter"),
    Bad("chat-empty-messages", "chat", {"messages": []}, "messages", "at least 1 item"),
    Bad("chat-no-messages", "chat", {}, "messages", "Field required",
        raw={"model": "SmolLM2-135M-Instruct", "max_tokens": 2}),
    # a seed no generator takes (OpenAI's is an int64): named, not an HTTP 500
    Bad("seed-beyond-int64", "completion", {"seed": 2**70, "temperature": 0.5}, "seed",
        "less than or equal to 9223372036854775807"),
    # JSON's NaN is not a number: said so, not "should be less than or equal to 2"
    Bad("nan-temperature", "chat", {}, "temperature", "finite number",
        raw=b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    # 10 prompts x n 8 = 80 completions > 8 slots + 64 queued: it can never fit, so 400 (429 says "retry later")
    Bad("more-completions-than-slots-and-queue", "completion", {"prompt": ["Say hi."] * 10, "n": 8}, "prompt",
        "holds at most 72 at once (8 slots + --max_queue 64)"),
]


@pytest.mark.parametrize("case", BAD, ids=[(c.values[0] if hasattr(c, "values") else c).id for c in BAD])
def test_bad_request(server, case):
    """HTTP 400 with OpenAI's error body (what the client raises as BadRequestError), and the server keeps serving."""
    client = server.client()
    good = Ask(case.endpoint, "Say hi.", 2)
    if case.raw is not None:
        path = "/chat/completions" if case.endpoint == "chat" else "/completions"
        raw = case.raw if isinstance(case.raw, bytes) else json.dumps(case.raw).encode()
        response = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"},
                              timeout=30, trust_env=False)
        status, body = response.status_code, response.json()
    else:
        kwargs = {k: v for k, v in good.kwargs(server.model, **case.body).items() if v is not None}
        with pytest.raises(openai.BadRequestError) as caught:
            create(client, good)(**kwargs)
        status, body = caught.value.status_code, caught.value.response.json()
        assert caught.value.body == body["error"]  # what the client hands the caller
    assert status == 400, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", case.param, case.code), error
    assert case.message in error["message"], error
    # and the server answers the next request
    answer = call(client, server.model, good)
    assert answer.reason in ("length", "stop") and answer.usage[0] > 0, answer
    assert server.health()["free_slots"] == 8


# ---------------------------------------------------------------------------------------------- stop, n, seed
STOP_CASES = [  # (stop, streamed): the stop strings are cut from the greedy answer (below)
    ("later", False), ("later", True), ("both", False), ("never", True)]


def test_stop_strings(server):
    """A stop string ends the choice before it (finish_reason "stop"), streamed or not; the earliest of several wins;
    one that never appears changes nothing."""
    client = server.client()
    for ask, cases in ((story("dragon", 12), STOP_CASES), (Ask("chat", "Write a haiku about the sea.", 12),
                                                            STOP_CASES[:2])):
        full = call(client, server.model, ask)
        assert full.reason == "length", full
        text = full.text
        first, later = text[6:11], text[14:20]  # spans that cross token boundaries
        assert first and later and text.find(first) < text.find(later), text
        stops = {"later": (later, text[: text.find(later)]), "both": ([later, first], text[: text.find(first)]),
                 "never": ("\u00a7never\u00a7", text)}
        for name, stream in cases:
            stop, expected = stops[name]
            got = call(client, server.model, ask, stream=stream, stop=stop)
            assert got.text == expected, (stop, stream, got.text, text)
            assert got.reason == ("length" if name == "never" else "stop"), (stop, got)
            if got.reason == "stop":
                assert got.usage[1] < ask.max_tokens, got


def test_n_and_seed(server):
    """n=2 at temperature 0.8 with a seed: two choices; the same seed gives the same texts (streamed or not), another
    seed others; greedy choices are equal."""
    client = server.client()
    sampled = dict(n=2, temperature=0.8, seed=1234)
    ask = story("wizard", 8)
    a = call(client, server.model, ask, **sampled)
    b = call(client, server.model, ask, stream=True, **sampled)
    assert len(a.texts) == 2 and a.texts[0] != a.texts[1], a
    assert a == b, (a, b)
    assert a.usage[1] <= 2 * ask.max_tokens and a.usage[2] == a.usage[0] + a.usage[1]
    other = call(client, server.model, ask, **{**sampled, "seed": 4321})
    assert other.texts != a.texts, (other, a)
    greedy = call(client, server.model, story("wizard", 4), n=2)
    assert greedy.texts[0] == greedy.texts[1] and greedy.usage[1] == 8, greedy
    chat = Ask("chat", "Tell me a story about a cat.", 8)
    a, b = (call(client, server.model, chat, **sampled) for _ in range(2))
    assert len(a.texts) == 2 and a == b, (a, b)



# ---------------------------------------------------------------------------------------------- scores (logprobs, echo)
@pytest.fixture(scope="module")
def direct(smollm2_dir):
    """The served checkpoint in this process: `direct(ids)` -> the (T, vocab) float32 log-probabilities of one
    forward over `ids` (no KV cache), and their tolerance against another correct float32 evaluation."""
    import torch

    from lit_gpt.loading import load_model
    from tolerance import logits_tolerance

    model = load_model(smollm2_dir)

    def forward(ids: List[int]) -> Tuple[Any, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([ids]))
        # a log-softmax moves each value by at most the logit error twice (the value and the normaliser)
        return torch.log_softmax(logits[0].float(), -1), 2 * logits_tolerance(model.config, logits)

    return forward


def test_logprobs_and_echo_equal_a_direct_forward(server, tokenizer, direct):
    """/v1/completions with `logprobs` and `echo` (what lm-eval's local-completions sends): every prompt and generated
    token's log-probability and its top alternatives equal one forward of the model over prompt + completion (within
    float32's tolerance; the prompt's first token has none), the token texts add up to the choice's text at their
    offsets; `max_tokens: 0` scores the prompt alone, token-id prompts (a list, a list of lists) score the same."""
    client = server.client()
    text = "The capital of France is"
    r = client.completions.create(model=server.model, prompt=text, max_tokens=4, logprobs=3, echo=True, temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    prompt_ids = tokenizer.encode(text).tolist()
    P = len(prompt_ids)
    assert r.usage.prompt_tokens == P and r.usage.completion_tokens == 4
    assert choice.text.startswith(text) and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == P + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ids = list(prompt_ids)
    for _ in range(4):  # the greedy continuation, from the direct forward (re-encoding the text may merge tokens)
        ids.append(int(direct(ids)[0][-1].argmax()))
    assert choice.text == text + tokenizer.decode(ids[P:], skip_special_tokens=True)
    logp, tol = direct(ids)
    expected = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
    got = lp.token_logprobs[1:]
    assert max(abs(a - b) for a, b in zip(got, expected)) <= tol, (got, expected, tol)
    # a real error is far beyond the tolerance: the scores of the right tokens one position off
    shifted = [float(logp[t, ids[t]]) for t in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, shifted)) > 100 * tol
    for t in range(1, len(ids)):
        top = logp[t - 1].topk(3)
        assert len(lp.top_logprobs[t]) == 3
        assert sorted(lp.top_logprobs[t].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=tol)
        assert set(lp.top_logprobs[t]) == {tokenizer.decode([i]) for i in top.indices.tolist()}
    # greedy: each generated token is its position's most likely one
    assert all(lp.token_logprobs[t] == max(lp.top_logprobs[t].values()) for t in range(P, P + 4))

    # max_tokens 0: the prompt scored, nothing generated; as token ids, one prompt or several, the same scores
    for prompt in (text, prompt_ids, [prompt_ids, prompt_ids[:3]]):
        r0 = client.completions.create(model=server.model, prompt=prompt, max_tokens=0, logprobs=0, echo=True,
                                       temperature=0)
        c0 = r0.choices[0]
        assert (c0.text, c0.finish_reason, r0.usage.completion_tokens) == (text, "length", 0)
        assert c0.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:P], abs=tol)
        assert c0.logprobs.top_logprobs[1:] == [{}] * (P - 1)
        if len(r0.choices) == 2:
            assert r0.choices[1].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:3], abs=tol)
    # logprobs without echo: the generated tokens only, the prompt not returned
    r1 = client.completions.create(model=server.model, prompt=text, max_tokens=4, logprobs=1, temperature=0)
    assert r1.choices[0].text == choice.text[len(text):]
    assert r1.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[P:], abs=tol)
    assert r1.choices[0].logprobs.text_offset[0] == 0


# ---------------------------------------------------------------------------------------------- load
LOAD = [
    Ask("chat", "What is the capital of France?", 40),  # ends with its own end of text
    Ask("chat", "Name three colors.", 6),
    Ask("chat", "Hi", 24),
    Ask("chat", "Tell me a joke.", 10),
    story("dragon", 16),
    Ask("completion", "The three primary colors are", 8),
    Ask("completion", "def fibonacci(n):", 9),
    Ask("completion", "Paris is the capital of", 4),
]
LOAD_TIMEOUT = 180.0


def test_load_32_concurrent_clients(server, tokenizer):
    """32 concurrent clients (AsyncOpenAI), chat and completions, streamed and not, max_tokens 4..40, greedy, on 8
    slots (24 wait in the queue): all 32 answer within the bound, each exactly as the same request sent alone."""
    client = server.client()
    alone = {ask: call(client, server.model, ask) for ask in LOAD}
    for ask, answer in alone.items():
        check_usage(answer, ask, tokenizer)
    assert {a.reason for a in alone.values()} == {"stop", "length"}, alone

    plan = [(ask, stream) for ask in LOAD for stream in (False, True, False, True)]
    random.Random(0).shuffle(plan)

    async def everyone() -> List[Any]:
        aclient = server.async_client(timeout=LOAD_TIMEOUT)
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(acall(aclient, server.model, ask, stream) for ask, stream in plan),
                               return_exceptions=True), LOAD_TIMEOUT)
        finally:
            await aclient.close()

    t0 = time.perf_counter()
    results = asyncio.run(everyone())
    seconds = time.perf_counter() - t0
    failed = [(ask, stream, r) for (ask, stream), r in zip(plan, results) if isinstance(r, BaseException)]
    assert not failed, failed
    assert len(results) == 32
    for (ask, stream), answer in zip(plan, results):
        assert answer == alone[ask], (ask, stream, answer, alone[ask])
        if stream:
            assert answer.chunks >= 2, answer
    tokens = sum(r.usage[1] for r in results)
    print(f"\n32 concurrent requests: {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s)")
    health = server.health()
    assert (health["waiting"], health["free_slots"]) == (0, 8), health


def test_throughput_8_concurrent(server):
    """Tokens/s with 8 concurrent requests >= 4x that of one request (the same kind of prompts, 48 tokens each,
    none ends early): the decode step serves every request in flight."""
    client = server.client()
    asks = [story(word) for word in ("dragon", "princess", "farmer", "robot", "wizard", "sailor", "baker", "knight")]

    def measure() -> Tuple[float, float, float]:
        t0 = time.perf_counter()
        single = call(client, server.model, asks[0])
        one = single.usage[1] / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(lambda ask: call(client, server.model, ask), asks))
        eight = sum(a.usage[1] for a in answers) / (time.perf_counter() - t0)
        assert [(a.reason, a.usage[1]) for a in [single, *answers]] == [("length", 48)] * 9, answers
        assert answers[0] == single  # batched or alone: the same greedy answer
        return one, eight, eight / one

    rounds = [measure()]
    if rounds[0][2] < 4:  # the machine is shared: one more round before calling it a regression
        rounds.append(measure())
    for one, eight, ratio in rounds:
        print(f"\nthroughput: 1 request {one:.1f} tokens/s, 8 concurrent {eight:.1f} tokens/s: {ratio:.2f}x")
    assert max(r[2] for r in rounds) >= 4, rounds


def test_shared_prefix_computed_once_and_long_prompt_chunked_with_the_real_client(server, tokenizer, direct):
    """Four completions (token-id prompts) sharing a 96-token prefix, one of them with n=2 and one 120 tokens
    longer (prefilled in chunks of 32 while the others decode), sent at once: the server computes the prefix once
    (/health and /metrics count the prompt tokens computed and reused) and the greedy answers are those of a
    forward of the model over the whole text (no cache)."""
    client = server.client()
    prefix = tokenizer.encode("The bakery on the corner opens at seven and sells bread. " * 12).tolist()[:96]
    prompts = [prefix + tokenizer.encode(f" Question {i}: what does it sell?").tolist() for i in range(4)]
    prompts[3] = prompts[3] + tokenizer.encode(" It also sells cakes and pies. " * 20).tolist()[:120]
    before = server.health()

    def ask(i: int) -> Any:
        return client.completions.create(model=server.model, prompt=prompts[i], max_tokens=4, temperature=0,
                                         n=2 if i == 1 else 1)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    after = server.health()
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    total = sum(len(p) for p in prompts) + len(prompts[1])  # n=2: two choices of one prompt
    assert computed + cached == total, (computed, cached)
    assert cached >= 3 * 96 + 96, (computed, cached)  # the prefix once, the second choice all but its last block
    metrics = httpx.get(server.root + "/metrics", trust_env=False, timeout=10).text
    hits = re.search(r"^lit_gpt_prefix_cache_hit_tokens_total ([\d.e+]+)$", metrics, re.M)
    assert hits and float(hits.group(1)) >= after["cached_prompt_tokens"]

    def greedy(ids: List[int], n: int) -> str:
        out: List[int] = []
        for _ in range(n):
            logp, _ = direct(ids + out)
            token = int(logp[-1].argmax())
            if token in tokenizer.stop_ids:
                break
            out.append(token)
        return tokenizer.decode(out, skip_special_tokens=True)

    assert [c.text for c in answers[1].choices] == [answers[1].choices[0].text] * 2
    for i in (0, 3):
        assert answers[i].choices[0].text == greedy(prompts[i], 4), i


# ---------------------------------------------------------------------------------------------- faults
LONG = story("dragon", 400)  # about a minute of decoding on one slot


def test_disconnect_frees_slot(one_slot):
    """A client that closes its stream after 3 chunks frees the only slot: the next request is served at once
    (with the slot held it would wait for the 400 tokens)."""
    client = one_slot.client()
    stream = client.completions.create(stream=True, **LONG.kwargs(one_slot.model))
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            break
    stream.close()
    assert len(chunks) == 3 and all(c.choices[0].finish_reason is None for c in chunks)
    t0 = time.perf_counter()
    answer = call(client, one_slot.model, story("farmer", 8))
    seconds = time.perf_counter() - t0
    assert (answer.reason, answer.usage[1]) == ("length", 8) and seconds < 10, (answer, seconds)
    wait_for(lambda: one_slot.health()["free_slots"] == 1, 5, "the slot is free again")
    assert one_slot.health()["waiting"] == 0


def test_queue_bound_429(one_slot):
    """1 slot, --max_queue 1: a request in the slot, one waiting, the third gets HTTP 429 (RateLimitError with
    OpenAI's error body); when the first goes the waiting one is served."""
    client = one_slot.client()
    stream = client.completions.create(stream=True, **LONG.kwargs(one_slot.model))
    first = next(iter(stream))  # admitted: the slot is taken
    assert first.choices[0].finish_reason is None
    queued: Dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: queued.update(answer=call(client, one_slot.model, story("baker", 8))))
    waiter.start()
    try:
        wait_for(lambda: one_slot.health()["waiting"] == 1, 10, "the second request waits")
        with pytest.raises(openai.RateLimitError) as caught:
            call(client, one_slot.model, story("robot", 8))
        assert caught.value.status_code == 429
        error = caught.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "queue_full", error
        assert "--max_queue 1" in error["message"], error
        assert waiter.is_alive() and one_slot.health()["waiting"] == 1  # still waiting behind the long one
    finally:
        stream.close()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "the queued request did not finish after the slot was freed"
    answer = queued["answer"]
    assert (answer.reason, answer.usage[1]) == ("length", 8), answer
    wait_for(lambda: one_slot.health()["free_slots"] == 1, 5, "the slot is free again")


def test_ctrl_c_drains(one_slot, tokenizer):
    """SIGINT with a request in the slot and one waiting: new connections are refused at once, both requests still
    get all their tokens, the process says "Stopped after N requests." and exits 0."""
    client = one_slot.client()
    port = one_slot.port
    ask = story("sailor", 24)
    stream = client.completions.create(stream=True, **ask.kwargs(one_slot.model))
    chunks = iter(stream)
    assembler = Assembler(chat=False)
    assembler.add(next(chunks))  # in the slot
    queued: Dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: queued.update(answer=call(client, one_slot.model, story("baker", 8))))
    waiter.start()
    wait_for(lambda: one_slot.health()["waiting"] == 1, 10, "the second request waits")
    one_slot.signal(signal.SIGINT)
    reader = threading.Thread(target=lambda: [assembler.add(c) for c in chunks])
    reader.start()

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return False
        except ConnectionRefusedError:
            return True

    wait_for(refused, 10, f"connections refused after SIGINT\n{one_slot.log()}")
    in_flight = reader.is_alive()
    for thread in (reader, waiter):
        thread.join(timeout=120)
        assert not thread.is_alive(), one_slot.log()
    assert in_flight, "the request had finished before the listener closed: nothing was drained"
    answer = assembler.answer()
    assert (answer.reason, answer.usage[1]) == ("length", 24), answer
    assert len(tokenizer.encode(answer.text, bos=False)) == 24, answer.text
    assert (queued["answer"].reason, queued["answer"].usage[1]) == ("length", 8), queued
    assert one_slot.proc.wait(timeout=30) == 0, one_slot.log()
    log = one_slot.log()
    assert "SIGINT: finishing the requests in flight" in log and re.search(r"Stopped after \d+ requests\.", log), log
    assert "Traceback" not in log, log



@pytest.mark.slow  # the harness twice on the real SmolLM2 (the served one and eval/lm_eval.py's model): ~30 s
def test_lm_eval_local_completions_equal_the_eval_recipe(server, smollm2_dir, tmp_path, monkeypatch):
    """lm-eval's own `local-completions` model pointed at the server (token-id prompts, `logprobs` + `echo` for the
    log-likelihoods, `stop` for the generations) scores the local multiple-choice and generation tasks as
    eval/lm_eval.py's model (lit_gpt.recipes.harness.LitLM) does on the same checkpoint: the same accuracies and exact
    match, every log-likelihood within 1e-4 relative with the same greedy flag, every generated text the same."""
    from unittest import mock

    from harness_tasks import write_tasks
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from lit_gpt.recipes.evaluate import load_eval_model
    from lit_gpt.recipes.harness import LitLM

    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(k, "1")
    manager = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")), include_defaults=False)
    tasks = ["lit_mc", "lit_gen"]

    def run(model: Any, model_args: Any = None) -> Dict[str, Any]:
        # left out: the harness's report of this machine (torch's collect_env runs pip, conda, nvidia-smi, ... as
        # subprocesses: ~3 s a call), which the comparison does not read
        with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None):
            return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                   bootstrap_iters=0, log_samples=True)

    served = run("local-completions", {"base_url": server.url + "/completions", "model": server.model,
                                       "tokenizer_backend": "huggingface", "tokenizer": str(smollm2_dir),
                                       "batch_size": 4, "max_length": 256, "max_retries": 1})
    loaded = load_eval_model(smollm2_dir, accelerator="cpu")
    ours = run(LitLM(loaded.model, loaded.tokenizer, loaded.runtime, batch_size=4, progress=False))
    for task in tasks:
        a, b = served["results"][task], ours["results"][task]
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in b:
                assert a[metric] == b[metric], (task, metric, a[metric], b[metric])
        for sa, sb in zip(served["samples"][task], ours["samples"][task], strict=True):
            assert sa["doc_id"] == sb["doc_id"]
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                if task == "lit_gen":
                    assert ra == rb, (ra, rb)
                else:  # (log-likelihood, is greedy)
                    assert ra[0][0] == pytest.approx(rb[0][0], rel=1e-4) and ra[0][1] == rb[0][1], (task, ra, rb)
    assert ours["results"]["lit_mc"]["acc,none"] >= 0.5  # a real model's scores, not a constant
    assert any(s["resps"][0][0].strip() for s in ours["samples"]["lit_gen"])  # some non-empty generations

# ---------------------------------------------------------------------------------------------- finetuned weights
@pytest.mark.slow  # its own server process: ~10 s
def test_lora_weights_served(tiny_dir, tmp_path):
    """--lora_path: the server answers with the base plus the LoRA weights (greedy: the tokens of the merged model
    run in this process), not with the base alone."""
    from lit_gpt import lora
    from lit_gpt.generate import generate
    from lit_gpt.loading import load_model
    from lit_gpt.peft import load_variant_model
    from lit_gpt.tokenizer import Tokenizer
    from variants import finetuned_on

    finetuned_on(tiny_dir, lora, tmp_path / "final", lora_r=4, lora_alpha=8, lora_mlp=True)
    path = tmp_path / "final" / "lit_model.lora.safetensors"
    process = ServerProcess(tiny_dir, "--lora_path", str(path), "--slots", "2", "--max_seq_length", "64").start()
    try:
        process.ready()
        assert process.model == "tiny-llama"
        ask = Ask("completion", "The capital of France is", 8)
        served = call(process.client(), process.model, ask)
        streamed = call(process.client(), process.model, ask, stream=True)
    finally:
        process.stop()
    tokenizer = Tokenizer(tiny_dir)
    prompt = tokenizer.encode(ask.text)
    merged = load_variant_model(lora.GPT, lora.Config, tiny_dir, path)
    lora.merge_lora_weights(merged)
    expected = tokenizer.decode(generate(merged.eval(), prompt, 8), skip_special_tokens=True)
    base = tokenizer.decode(generate(load_model(tiny_dir).eval(), prompt, 8), skip_special_tokens=True)
    assert (served.text, served.reason, served.usage[1]) == (expected, "length", 8), (served, expected)
    assert streamed == served
    assert base != expected, "the LoRA weights change nothing: the test would not see them ignored"
