"""Prometheus metrics of the server (``GET /metrics``), one registry per server.

Engine gauges are read from the last ``engine.stats`` the engine thread published, so a scrape
never touches the engine's own structures from another thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "hf_paged_attn"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds; the tiny demo model answers in milliseconds on CPU, big models on GPU in tenths.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Any]:
        s = self._stats()
        gauges = {
            "num_requests_running": ("requests running in the engine", s.num_running),
            "num_requests_waiting": ("requests waiting for admission", s.num_waiting),
            "kv_blocks_used": ("KV cache blocks in use", s.num_blocks - s.num_free_blocks),
            "kv_blocks_free": ("KV cache blocks free (prefix-cached ones included)", s.num_free_blocks),
            "kv_blocks_total": ("KV cache blocks", s.num_blocks),
            "prefix_cache_hit_rate": ("share of admitted prompt tokens found in the prefix cache", s.prefix_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        preemptions = s.num_preemptions
        yield CounterMetricFamily(f"{PREFIX}_num_preemptions", "requests preempted for KV blocks", value=preemptions)
        for name, doc, value in (
            ("spec_decode_num_draft_tokens", "speculative tokens proposed and verified", s.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "speculative tokens accepted", s.num_accepted_tokens),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ServeMetrics:
    """Counters and histograms the server updates, plus the engine's gauges."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "from request arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "between a request's consecutive tokens",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens submitted", registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=self.registry)
        self.requests_finished = Counter(
            f"{PREFIX}_requests_finished", "engine requests finished, by reason (length, eos, stop, abort, error)",
            ["finish_reason"], registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats))

    def record_step(self, outputs: list[Any], relabel: dict[str, str] | None = None) -> None:
        """Called by the engine thread after every step (prometheus_client is thread-safe).
        ``relabel``: request id -> the finish reason to count instead of the engine's."""
        num_new = sum(len(out.new_ids) for out in outputs)
        if num_new:
            self.generation_tokens.inc(num_new)
        for out in outputs:
            if out.finished:
                reason = (relabel or {}).get(out.request_id) or out.finish_reason or "unknown"
                self.requests_finished.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
