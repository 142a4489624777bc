"""Serving throughput: serve/base.py (continuous batching) under concurrent OpenAI-client load, against one request
at a time on the same server, and against transformers' batched `generate` on the same prompts, in one run (CPU):

    python bench/serve.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --results_file bench/results/serve_cpu.json

The server is the real one: `python serve/base.py --port 0 ...` in a subprocess (its "Serving ... on
http://HOST:PORT/v1" line gives the port), driven by the `openai` package's `AsyncOpenAI` client from this process.
Every phase sends the same `--requests` completion requests ("Once upon a time, there was a WORD who", a different
WORD each, greedy, `max_tokens` = `--max_tokens`; such prompts run to max_tokens rather than stopping early):

* `sequential`: one request at a time, `stream: false` (the baseline: a server that answers one request at a time);
* concurrency N (`--concurrency`, default 1, 4, 8, 16): N clients at once, each sending its next request when its
  last one ended, `stream: true`. Time to first token (TTFT) = from sending a request to its first non-empty text
  chunk: median and 90th percentile. With more clients than `--slots` the rest queue (their TTFT shows it).

Tokens/s = the completion tokens the server reported (`usage`) over the wall time of the phase. After the server
phases the server gets SIGINT (it drains and exits 0), then the reference runs in this process: transformers'
`AutoModelForCausalLM` on the checkpoint's transformers export (`lit_gpt.convert.convert_lit_checkpoint` into a
temporary folder, or `--hf_dir`), the same prompt token ids left-padded in batches of N (one untimed warm-up call per
batch size), greedy, `max_new_tokens` = `--max_tokens`, float32, on the CPU. Both sides use `--threads` threads
(OMP_NUM_THREADS for the server, `torch.set_num_threads` here). Stored per level: tokens/s, the ratio to
sequential, TTFT median / p90, the transformers tokens/s at batch size N and our ratio to it, and how many greedy
answers equal the sequential ones and transformers' (the same text: batching changes nothing).

Many LoRAs (`--multi_lora`): a server with `--lora_adapters` LoRA files (random A and B of rank `--lora_rank` on
every layer a LoRA adapts, written with the project's export for this base) answers the same `--requests` greedy
completions, `--slots` at a time, three ways: all for the base model, all for one adapter, and spread over all the
adapters (request i for adapter i mod N), so that every decode step gathers N adapters' matrices: tokens/s of each,
and the N-adapter batch's against the one-adapter batch's.

The client runs in this process on the same cores as the server: on a small machine its share of the CPU counts
against the server (as it would for a client on the same host).
"""

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("dragon", "baker", "robot", "princess", "farmer", "wizard", "sailor", "painter", "knight", "fox", "doctor",
         "giant", "teacher", "pirate", "gardener", "mouse", "king", "musician", "owl", "tailor", "dancer", "hunter",
         "poet", "miller", "rabbit", "queen", "soldier", "fisherman", "witch", "clockmaker", "bear", "shepherd")
SERVING = re.compile(r"Serving .* on (http://\S+/v1)")


def prompts_for(n: int) -> List[str]:
    return [f"Once upon a time, there was a {WORDS[i % len(WORDS)]}{'' if i < len(WORDS) else f' number {i}'} who"
            for i in range(n)]


