"""Prometheus metrics: one registry per server (tests run several in one process).

Counters (rate() gives tokens/s), request latency histograms, and gauges read live from the
AsyncLLM and its page pool at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from halfbyte.async_llm import AsyncLLM

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def _engine_stat(llm: AsyncLLM, name: str) -> float:
    """A field of the engine's stats snapshot when the engine has stats() (0 otherwise)."""
    return float(getattr(llm.engine_stats, name, 0))


def _stat_reader(llm: AsyncLLM, name: str) -> Callable[[], float]:
    return lambda: _engine_stat(llm, name)


def _prefix_cache_tokens(llm: AsyncLLM) -> tuple[float, float]:
    """(hit, miss) prompt tokens of the prefix cache; (0, 0) without one."""
    if llm.engine_stats is not None:
        return _engine_stat(llm, "prefix_hit_tokens"), _engine_stat(llm, "prefix_miss_tokens")
    stats = getattr(getattr(llm.engine.pool, "prefix", None), "stats", None)  # the pool's own counters
    return float(getattr(stats, "hit_tokens", 0)), float(getattr(stats, "miss_tokens", 0))


def _prefix_cache_hit_rate(llm: AsyncLLM) -> float:
    hits, misses = _prefix_cache_tokens(llm)
    return hits / (hits + misses) if hits + misses > 0 else 0.0


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
            lambda: _prefix_cache_hit_rate(llm)
        )
        Gauge("halfbyte_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache (a counter)",
              registry=reg).set_function(lambda: _prefix_cache_tokens(llm)[0])
        Gauge("halfbyte_prefix_cache_miss_tokens", "Prompt tokens computed (a counter)",
              registry=reg).set_function(lambda: _prefix_cache_tokens(llm)[1])
        for field, doc in (("num_waiting", "Sequences the engine's scheduler has not started"),
                           ("num_running", "Sequences the engine's scheduler is running"),
                           ("num_preemptions", "Sequences preempted for KV-cache room (a counter)")):
            Gauge(f"halfbyte_engine_{field}", doc, registry=reg).set_function(_stat_reader(llm, field))

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
