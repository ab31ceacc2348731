"""Prometheus metrics of one api-server replica (``lockstep_`` prefix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lockstep_api_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.inflight = Gauge("lockstep_api_inflight", "Requests in flight on this replica", registry=r)
        self.ttft = Histogram("lockstep_api_ttft_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram("lockstep_api_itl_seconds", "Time between token deltas", buckets=_LAT, registry=r)
        self.e2e = Histogram("lockstep_api_e2e_seconds", "Request latency end to end", buckets=_LAT, registry=r)
        self.prompt_tokens = Counter("lockstep_api_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.completion_tokens = Counter("lockstep_api_completion_tokens", "Completion tokens returned", registry=r)
        self.aborts = Counter("lockstep_api_aborts", "Requests aborted (client gone or timeout)", ["reason"], registry=r)
        self.rejected = Counter("lockstep_api_rejected", "Requests refused for overload (429)", registry=r)
        self.redis_errors = Counter("lockstep_api_redis_errors", "Redis operations that failed", registry=r)
        self.dispatch = Counter("lockstep_api_dispatch_decisions", "Client-dispatch decisions by rank",
                                ["rank"], registry=r)
