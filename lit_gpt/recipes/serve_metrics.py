"""serve/base.py's `GET /metrics`, in Prometheus' text format, with the `prometheus_client` package (the format, the
types and the histogram buckets are its own). Each server has its own registry (not the process-wide default), so
that two applications in one process count apart.

    lit_gpt_requests_total{endpoint}                 HTTP requests accepted by /v1/chat/completions, /v1/completions
    lit_gpt_completions_finished_total{finish_reason}  choices ended: "stop", "length", "cancelled" (client gone)
    lit_gpt_prompt_tokens_total                      prompt tokens of the choices admitted (each choice's prompt)
    lit_gpt_prefill_tokens_total                     prompt tokens computed by prefill calls
    lit_gpt_prefix_cache_hit_tokens_total            prompt tokens reused from the prefix cache (not computed)
    lit_gpt_generation_tokens_total                  tokens generated (what `usage.completion_tokens` counts)
    lit_gpt_queue_depth                              choices waiting for a free slot (past --max_queue: HTTP 429)
    lit_gpt_kv_cache_slots / _slots_in_use           rows of the batched KV cache (--slots) and those in use
    lit_gpt_kv_cache_positions / _positions_in_use   KV positions allocated (the blocks' tokens) and written
    lit_gpt_kv_cache_blocks / _blocks_in_use         blocks of the paged KV cache (--kv_cache_tokens / 16) and those
                                                     rows hold; _blocks_cached: held by nobody, kept for their prefix
    lit_gpt_time_to_first_token_seconds              histogram: a choice's submission to its first token
    lit_gpt_inter_token_latency_seconds              histogram: between a choice's consecutive tokens

The KV cache is paged (lit_gpt/recipes/kv_blocks.py; a model with sliding-window rings is not: its block gauges are
0); the prefix cache's hits are its tokens (prompt = prefill + hit tokens, but for the tokens a cancelled prompt did
not reach).
"""

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a fast GPU step (ms) to a CPU prompt that waits behind others (tens of seconds)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """The counters the engine and the HTTP layer update, and the gauges read from the engine at scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Any) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("lit_gpt_requests", "HTTP completion requests accepted, by endpoint", ["endpoint"],
                                registry=registry)
        self.finished = Counter("lit_gpt_completions_finished", "Choices ended, by finish reason",
                                ["finish_reason"], registry=registry)
        self.prompt_tokens = Counter("lit_gpt_prompt_tokens", "Prompt tokens of the choices admitted",
                                     registry=registry)
        self.prefill_tokens = Counter("lit_gpt_prefill_tokens", "Prompt tokens computed by prefill calls",
                                      registry=registry)
        self.cached_tokens = Counter("lit_gpt_prefix_cache_hit_tokens",
                                     "Prompt tokens reused from the prefix cache (not computed)", registry=registry)
        self.generation_tokens = Counter("lit_gpt_generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram("lit_gpt_time_to_first_token_seconds",
                                             "Seconds from a choice's submission to its first token",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("lit_gpt_inter_token_latency_seconds",
                                             "Seconds between a choice's consecutive tokens",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        Gauge("lit_gpt_queue_depth", "Choices waiting for a free slot", registry=registry).set_function(
            lambda: len(engine.waiting))
        Gauge("lit_gpt_kv_cache_slots", "Rows of the batched KV cache (--slots)", registry=registry).set(engine.slots)
        Gauge("lit_gpt_kv_cache_slots_in_use", "Rows of the KV cache serving a choice", registry=registry).set_function(
            lambda: engine.slots - engine.free_rows())
        blocks = engine.kv_blocks()["kv_blocks"]
        Gauge("lit_gpt_kv_cache_positions", "KV cache positions allocated (the blocks' tokens; unpaged: slots x"
              " --max_seq_length)", registry=registry).set(blocks * engine.kv.block_size if blocks else
                                                              engine.slots * engine.max_seq_length)
        Gauge("lit_gpt_kv_cache_positions_in_use", "KV cache positions written by the choices in flight",
              registry=registry).set_function(engine.positions_in_use)
        for key, what in (("kv_blocks", "Blocks of the paged KV cache"),
                          ("kv_blocks_in_use", "KV cache blocks the choices in flight hold"),
                          ("kv_blocks_cached", "KV cache blocks held by nobody, kept for their prefix (evictable)")):
            Gauge(f"lit_gpt_{key.replace('kv_', 'kv_cache_')}", what, registry=registry).set_function(
                lambda key=key: engine.kv_blocks()[key])

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
