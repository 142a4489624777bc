"""The OpenAI-compatible HTTP API of serve/base.py, on FastAPI (validation, routing, JSON) and sse-starlette (the
server-sent events of `stream: true`):

    POST /v1/chat/completions   messages rendered with the checkpoint's prompt style (its chat template)
    POST /v1/completions        a prompt (or a list of prompts) continued as is
    GET  /v1/models             the base model and its LoRA adapters (`--lora`)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   adapters at run time (lit_gpt.recipes.serve_loras)
    GET  /health                200 while the engine runs
    GET  /metrics               Prometheus' text format (lit_gpt.recipes.serve_metrics)

Both POST endpoints take `max_tokens` (chat also `max_completion_tokens`), `temperature`, `top_p`, `stop`, `seed`,
`n`, `stream` (with `stream_options.include_usage`) and report `usage`: in the response, and in a stream on the
chunk that carries the finish reason (plus the separate usage chunk OpenAI sends when `include_usage` is set).

Scores for evaluation (what lm-eval's `local-completions` model sends): /v1/completions takes a prompt as text or
as token ids (a list of ids, or a list of such lists), `logprobs` (0 to MAX_LOGPROBS alternatives per token) and
`echo` (the prompt is returned before the completion, with its tokens' scores when `logprobs` is set; its first
token's log-probability is null, as OpenAI's and vLLM's are), and `max_tokens: 0` with `echo` (score a prompt,
generate nothing). The choice's `logprobs` is OpenAI's completions object: `tokens` (each token's text),
`token_logprobs`, `top_logprobs` (text -> log-probability, the `logprobs` most likely) and `text_offset` (where each
token starts in the choice's text). Log-probabilities are the model's (log-softmax of its logits, before
temperature and top-p). Not with `stream` (refused in one line).

A request's `model` picks what answers it: the base model's name, or an adapter's (`--lora NAME=PATH`); another
name gets HTTP 404 with code `model_not_found`, as OpenAI answers.

Bad requests get HTTP 400 with OpenAI's error body ({"error": {"message", "type", "param", "code"}}) and change
nothing else: malformed JSON, a value out of range, a prompt or `max_tokens` beyond the
context, a parameter this server does not implement (chat's logprobs, tools, penalties, ...; refused by name rather than
ignored), a request with more completions (prompts x n) than slots plus `--max_queue` can ever hold. More
requests than free slots plus `--max_queue` get 429 (retry later). A client that goes away frees its slot at the
next step.
"""

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lit_gpt.generate import RowSampling
from lit_gpt.recipes.serve_loras import add_lora_routes
from lit_gpt.recipes.serve_metrics import ServeMetrics
from lit_gpt.recipes.serving import MAX_LOGPROBS, Engine, Job, QueueFull, Score, new_generator
from lit_gpt.utils import LitError

# parameters of the OpenAI API this server does not implement: refused by name when set to anything but their
# neutral value, so that a client never gets a silently different behaviour
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "echo": (None, False),
               "suffix": (None, ""), "response_format": (None, {"type": "text"})}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_response(status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                   code: Optional[str] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send more (user, store, metadata, ...): ignored unless refused

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # JSON's NaN: "not a finite number"
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI's int64; a torch generator takes it
    stream: bool = False
    stream_options: Optional[StreamOptions] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, List[Dict[str, Any]]]] = None


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class CompletionRequest(_Common):
    prompt: Union[str, List[str], List[int], List[List[int]]]  # text, or token ids (OpenAI's four forms)
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: with echo, score the prompt and generate nothing
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