def percentile(values: List[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between the sorted values."""
    s = sorted(values)
    x = q * (len(s) - 1)
    lo = int(x)
    return s[lo] if lo + 1 >= len(s) else s[lo] + (s[lo + 1] - s[lo]) * (x - lo)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------------
class Server:
    """serve/base.py in a subprocess; its stderr lines are kept (and shown with a prefix)."""

    def __init__(self, argv: List[str], threads: int, timeout: float) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.command = "python " + " ".join(argv)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: List[str] = []
        self.url: Optional[str] = None
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                line = line.rstrip("\n")
                self.lines.append(line)
                log(f"[server] {line}")
                m = SERVING.search(line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()
            found.set()  # the process ended

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not found.wait(timeout) or self.url is None:
            self.proc.kill()
            self.proc.wait()
            tail = "\n".join(self.lines[-20:])
            raise LitError(f"serve/base.py did not start serving within {timeout:.0f} s (exit {self.proc.returncode}):"
                           f" {tail[-2000:]}")
        self.start_s = time.perf_counter() - t0

    def line(self, prefix: str) -> Optional[str]:
        return next((x for x in self.lines if x.startswith(prefix)), None)

    def stop(self, timeout: float = 120) -> int:
        """SIGINT (what Ctrl-C sends): the server drains and exits; its exit status."""
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise LitError(f"serve/base.py did not exit within {timeout:.0f} s of SIGINT")
        self.reader.join(5)
        return code


# ---------------------------------------------------------------------------------------------------------------
# the client side
# ---------------------------------------------------------------------------------------------------------------
async def one_request(client: Any, model: str, prompt: str, max_tokens: int, stream: bool) -> Dict[str, Any]:
    t0 = time.perf_counter()
    if not stream:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        return {"text": r.choices[0].text, "tokens": r.usage.completion_tokens, "ttft_s": None,
                "seconds": time.perf_counter() - t0, "finish_reason": r.choices[0].finish_reason}
    text, ttft, tokens, reason = "", None, None, None
    chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True)
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += chunk.choices[0].text
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    if tokens is None:
        raise LitError("the server's stream carried no usage")
    return {"text": text, "tokens": tokens, "ttft_s": ttft, "seconds": time.perf_counter() - t0,
            "finish_reason": reason}


async def run_level(url: str, model: str, prompts: List[str], max_tokens: int, concurrency: Optional[int],
                    warm_up: int) -> Dict[str, Any]:
    """All prompts, `concurrency` at a time (None: one at a time, not streamed). Returns the phase's measurements
    and the answers in prompt order."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600) as client:
        stream = concurrency is not None
        width = concurrency or 1
        if warm_up:
            await asyncio.gather(*(one_request(client, model, p, 4, stream) for p in prompts[: min(warm_up, width)]))
        out: List[Optional[Dict[str, Any]]] = [None] * len(prompts)
        todo = iter(range(len(prompts)))

        async def worker() -> None:
            for i in todo:  # one shared iterator: each worker takes the next prompt when its request ended
                out[i] = await one_request(client, model, prompts[i], max_tokens, stream)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(width)))
        seconds = time.perf_counter() - t0
    done: List[Dict[str, Any]] = [r for r in out if r is not None]
    tokens = sum(r["tokens"] for r in done)
    result = {"concurrency": concurrency, "requests": len(done), "completion_tokens": tokens, "seconds": seconds,
              "tokens_per_s": tokens / seconds, "latency_median_s": statistics.median(r["seconds"] for r in done),
              "full_length": sum(r["finish_reason"] == "length" for r in done)}
    if stream:
        ttfts = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
        result.update(ttft_median_s=statistics.median(ttfts), ttft_p90_s=percentile(ttfts, 0.9))
    result["texts"] = [r["text"] for r in done]
    return result


# ---------------------------------------------------------------------------------------------------------------
# the reference: transformers' batched generate
# ---------------------------------------------------------------------------------------------------------------
def transformers_reference(hf_dir: Path, prompt_ids: List[List[int]], max_tokens: int, batch_sizes: List[int],
                           pad_id: int, stop_ids: List[int], decode: Any) -> List[Dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()

    def generate(rows: List[List[int]], new_tokens: int) -> List[List[int]]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=None,
                                 do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                                 eos_token_id=stop_ids)
        answers = []
        for row in out[:, width:].tolist():
            cut = next((k for k, t in enumerate(row) if t in stop_ids), len(row))
            answers.append(row[:cut])
        return answers

    results = []
    for b in batch_sizes:
        generate(prompt_ids[:b], 4)  # warm-up: this batch size's first call
        t0 = time.perf_counter()
        answers: List[List[int]] = []
        for start in range(0, len(prompt_ids), b):
            answers += generate(prompt_ids[start: start + b], max_tokens)
        seconds = time.perf_counter() - t0
        tokens = sum(len(a) for a in answers)
        results.append({"batch_size": b, "completion_tokens": tokens, "seconds": seconds,
                        "tokens_per_s": tokens / seconds, "texts": [decode(a) for a in answers]})
        log(f"transformers generate, batch {b:>2}: {tokens / seconds:7.1f} tokens/s ({tokens} tokens in"
            f" {seconds:.1f} s)")
    return results


