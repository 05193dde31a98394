"""Prometheus metrics: one registry per server (tests run several in one process).

Counters (rate() gives tokens/s), request latency histograms, and gauges read live from the
AsyncLLM and its page pool at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from halfbyte.async_llm import AsyncLLM

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def _prefix_cache_hit_rate(engine: object) -> float:
    """Hit tokens / queried tokens, from the engine's prefix-cache counters when it has them."""
    hits = float(getattr(engine, "prefix_cache_hit_tokens", getattr(engine, "prefix_cache_hits", 0)) or 0)
    queries = float(getattr(engine, "prefix_cache_query_tokens", getattr(engine, "prefix_cache_queries", 0)) or 0)
    return hits / queries if queries > 0 else 0.0


class ServerMetrics:
    def __init__(self, llm: AsyncLLM) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(
            "halfbyte_requests", "HTTP generation requests by endpoint and outcome", ["endpoint", "outcome"], registry=reg
        )
        self.finished = Counter(
            "halfbyte_request_finished", "Generation requests (choices) by finish reason", ["reason"], registry=reg
        )
        self.prompt_tokens = Counter("halfbyte_prompt_tokens", "Prompt tokens admitted", registry=reg)
        self.generation_tokens = Counter("halfbyte_generation_tokens", "Tokens generated", registry=reg)
        self.ttft = Histogram(
            "halfbyte_time_to_first_token_seconds", "Request arrival to its first token", buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "halfbyte_inter_token_latency_seconds", "Time between a request's successive deltas",
            buckets=_LATENCY_BUCKETS, registry=reg,
        )
        pool = llm.engine.pool
        Gauge("halfbyte_requests_in_flight", "Admitted requests not finished", registry=reg).set_function(
            lambda: llm.num_in_flight
        )
        Gauge("halfbyte_queue_depth", "Admitted requests with no token yet", registry=reg).set_function(
            lambda: llm.num_waiting
        )
        Gauge("halfbyte_requests_aborted", "Requests aborted before finishing (cancelled, disconnected)",
              registry=reg).set_function(lambda: llm.num_aborted)
        Gauge("halfbyte_kv_cache_pages_total", "KV-cache pages", registry=reg).set_function(lambda: pool.num_pages)
        Gauge("halfbyte_kv_cache_pages_free", "Free KV-cache pages", registry=reg).set_function(lambda: pool.num_free)
        Gauge("halfbyte_kv_cache_usage_ratio", "Fraction of KV-cache pages in use", registry=reg).set_function(
            lambda: 1.0 - pool.num_free / max(1, pool.num_pages)
        )
        Gauge("halfbyte_prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens", registry=reg).set_function(
            lambda: _prefix_cache_hit_rate(llm.engine)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one choice's deltas: the first one feeds TTFT, later ones inter-token latency."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.last = arrival
        self.seen_first = False

    def on_delta(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.perf_counter()
        (self.metrics.itl if self.seen_first else self.metrics.ttft).observe(now - self.last)
        self.seen_first = True
        self.last = now
        self.metrics.generation_tokens.inc(num_tokens)