def build_app(engine: Engine, model_name: str, style: Any, loras: Any = None) -> FastAPI:
    """The FastAPI application over `engine` (which `run`s on the device's thread), serving `model_name` with the
    prompt style `style` (lit_gpt.prompts) for chat, and the LoRA adapters of `loras` (serve_loras.ServedLoRAs)."""
    app = FastAPI(title="lit_gpt OpenAI-compatible server")
    metrics = engine.metrics = ServeMetrics(engine)
    tokenizer = engine.tokenizer
    created = int(time.time())
    stop_ids = sorted({ids[0] for ids in style.stop_tokens(tokenizer) if len(ids) == 1} | set(tokenizer.stop_ids))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.kind, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('msg')}")
        param = ".".join(where) or None
        return error_response(400, f"{param + ': ' if param else ''}{first.get('msg')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), kind="invalid_request_error")

    @app.get("/health")
    async def health() -> Dict[str, Any]:
        return {"status": "ok", "model": model_name, "slots": engine.slots,
                "waiting": len(engine.waiting), "free_slots": engine.free_rows(),
                "prefill_tokens": engine.stats["prefill_tokens"], "cached_prompt_tokens": engine.stats["cached_tokens"],
                "compilations_after_warm_up": engine.compiles_since_warm_up(), **engine.kv_blocks()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.scrape(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        base = {"id": model_name, "object": "model", "created": created, "owned_by": "lit_gpt"}
        return {"object": "list", "data": [base] + (loras.cards(created, model_name) if loras is not None else [])}

    add_lora_routes(app, engine, loras, model_name, APIError)

    def check_common(body: _Common) -> int:
        """The checks every request gets; returns the id of the LoRA adapter its `model` names (0: the base)."""
        adapter = 0 if body.model == model_name else loras.id_of(body.model) if loras is not None else None
        if adapter is None:
            names = ", ".join(repr(m) for m in [model_name, *(loras.by_name if loras is not None else ())])
            raise APIError(404, f"the model {body.model!r} does not exist: this server serves {names}", "model",
                           code="model_not_found")
        extra = body.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and extra[name] not in neutral:
                raise APIError(400, f"{name} is not supported by this server: leave it unset", name,
                               code="unsupported_parameter")
        if body.n > engine.slots:
            raise APIError(400, f"n={body.n} is more than the server's {engine.slots} slots", "n")
        return adapter

    def encode(text: str, bos: Optional[bool]) -> List[int]:
        ids = tokenizer.encode(text, bos=bos).tolist()
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids

    vocab = engine.batch.vocab

    def token_ids(ids: List[int]) -> List[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is not in the model's vocabulary (0..{vocab - 1})", "prompt")
        return list(ids)

    def token_text(i: int) -> str:
        return tokenizer.decode([i])

    def logprobs_object(job: Job, k: int, prompt_text: Optional[str], completion: str) -> Dict[str, Any]:
        """OpenAI's completions `logprobs` of one choice: the echoed prompt's tokens (with `prompt_text`; the first
        has no score) and the generated ones, their texts (as the incremental detokenizer emits them, so that they
        add up to the choice's text) and offsets into the choice's text."""
        entries: List[Any] = []  # (token id, Score or None)
        if prompt_text is not None:
            prompt_scores = job.prompt_scores or []
            entries += [(job.prompt_ids[0], None)] + list(zip(job.prompt_ids[1:], prompt_scores))
        ids = [i for i, _ in entries]
        generated = list(job.generated_ids)
        entries += list(zip(generated, job.scores))
        tokens: List[str] = []
        offsets: List[int] = []
        for part, start in ((ids, 0), (generated, len(prompt_text or ""))):
            decoder, at = tokenizer.stream_decoder(skip_special_tokens=True), start
            for n, i in enumerate(part):
                piece = decoder.step(i) + (decoder.flush() if n == len(part) - 1 else "")
                offsets.append(at)
                tokens.append(piece)
                at += len(piece)

        def top(score: Optional[Score]) -> Optional[Dict[str, float]]:
            if score is None:
                return None
            out: Dict[str, float] = {}
            for i, lp in score[1]:
                if len(out) == k:
                    break
                out.setdefault(token_text(i), lp)  # two ids of one text: the likelier one's value
            return out

        return {"tokens": tokens, "token_logprobs": [s[0] if s is not None else None for _, s in entries],
                "top_logprobs": [top(s) for _, s in entries], "text_offset": offsets}

    def limits(prompt_ids: List[int], max_tokens: Optional[int], param: str, prompt_param: str) -> int:
        # a request's prompt + max_tokens: at most a slot's positions, and what the paged KV cache can give one row
        context = engine.request_tokens
        flag = "--max_seq_length" if context == engine.max_seq_length else "--kv_cache_tokens"
        room = context - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but this server's context is"
                                f" {context} ({flag}): shorten it", prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(400, f"{param}={max_tokens} with a prompt of {len(prompt_ids)} tokens exceeds this"
                                f" server's context of {context} tokens ({flag}): set {param} <= {room}", param,
                           code="context_length_exceeded")
        return max_tokens

    def stops_of(body: _Common) -> List[str]:
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", "stop")
        return stops

    def jobs_for(body: _Common, prompts: List[List[int]], max_tokens: List[int], adapter: int) -> List[List[Job]]:
        stops = stops_of(body)
        logprobs = getattr(body, "logprobs", None)
        echo_scores = bool(getattr(body, "echo", False)) and logprobs is not None
        on_host = bool(engine.runtime.compiles_graphs)
        out = []
        for p, (ids, limit) in enumerate(zip(prompts, max_tokens)):
            choices = []
            for i in range(body.n):
                seed = None if body.seed is None else body.seed + p * body.n + i
                sampling = RowSampling(body.temperature, body.top_p,
                                       new_generator(seed, engine.runtime.device, on_host) if body.temperature > 0
                                       else None)
                choices.append(Job(ids, limit, emit=lambda *a: None, sampling=sampling, stop_ids=stop_ids,
                                   stop_strings=stops, logprobs=logprobs, echo_scores=echo_scores, adapter=adapter))
            out.append(choices)
        return out

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        adapter = check_common(body)
        messages = []
        for i, m in enumerate(body.messages):
            if m.role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"messages[{i}].role {m.role!r} is not supported (system, user, assistant)",
                               f"messages.{i}.role")
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages.{i}")
                content = "".join(str(part.get("text", "")) for part in content)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        try:
            if hasattr(style, "render"):
                text = style.render(messages)
            else:
                *history, last = messages
                system = next((m["content"] for m in history if m["role"] == "system"), None)
                text = style.apply(last["content"], history=[(m["role"], m["content"]) for m in history
                                                             if m["role"] != "system"], system=system)
        except LitError as e:
            raise APIError(400, str(e), "messages")
        ids = encode(text, style.bos)
        limit = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        jobs = jobs_for(body, [ids], [limits(ids, limit, param, "messages")], adapter)
        return await respond(request, body, jobs, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        adapter = check_common(body)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 generates nothing: it scores the prompt with echo (and logprobs); set"
                                " echo, or max_tokens >= 1", "max_tokens")
        if body.stream and (body.logprobs is not None or body.echo):
            raise APIError(400, f"{'logprobs' if body.logprobs is not None else 'echo'} with stream is not supported"
                                " by this server: send the request without stream",
                           "logprobs" if body.logprobs is not None else "echo", code="unsupported_parameter")
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is an empty list", "prompt")
        ids = [encode(p, None) if isinstance(p, str) else token_ids(p) for p in prompt]
        texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=True) for p in prompt]
        jobs = jobs_for(body, ids, [limits(i, body.max_tokens, "max_tokens", "prompt") for i in ids], adapter)
        return await respond(request, body, jobs, chat=False, prompt_texts=texts)

    async def respond(request: Request, body: _Common, per_prompt: List[List[Job]], chat: bool,
                      prompt_texts: Optional[List[str]] = None) -> Any:
        loop = asyncio.get_running_loop()
        queue: "asyncio.Queue[Any]" = asyncio.Queue()
        jobs = [job for choices in per_prompt for job in choices]
        def emitter(index: int, job: Job) -> Any:
            held: List[str] = []  # a whole answer's text (not streamed), handed over with its end

            def emit(*event: Any) -> None:  # on the engine's thread
                if not body.stream and event[0] == "text":
                    # one wake-up of this loop per answer, not per token: on a small CPU each wake-up takes a core
                    # (and the GIL) from the decode step that every row in flight waits for
                    held.append(event[1])
                    return
                try:
                    if held:
                        loop.call_soon_threadsafe(queue.put_nowait, (index, "text", "".join(held)))
                        held.clear()
                    loop.call_soon_threadsafe(queue.put_nowait, (index, *event))
                except RuntimeError:  # the event loop is closed (the server stopped): nobody is listening
                    job.cancelled = True
            return emit

        for index, job in enumerate(jobs):
            job.emit = emitter(index, job)
        most = engine.slots + engine.max_queue
        if len(jobs) > most:  # never fits, however long the client waits: a bad request, not "retry later"
            raise APIError(400, f"this request asks for {len(jobs)} completions ({len(per_prompt)} prompt(s) x n"
                                f" {body.n}) but this server holds at most {most} at once ({engine.slots} slots +"
                                f" --max_queue {engine.max_queue}): send fewer prompts or a smaller n",
                           "n" if len(per_prompt) == 1 else "prompt")
        try:
            engine.submit(jobs)
        except QueueFull as e:
            raise APIError(429, str(e), kind="server_overloaded", code="queue_full")
        metrics.requests.labels("chat" if chat else "completions").inc()
        prompt_tokens = sum(len(choices[0].prompt_ids) for choices in per_prompt)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": int(time.time()), "model": body.model}  # the base model's name or an adapter's

        def usage(completion: int) -> Dict[str, int]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

        def cancel() -> None:
            for job in jobs:
                job.cancelled = True

        if body.stream:
            return EventSourceResponse(stream(queue, jobs, chat, {**base, "object": kind + ("" if not chat else ".chunk")},
                                              usage, body, cancel), ping=15)
        texts = [""] * len(jobs)
        reasons: List[Optional[str]] = [None] * len(jobs)
        completion = 0
        try:
            while any(r is None for r in reasons):
                try:
                    index, what, *rest = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        cancel()
                        return None
                    continue
                if what == "text":
                    texts[index] += rest[0]
                else:
                    reasons[index] = rest[0]
                    completion += rest[1]
        except asyncio.CancelledError:
            cancel()
            raise
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r,
                        "logprobs": None} for i, (t, r) in enumerate(zip(texts, reasons))]
        else:
            echo, logprobs = getattr(body, "echo", False), getattr(body, "logprobs", None)
            prompt_of = [prompt_texts[p] for p, choices_ in enumerate(per_prompt) for _ in choices_] if prompt_texts \
                else [""] * len(jobs)
            choices = [{"index": i, "text": (prompt_of[i] if echo else "") + t, "finish_reason": r,
                        "logprobs": logprobs_object(jobs[i], logprobs, prompt_of[i] if echo else None, t)
                        if logprobs is not None else None}
                       for i, (t, r) in enumerate(zip(texts, reasons))]
        return {**base, "object": kind, "choices": choices, "usage": usage(completion)}

    async def stream(queue: "asyncio.Queue[Any]", jobs: List[Job], chat: bool, base: Dict[str, Any], usage: Any,
                     body: _Common, cancel: Any) -> AsyncIterator[Dict[str, str]]:
        import json

        def chunk(index: int, text: Optional[str], reason: Optional[str], role: bool = False,
                  extra: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
            if chat:
                delta: Dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": text} if text is not None else {})
                choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
            return {"data": json.dumps({**base, "choices": [choice], **(extra or {})})}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        left, completion = len(jobs), 0
        try:
            if chat:
                for index in range(len(jobs)):
                    yield chunk(index, None, None, role=True)
            while left:
                index, what, *rest = await queue.get()
                if what == "text":
                    yield chunk(index, rest[0], None)
                    continue
                left -= 1
                completion += rest[1]
                # usage on the chunk that ends the last choice: every response reports it
                yield chunk(index, None if chat else "", rest[0], extra={"usage": usage(completion)} if not left else None)
            if include_usage:
                yield {"data": json.dumps({**base, "choices": [], "usage": usage(completion)})}
            yield {"data": "[DONE]"}
        finally:
            if left:  # the client went away (the stream was cancelled): free the slots
                cancel()

    return app
