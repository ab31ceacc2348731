"""Prometheus metrics of one api-server replica (``lockstep_`` prefix)."""

from __future__ import annotations

from typing import Any

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
        self.resumed = Counter("lockstep_api_resumed", "Requests resubmitted after their rank died", registry=r)
        self.redis_errors = Counter("lockstep_api_redis_errors", "Redis operations that failed", registry=r)
        self.dispatch = Counter("lockstep_api_dispatch_decisions", "Client-dispatch decisions by rank",
                                ["rank"], registry=r)
        # The step-consistent load view as this replica last saw it (snapshot channel).
        self.snapshots = Counter("lockstep_api_snapshots", "Snapshots received from the scheduler", registry=r)
        self.snapshot_seq = Gauge("lockstep_api_snapshot_seq", "Sequence number of the last snapshot", registry=r)
        self.snapshot_step = Gauge("lockstep_api_snapshot_step", "(wave, step) of the last snapshot",
                                   ["part"], registry=r)
        self.snapshot_time = Gauge("lockstep_api_snapshot_time_seconds", "Unix time of the last snapshot's step",
                                   registry=r)
        self.rank_load = Gauge("lockstep_api_rank_load", "Per-rank load in the last snapshot",
                               ["rank", "what"], registry=r)
        self.rank_received = Gauge("lockstep_api_rank_dispatches_received",
                                   "Dispatch decisions a rank had received (by dispatcher) in the last snapshot",
                                   ["rank", "dispatcher"], registry=r)
        self.policy = Gauge("lockstep_api_policy", "Client-dispatch policy counters of this replica",
                            ["counter"], registry=r)

    def observe_snapshot(self, snap: Any) -> None:
        """Gauges of one published Snapshot (shared/stats.py)."""
        self.snapshots.inc()
        self.snapshot_seq.set(snap.seq)
        self.snapshot_step.labels("wave").set(snap.wave)
        self.snapshot_step.labels("step").set(snap.step)
        self.snapshot_time.set(snap.t)
        carried = set(snap.carried)
        for rank, st in snap.ranks.items():
            rk = str(rank)
            for what, v in (("waiting", st.waiting), ("running", st.running), ("outstanding", st.outstanding),
                            ("scheduled", st.scheduled), ("kv_usage", st.kv_usage), ("held", st.held),
                            ("carried", rank in carried)):
                self.rank_load.labels(rk, what).set(float(v))
            for dispatcher, seq in st.recv.items():
                self.rank_received.labels(rk, dispatcher).set(seq)

    def observe_policy(self, policy: Any) -> None:
        """Numeric counters of a client-dispatch policy (decisions, reconciled, ...)."""
        get = getattr(policy, "counters", None) or getattr(policy, "stats", None)
        if get is None:
            return
        for k, v in get().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.policy.labels(k).set(v)
