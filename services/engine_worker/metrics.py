"""Prometheus metrics of one engine rank (``lockstep_engine_`` prefix, label ``rank``),
served on ``metrics_port``.

The worker calls :meth:`EngineMetrics.on_step` once per step with the RankStats it just
published; everything here is derived from those stats, so the metrics and the Redis
view (``<ns>:rank:{r}:info``, ``<ns>:stats``) always agree. Scrapes run on
prometheus_client's thread and only read plain numbers and the last (immutable) stats.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.metrics_http import serve
from shared.stats import RankStats

_STEP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TOTALS = {   # counter name -> (doc, how one step adds to it)
    "steps": "Steps run (forward or idle forward)",
    "idle_forwards": "Idle (dummy) forwards run while another rank had work",
    "scheduled_tokens": "Tokens computed (prefill + decode)",
    "prefill_tokens": "Prefill tokens computed",
    "decode_tokens": "Decode tokens computed",
    "finished_requests": "Requests finished on this rank",
}
_GAUGES = {
    "waiting": "Requests queued on the rank, not yet scheduled",
    "running": "Requests with KV allocated",
    "kv_used_blocks": "KV-cache blocks in use",
    "kv_total_blocks": "KV-cache blocks on the rank",
    "outstanding_tokens": "Prompt tokens not yet computed + output tokens still to come",
    "held_prefills": "Prefills held by the staggered-batch gate",
    "wave": "Current wave (increments after every pause)",
    "step": "Last step number in the wave",
}
_EXTRA = {   # cumulative counters the worker keeps in RankStats.extra
    "gate_full": ("lockstep_engine_gate_releases", "full", "Staggered batches released by the gate, by reason"),
    "gate_timeout": ("lockstep_engine_gate_releases", "timeout", ""),
    "preemptions": ("lockstep_engine_preemptions", None, "Sequences preempted for KV (recomputed later)"),
}


class EngineMetrics:
    def __init__(self, rank: int) -> None:
        self.rank = str(rank)
        self.totals = {k: 0 for k in _TOTALS}
        self.last: RankStats | None = None
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram("lockstep_engine_step_seconds", "Wall time of one step on this rank",
                                      ["rank"], buckets=_STEP, registry=self.registry)
        self.registry.register(self)

    def on_step(self, st: RankStats) -> None:
        t = self.totals
        t["steps"] += 1
        t["idle_forwards"] += 1 if st.idle else 0
        t["scheduled_tokens"] += st.scheduled
        t["prefill_tokens"] += st.prefill
        t["decode_tokens"] += st.decode
        t["finished_requests"] += st.finished
        self.last = st
        self.step_seconds.labels(self.rank).observe(st.dur_ms / 1000.0)

    # prometheus_client collector protocol
    def collect(self) -> Iterable[Metric]:
        totals, st = dict(self.totals), self.last
        for name, doc in _TOTALS.items():
            c = CounterMetricFamily(f"lockstep_engine_{name}", doc, labels=["rank"])
            c.add_metric([self.rank], totals[name])
            yield c
        if st is None:
            return
        values = {"waiting": st.waiting, "running": st.running, "kv_used_blocks": st.kv_used,
                  "kv_total_blocks": st.kv_total, "outstanding_tokens": st.outstanding, "held_prefills": st.held,
                  "wave": st.wave, "step": st.step}
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"lockstep_engine_{name}", doc, labels=["rank"])
            g.add_metric([self.rank], float(values[name]))
            yield g
        g = GaugeMetricFamily("lockstep_engine_kv_usage_ratio", "KV blocks in use / KV blocks", labels=["rank"])
        g.add_metric([self.rank], st.kv_usage)
        yield g
        extra = dict(st.extra)
        gate = CounterMetricFamily("lockstep_engine_gate_releases", _EXTRA["gate_full"][2], labels=["rank", "reason"])
        for key in ("gate_full", "gate_timeout"):
            gate.add_metric([self.rank, _EXTRA[key][1]], float(extra.get(key, 0) or 0))
        yield gate
        pre = CounterMetricFamily("lockstep_engine_preemptions", _EXTRA["preemptions"][2], labels=["rank"])
        pre.add_metric([self.rank], float(extra.get("preemptions", 0) or 0))
        yield pre


def start_metrics(port: int, rank: int, addr: str = "0.0.0.0", log: Any = None) -> EngineMetrics | None:
    """Serve this rank's metrics on ``port`` (0 = off). Returns the hook object or None."""
    if not port:
        return None
    m = EngineMetrics(rank)
    serve(port, addr, m.registry, log)
    return m