# ---------------------------------------------------------------------------------------------------------------
# scheduling: the long-prompt burst, the shared prefix, sampled chat (on the server with today's flags and on the
# default one)
# ---------------------------------------------------------------------------------------------------------------
def text_of_tokens(tokenizer: Any, n: int, seed: int) -> List[int]:
    """`n` token ids of plain English-like text, different from the first token for each seed."""
    import random

    rnd = random.Random(seed)
    words = [f"Record {seed}:"] + [rnd.choice(WORDS) for _ in range(2 * n)]
    ids = tokenizer.encode(" ".join(words)).tolist()
    if len(ids) < n:
        raise LitError(f"could not build a prompt of {n} tokens")
    return ids[:n]


def health(url: str) -> Dict[str, Any]:
    import httpx

    return httpx.get(url.rsplit("/v1", 1)[0] + "/health", timeout=30).json()


async def timed_stream(client: Any, model: str, prompt: Any, max_tokens: int,
                       times: Optional[List[float]] = None) -> Dict[str, Any]:
    """A greedy streamed completion: its text, tokens and the arrival time (perf_counter) of every text chunk (kept
    in `times` as they arrive)."""
    times, text, tokens = [] if times is None else times, "", None
    chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True)
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            text += chunk.choices[0].text
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    return {"times": times, "text": text, "tokens": tokens}


async def burst_phase(url: str, model: str, short_prompts: List[str], long_prompts: List[List[int]],
                      short_tokens: int, long_tokens: int, burst: bool, after: int) -> Dict[str, Any]:
    """The short streams (greedy, streamed) alone, or with the long prompts sent once every stream has `after`
    tokens. Inter-token times of the short streams: all of them, and those that end inside the burst (from its
    sending to the last long prompt's first token)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600) as client:
        await one_request(client, model, short_prompts[0], 2, False)  # warm
        t0 = time.perf_counter()
        live: List[List[float]] = [[] for _ in short_prompts]
        shorts = [asyncio.ensure_future(timed_stream(client, model, p, short_tokens, t))
                  for p, t in zip(short_prompts, live)]
        longs: List[Any] = []
        sent = None
        if burst:
            started = time.perf_counter()
            while True:  # every short stream has its first tokens: they are decoding
                await asyncio.sleep(0.01)
                if all(s.done() for s in shorts) or time.perf_counter() - started > 600:
                    break
                if min(len(t) for t in live) >= after:
                    break
            sent = time.perf_counter()
            longs = [asyncio.ensure_future(timed_stream(client, model, p, long_tokens)) for p in long_prompts]
        done_short = await asyncio.gather(*shorts)
        done_long = await asyncio.gather(*longs)
        seconds = time.perf_counter() - t0
    gaps, in_burst = [], []
    end = max((r["times"][0] for r in done_long if r["times"]), default=None)
    for r in done_short:
        for a, b in zip(r["times"], r["times"][1:]):
            gaps.append(b - a)
            if sent is not None and end is not None and sent < b <= end:
                in_burst.append(b - a)
    tokens = sum(r["tokens"] for r in done_short + done_long)
    out = {"seconds": seconds, "completion_tokens": tokens, "tokens_per_s": tokens / seconds,
           "itl_p50_s": percentile(gaps, 0.5), "itl_p90_s": percentile(gaps, 0.9),
           "short_texts": [r["text"] for r in done_short], "long_texts": [r["text"] for r in done_long]}
    if burst:
        out.update(burst_s=None if end is None else end - sent, itl_in_burst=len(in_burst),
                   itl_in_burst_p50_s=percentile(in_burst, 0.5) if in_burst else None,
                   itl_in_burst_p90_s=percentile(in_burst, 0.9) if in_burst else None,
                   itl_in_burst_max_s=max(in_burst) if in_burst else None)
    return out


async def prefix_phase(url: str, model: str, system: str, questions: List[str], max_tokens: int,
                       concurrency: int) -> Dict[str, Any]:
    """Chat requests sharing a long system prompt, `concurrency` at a time, greedy: the server's prefill counters
    before and after."""
    from openai import AsyncOpenAI

    before = health(url)
    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600) as client:
        todo = iter(range(len(questions)))
        out: List[Any] = [None] * len(questions)

        async def worker() -> None:
            for i in todo:
                r = await client.chat.completions.create(
                    model=model, messages=[{"role": "system", "content": system},
                                           {"role": "user", "content": questions[i]}],
                    max_tokens=max_tokens, temperature=0.0)
                out[i] = (r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    after = health(url)
    return {"seconds": seconds, "texts": [o[0] for o in out], "prompt_tokens": sum(o[1] for o in out),
            "prompt_tokens_each": sorted({o[1] for o in out}),
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "cached_tokens": after["cached_prompt_tokens"] - before["cached_prompt_tokens"]}


async def chat_phase(url: str, model: str, questions: List[str], max_tokens: int, concurrency: Optional[int],
                     temperature: float) -> Dict[str, Any]:
    """Sampled chat requests (seeded: the same tokens however they are batched), one at a time (None) or
    `concurrency` at a time, not streamed."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600) as client:
        async def ask(i: int, tokens: int = max_tokens) -> Tuple[str, int]:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": questions[i]}], max_tokens=tokens,
                temperature=temperature, seed=i)
            return r.choices[0].message.content, r.usage.completion_tokens

        await ask(0, 2)  # warm (2 tokens: a whole answer one at a time is seconds of nothing measured)
        todo = iter(range(len(questions)))
        out: List[Any] = [None] * len(questions)

        async def worker() -> None:
            for i in todo:
                out[i] = await ask(i)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        seconds = time.perf_counter() - t0
    tokens = sum(o[1] for o in out)
    return {"concurrency": concurrency, "seconds": seconds, "completion_tokens": tokens,
            "tokens_per_s": tokens / seconds, "texts": [o[0] for o in out]}


def scheduling(checkpoint_dir: Path, tokenizer: Any, threads: int, startup_timeout: float, slots: int,
               burst_tokens: int, short_tokens: int, chat_requests: int, chat_tokens: int,
               system_tokens: int, prefix_requests: int, which: List[str]) -> Dict[str, Any]:
    """The three scenarios on two servers: the server before chunked prefill (`--prefill_chunk 0 --prefix_cache false
    --prefill_with_decode false`: whole prompts, each a prefill call of its own,
    nothing shared) and the defaults."""
    short_prompts = prompts_for(4)
    long_prompts = [text_of_tokens(tokenizer, burst_tokens, seed) for seed in range(4)]
    system = tokenizer.decode(text_of_tokens(tokenizer, system_tokens, 100))
    questions = [f"Question {i}: what is the {WORDS[i % len(WORDS)]} doing?" for i in range(prefix_requests)]
    chat_questions = [f"Tell me a short story about a {WORDS[i % len(WORDS)]}." for i in range(chat_requests)]
    # the longest prompt (a long one, or the system prompt and a question) and its answer
    length = max(burst_tokens, system_tokens + 100) + 64
    servers = {"whole": ("whole prompts, no prefix cache", ["--prefill_chunk", "0", "--prefix_cache", "false",
                                                          "--prefill_with_decode", "false"]),
               "default": ("defaults (chunked prefill, prefix cache)", [])}
    out: Dict[str, Any] = {}
    for name, flags in (servers[w] for w in which):
        argv = ["serve/base.py", "--checkpoint_dir", str(checkpoint_dir), "--accelerator", "cpu", "--precision",
                "32-true", "--port", "0", "--slots", str(slots), "--max_seq_length", str(length), *flags]
        log(f"[{name}] starting: python {' '.join(argv)}")
        t0 = time.perf_counter()
        server = Server(argv, threads, startup_timeout)
        model = checkpoint_dir.name
        r: Dict[str, Any] = {"command": server.command, "start_s": server.start_s}
        try:
            r["alone"] = asyncio.run(burst_phase(server.url, model, short_prompts, long_prompts, short_tokens, 16,
                                                 False, 0))
            log(f"[{name}] 4 short streams alone: ITL p90 {r['alone']['itl_p90_s'] * 1000:.0f} ms,"
                f" {r['alone']['tokens_per_s']:.1f} tokens/s")
            r["burst"] = asyncio.run(burst_phase(server.url, model, short_prompts, long_prompts, short_tokens, 16,
                                                 True, 4))
            b = r["burst"]
            b["itl_in_burst_x_alone"] = (None if b["itl_in_burst_p90_s"] is None
                                         else b["itl_in_burst_p90_s"] / r["alone"]["itl_p90_s"])
            log(f"[{name}] with the burst: ITL p90 in the burst {b['itl_in_burst_p90_s']} s"
                f" (x{b['itl_in_burst_x_alone']}), {b['tokens_per_s']:.1f} tokens/s, burst {b['burst_s']} s")
            r["prefix"] = asyncio.run(prefix_phase(server.url, model, system, questions, 8, slots))
            log(f"[{name}] shared prefix: {r['prefix']['prefill_tokens']} tokens prefilled,"
                f" {r['prefix']['cached_tokens']} reused, {r['prefix']['seconds']:.1f} s")
            r["chat_sequential"] = asyncio.run(chat_phase(server.url, model, chat_questions, chat_tokens, None, 0.8))
            r["chat_batched"] = asyncio.run(chat_phase(server.url, model, chat_questions, chat_tokens, slots, 0.8))
            r["chat_x_sequential"] = r["chat_batched"]["tokens_per_s"] / r["chat_sequential"]["tokens_per_s"]
            log(f"[{name}] sampled chat: {r['chat_sequential']['tokens_per_s']:.1f} tokens/s one at a time,"
                f" {r['chat_batched']['tokens_per_s']:.1f} at {slots} in flight (x{r['chat_x_sequential']:.2f})")
        finally:
            r["exit_code"] = server.stop()
        r["seconds"] = time.perf_counter() - t0  # the server's whole life: what this server's rows cost
        log(f"[{name}] {r['seconds']:.0f} s in all (start {server.start_s:.0f} s)")
        out[name] = r
    if len(out) != 2:
        return out
    old, new = out.values()
    out["burst_throughput_x_whole_prompts"] = new["burst"]["tokens_per_s"] / old["burst"]["tokens_per_s"]
    out["prefix_fewer_prefill_tokens_x"] = old["prefix"]["prefill_tokens"] / max(1, new["prefix"]["prefill_tokens"])
    out["prefix_same_texts"] = sum(a == b for a, b in zip(old["prefix"]["texts"], new["prefix"]["texts"]))
    out["burst_same_texts"] = (old["burst"]["short_texts"] + old["burst"]["long_texts"]
                               == new["burst"]["short_texts"] + new["burst"]["long_texts"])
    out["chat_same_texts"] = sum(a == b for a, b in zip(new["chat_sequential"]["texts"], new["chat_batched"]["texts"]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# many LoRAs on one base: one adapter per batch against several
# ---------------------------------------------------------------------------------------------------------------
def random_loras(checkpoint_dir: Path, out: Path, n: int, rank: int) -> List[Path]:
    """`n` LoRA files of this base (every layer a LoRA adapts, random A and B), written by lit_gpt.peft's export."""
    import torch

    from lit_gpt import lora
    from lit_gpt.fingerprint import base_record
    from lit_gpt.peft import export_finetuned, variant_fields

    config = lora.Config.from_checkpoint(checkpoint_dir, lora_r=rank, lora_alpha=2 * rank, lora_query=True,
                                         lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in lora.GPT(config).state_dict().items() if lora.lora_filter(k)}
    base, paths = base_record(checkpoint_dir), []
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        state = {k: 0.5 * torch.randn(shape, generator=gen) / shape[-1] ** 0.5 for k, shape in shapes.items()}
        paths.append(export_finetuned(state, out / f"lora{i}", "lora", variant_fields(config), base=base))
    return paths


async def adapters_phase(url: str, models: List[str], prompts: List[str], max_tokens: int,
                         concurrency: int) -> Dict[str, Any]:
    """The prompts, `concurrency` at a time, request i for `models[i % len(models)]` (greedy, not streamed)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600) as client:
        await asyncio.gather(*(one_request(client, m, prompts[0], 2, False) for m in sorted(set(models))))  # warm
        todo = iter(range(len(prompts)))
        out: List[Any] = [None] * len(prompts)

        async def worker() -> None:
            for i in todo:
                out[i] = await one_request(client, models[i % len(models)], prompts[i], max_tokens, False)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in out)
    return {"models": len(set(models)), "seconds": seconds, "completion_tokens": tokens,
            "tokens_per_s": tokens / seconds}


def multi_lora(checkpoint_dir: Path, threads: int, startup_timeout: float, slots: int, requests: int,
               max_tokens: int, max_seq_length: int, adapters: int, rank: int) -> Dict[str, Any]:
    """One server with `adapters` LoRA files: the requests for the base, for one adapter, and for all of them."""
    prompts = prompts_for(requests)
    with tempfile.TemporaryDirectory() as tmp:
        files = random_loras(checkpoint_dir, Path(tmp), adapters, rank)
        names = [f"lora{i}" for i in range(adapters)]
        argv = ["serve/base.py", "--checkpoint_dir", str(checkpoint_dir), "--accelerator", "cpu", "--precision",
                "32-true", "--port", "0", "--slots", str(slots), "--max_seq_length", str(max_seq_length),
                *[a for name, path in zip(names, files) for a in ("--lora", f"{name}={path}")]]
        log(f"[multi-LoRA] starting: python {' '.join(argv)}")
        t0 = time.perf_counter()
        server = Server(argv, threads, startup_timeout)
        out: Dict[str, Any] = {"command": server.command, "adapters": adapters, "rank": rank, "start_s": server.start_s}
        try:
            for key, models in (("base", [checkpoint_dir.name]), ("one_adapter", names[:1]), ("all_adapters", names)):
                out[key] = asyncio.run(adapters_phase(server.url, models, prompts, max_tokens, slots))
                log(f"[multi-LoRA] {key}: {out[key]['tokens_per_s']:.1f} tokens/s ({out[key]['models']} model(s),"
                    f" {slots} in flight)")
        finally:
            out["exit_code"] = server.stop()
        out["seconds"] = time.perf_counter() - t0
    out["all_adapters_x_one_adapter"] = out["all_adapters"]["tokens_per_s"] / out["one_adapter"]["tokens_per_s"]
    out["one_adapter_x_base"] = out["one_adapter"]["tokens_per_s"] / out["base"]["tokens_per_s"]
    log(f"[multi-LoRA] {adapters} adapters in one batch: x{out['all_adapters_x_one_adapter']:.2f} the tokens/s of one"
        f" adapter (one adapter: x{out['one_adapter_x_base']:.2f} the base model's)")
    return out


# ---------------------------------------------------------------------------------------------------------------
def main(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    hf_dir: Optional[Path] = None,
    concurrency: List[int] = [1, 4, 8, 16],
    requests: int = 16,
    max_tokens: int = 32,
    slots: int = 16,
    max_seq_length: int = 256,
    threads: Optional[int] = None,
    startup_timeout: float = 600,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
    throughput: bool = True,
    scenarios: bool = True,
    scenario_slots: int = 8,
    burst_tokens: int = 2000,
    short_tokens: int = 256,
    chat_requests: int = 8,
    chat_tokens: int = 64,
    system_tokens: int = 1000,
    prefix_requests: int = 16,
    scenario_servers: List[str] = ["whole", "default"],
    multi_lora_row: bool = True,
    lora_adapters: int = 4,
    lora_rank: int = 8,
) -> Dict[str, Any]:
    """Tokens/s and time to first token of serve/base.py at several concurrency levels, against one request at a
    time and against transformers' batched generate on the same prompts (CPU, fp32).

    Args:
        checkpoint_dir: The model served (a converted checkpoint folder).
        hf_dir: Its transformers export for the reference (default: converted into a temporary folder).
        concurrency: Concurrent clients per level; transformers runs the same numbers as batch sizes.
        requests: Completion requests per level (the same prompts at every level).
        max_tokens: Tokens per answer (greedy; the prompts run to it).
        slots: The server's --slots (requests decoded together; more clients than slots queue).
        max_seq_length: The server's --max_seq_length (longest prompt + max_tokens must fit).
        threads: CPU threads of the server and of transformers (default: the usable cores).
        startup_timeout: Seconds to wait for the server to load and warm up.
        results_file: Also write the results to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
        throughput: Run the concurrency levels and transformers' reference (above).
        scenarios: Run the scheduling scenarios (`scheduling`) on two more servers (`--slots scenario_slots`):
            the server before chunked prefill (`--prefill_chunk 0 --prefix_cache false --prefill_with_decode
            false`) and the defaults. The long-prompt burst: 4
            short greedy streams of `short_tokens` tokens, alone and then with 4 prompts of `burst_tokens` tokens
            (16 new tokens each) sent once every stream has 4 tokens: the streams' inter-token time p90 during the
            burst (from sending it to the last long prompt's first token) against alone, and the tokens/s of the
            whole run. The shared prefix: `prefix_requests` greedy chat requests (8 new tokens) with one system
            prompt of `system_tokens` tokens, `scenario_slots` at a time: prompt tokens computed (the server's
            /health counters) and the answers. Sampled chat: `chat_requests` chat requests (temperature 0.8,
            seed = their index, `chat_tokens` tokens, not streamed) one at a time and all at once.
        scenario_slots: --slots of the scenarios' servers.
        burst_tokens: Tokens of each long prompt of the burst.
        short_tokens: Tokens of each short stream of the burst.
        chat_requests: Requests of the sampled-chat scenario.
        chat_tokens: max_tokens of the sampled-chat scenario.
        system_tokens: Tokens of the shared system prompt.
        prefix_requests: Requests of the shared-prefix scenario.
        scenario_servers: The scenarios' servers: "whole" (today's flags) and/or "default".
        multi_lora_row: Run the many-LoRAs row (`multi_lora`): a server with `lora_adapters` LoRA files answers
            `requests` greedy completions of `max_tokens` tokens, `slots` at a time, all for the base model, all
            for one adapter, and spread over every adapter: tokens/s, and all adapters' against one adapter's.
        lora_adapters: Adapters of the many-LoRAs row.
        lora_rank: Their rank (every layer a LoRA adapts).
    """
    import torch

    from lit_gpt.tokenizer import Tokenizer

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "lit_config.json").is_file():
        raise LitError(f"{checkpoint_dir} is not a converted checkpoint folder (no lit_config.json): pass"
                       " --checkpoint_dir, e.g. checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")
    if requests < 1 or max_tokens < 1 or not concurrency or min(concurrency) < 1:
        raise LitError("--requests, --max_tokens and every --concurrency must be >= 1")
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    tokenizer = Tokenizer(checkpoint_dir)
    prompts = prompts_for(requests)
    prompt_ids = [tokenizer.encode(p).tolist() for p in prompts]  # as the server encodes a completion prompt
    longest = max(len(p) for p in prompt_ids)
    if longest + max_tokens > max_seq_length:
        raise LitError(f"the longest prompt ({longest} tokens) + --max_tokens {max_tokens} is over --max_seq_length"
                       f" {max_seq_length}: raise --max_seq_length")

    settings = {"checkpoint": "/".join(checkpoint_dir.parts[-2:]), "device": "cpu", "dtype": "float32",
                "threads": threads}
    if scenarios:
        settings.update(scenario_slots=scenario_slots, burst_tokens=burst_tokens, short_tokens=short_tokens,
                        chat_requests=chat_requests, chat_tokens=chat_tokens, chat_temperature=0.8,
                        system_tokens=system_tokens, prefix_requests=prefix_requests)
    if multi_lora_row:
        settings.update(lora_adapters=lora_adapters, lora_rank=lora_rank, slots=slots, requests=requests,
                        max_tokens=max_tokens)  # the many-LoRAs row's load (also without the throughput levels)

    def more_rows(results: Dict[str, Any]) -> Dict[str, Any]:
        """The scheduling scenarios and the many-LoRAs row, each where asked for."""
        t0 = time.perf_counter()
        if scenarios:
            results["scheduling"] = scheduling(checkpoint_dir, tokenizer, threads, startup_timeout, scenario_slots,
                                               burst_tokens, short_tokens, chat_requests, chat_tokens, system_tokens,
                                               prefix_requests, scenario_servers)
        if multi_lora_row:
            results["multi_lora"] = multi_lora(checkpoint_dir, threads, startup_timeout, slots, requests, max_tokens,
                                               max_seq_length, lora_adapters, lora_rank)
        results["more_rows_seconds"] = time.perf_counter() - t0
        log(f"scenarios and many-LoRAs row: {results['more_rows_seconds']:.0f} s")
        return results

    if not throughput:
        results = more_rows({})
        result_files.write(results_file, "serve", settings, results, note)
        return results

    argv = ["serve/base.py", "--checkpoint_dir", str(checkpoint_dir), "--accelerator", "cpu", "--precision",
            "32-true", "--port", "0", "--slots", str(slots), "--max_seq_length", str(max_seq_length)]
    log(f"starting the server: python {' '.join(argv)} (OMP_NUM_THREADS={threads})")
    server = Server(argv, threads, startup_timeout)
    model = checkpoint_dir.name
    levels: List[Dict[str, Any]] = []
    try:
        log(f"server up in {server.start_s:.1f} s at {server.url}")
        sequential = asyncio.run(run_level(server.url, model, prompts, max_tokens, None, warm_up=1))
        log(f"sequential:     {sequential['tokens_per_s']:7.1f} tokens/s ({sequential['completion_tokens']} tokens in"
            f" {sequential['seconds']:.1f} s)")
        for c in concurrency:
            r = asyncio.run(run_level(server.url, model, prompts, max_tokens, c, warm_up=c))
            r["x_sequential"] = r["tokens_per_s"] / sequential["tokens_per_s"]
            r["same_text_as_sequential"] = sum(a == b for a, b in zip(r["texts"], sequential["texts"]))
            levels.append(r)
            log(f"concurrency {c:>2}: {r['tokens_per_s']:7.1f} tokens/s = {r['x_sequential']:.2f}x sequential, TTFT"
                f" median {r['ttft_median_s'] * 1000:.0f} ms, p90 {r['ttft_p90_s'] * 1000:.0f} ms;"
                f" {r['same_text_as_sequential']}/{r['requests']} answers equal to sequential")
    finally:
        exit_code = server.stop()
    log(f"server stopped (exit {exit_code})")

    tmp = tempfile.TemporaryDirectory() if hf_dir is None else None
    try:
        if tmp is not None:
            from lit_gpt.convert import convert_lit_checkpoint

            hf_dir = convert_lit_checkpoint(checkpoint_dir, Path(tmp.name) / "hf")
        stop_ids = sorted(set(tokenizer.stop_ids))
        pad_id = stop_ids[0] if stop_ids else 0
        reference = transformers_reference(Path(hf_dir), prompt_ids, max_tokens, concurrency, pad_id, stop_ids,
                                           lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    finally:
        if tmp is not None:
            tmp.cleanup()

    for r, ref in zip(levels, reference):
        r["transformers_batch_size"] = ref["batch_size"]
        r["transformers_tokens_per_s"] = ref["tokens_per_s"]
        r["x_transformers"] = r["tokens_per_s"] / ref["tokens_per_s"]
        ref["same_text_as_server"] = sum(a == b for a, b in zip(ref["texts"], sequential["texts"]))
    ref1 = next((ref for ref in reference if ref["batch_size"] == 1), None)
    sequential["x_transformers_batch_1"] = None if ref1 is None else sequential["tokens_per_s"] / ref1["tokens_per_s"]

    print(f"{'':>16} {'tokens/s':>9} {'x seq':>6} {'TTFT med':>9} {'TTFT p90':>9} {'HF batched':>11} {'x HF':>6}")
    print(f"{'sequential':>16} {sequential['tokens_per_s']:9.1f} {1.0:6.2f} {'-':>9} {'-':>9}"
          f" {'' if ref1 is None else format(ref1['tokens_per_s'], '11.1f')}"
          f" {'' if ref1 is None else format(sequential['x_transformers_batch_1'], '6.2f')}")
    for r in levels:
        print(f"{'concurrency ' + str(r['concurrency']):>16} {r['tokens_per_s']:9.1f} {r['x_sequential']:6.2f}"
              f" {r['ttft_median_s'] * 1000:7.0f}ms {r['ttft_p90_s'] * 1000:7.0f}ms"
              f" {r['transformers_tokens_per_s']:11.1f} {r['x_transformers']:6.2f}")

    texts = {"sequential": sequential.pop("texts"), **{f"concurrency_{r['concurrency']}": r.pop("texts") for r in levels},
             **{f"transformers_batch_{ref['batch_size']}": ref.pop("texts") for ref in reference}}
    results = {"sequential": sequential, "levels": levels, "transformers": reference,
               "server": {"start_s": server.start_s, "exit_code": exit_code, "warm_up": server.line("Warm-up:"),
                          "stopped": server.line("Stopped after")},
               "answers": {"prompts": prompts, **texts}}
    more_rows(results)
    settings.update({"slots": slots, "max_seq_length": max_seq_length, "requests": requests,
                "max_tokens": max_tokens, "concurrency": list(concurrency), "prompt_tokens": [min(map(len, prompt_ids)),
                longest], "prompt": "Once upon a time, there was a {word} who", "sampling": "greedy",
                "server_command": server.command, "transformers_padding": "left"})
    result_files.write(results_file, "serve", settings, results, note)
    return results


if __name__ == "__main__":
    run_cli(main)
