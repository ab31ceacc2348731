"""Prometheus metrics of the scheduler (``lockstep_`` prefix), served on ``metrics_port``.

Two kinds of series:
- events counted as they happen, from the one hook the service calls per placement
  (:meth:`SchedulerMetrics.on_dispatch`): dispatch decisions per rank and reason, batch
  releases by reason, queue and batch-hold times;
- state read at scrape time (:class:`_StateCollector`): the service's counters
  (snapshots published, aborts routed, bad entries), the step aggregator's counters, the
  policy's counters, and the last published snapshot's per-rank view.

``prometheus_client.start_http_server`` answers scrapes on its own thread while the
service mutates its state on the event loop; the collector only copies plain numbers and
keeps the last good reading if a copy races with a mutation.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.metrics_http import serve

_WAIT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_SERVICE_COUNTERS = {
    "dispatched": ("lockstep_scheduler_dispatched", "Requests placed on a rank"),
    "dispatched_tokens": ("lockstep_scheduler_dispatched_prompt_tokens",
                          "Prompt tokens of the requests placed on a rank"),
    "explicit": ("lockstep_scheduler_explicit", "Requests whose rank the client fixed (data_parallel_rank)"),
    "aborts_routed": ("lockstep_scheduler_aborts_routed", "Aborts forwarded to the owning rank"),
    "snapshots": ("lockstep_scheduler_snapshots_published", "Step-consistent snapshots published"),
    "bad_entries": ("lockstep_scheduler_bad_entries", "Request-stream entries that could not be handled"),
    "resumed": ("lockstep_scheduler_resumed", "Requests placed again after their rank died (in dispatched too)"),
    "deferred": ("lockstep_scheduler_deferred", "Request-stream entries left unread while max_unplaced were held"),
    "duplicates": ("lockstep_scheduler_duplicate_submissions",
                   "Second copies of a placed submission (written again through a dropped connection), dropped"),
}
_RANK_FIELDS = ("scheduled", "prefill", "decode", "waiting", "running", "kv_used", "kv_total", "outstanding", "held")


def _numeric(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class _StateCollector:
    def __init__(self, service: Any) -> None:
        self.service = service
        self._last: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        svc = self.service
        try:
            policy_fn = getattr(svc.policy, "stats", None) or getattr(svc.policy, "counters", None)
            policy = policy_fn() if policy_fn else {}
            snap = svc.last_snapshot
            self._last = {
                "service": dict(svc.counters),
                "agg": dict(svc.agg.counters()),
                "policy": dict(policy),
                "snapshot": snap,
                "live": list(svc.live),
                "drained": set(svc.drained),
            }
        except RuntimeError:   # a structure changed size under us: serve the previous reading
            pass
        return self._last

    def collect(self) -> Iterable[Metric]:
        s = self._read()
        if not s:
            return
        for key, (name, doc) in _SERVICE_COUNTERS.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], s["service"].get(key, 0))
            yield c
        agg = CounterMetricFamily("lockstep_scheduler_aggregator", "Step aggregator counters by kind "
                                  "(reports, accepted, stale_dropped, finalized, grace_expired, ...)", labels=["kind"])
        for k, v in _numeric(s["agg"]).items():
            agg.add_metric([k], v)
        yield agg
        pol = GaugeMetricFamily("lockstep_scheduler_policy", "Dispatch policy counters and state by name",
                                labels=["policy", "name"])
        pname = str(getattr(self.service.policy, "name", "")) or self.service.s.policy
        for k, v in _numeric(s["policy"]).items():
            pol.add_metric([pname, k], v)
        by_reason = s["policy"].get("batches_by_reason")
        yield pol
        if isinstance(by_reason, dict):
            b = CounterMetricFamily("lockstep_scheduler_policy_batches", "Staggered batches released, by reason "
                                    "(policy's own count)", labels=["reason"])
            for k, v in _numeric(by_reason).items():
                b.add_metric([k], v)
            yield b
        live = GaugeMetricFamily("lockstep_scheduler_rank_live", "1 when the rank's heartbeat is alive", labels=["rank"])
        dr = GaugeMetricFamily("lockstep_scheduler_rank_drained", "1 when the rank is drained", labels=["rank"])
        for r in self.service.ranks:
            live.add_metric([str(r)], 1.0 if r in s["live"] else 0.0)
            dr.add_metric([str(r)], 1.0 if r in s["drained"] else 0.0)
        yield live
        yield dr
        snap = s["snapshot"]
        if snap is None:
            return
        for name, value in (("seq", snap.seq), ("wave", snap.wave), ("step", snap.step),
                            ("timestamp_seconds", snap.t), ("carried_ranks", len(snap.carried))):
            g = GaugeMetricFamily(f"lockstep_scheduler_snapshot_{name}", f"Last published snapshot: {name}")
            g.add_metric([], float(value))
            yield g
        fams = {f: GaugeMetricFamily(f"lockstep_snapshot_rank_{f}", f"Per-rank {f} in the last published snapshot",
                                     labels=["rank"]) for f in _RANK_FIELDS}
        idle = GaugeMetricFamily("lockstep_snapshot_rank_idle", "1 when the rank ran an idle forward in that step",
                                 labels=["rank"])
        for r, st in sorted(snap.ranks.items()):
            for f in _RANK_FIELDS:
                fams[f].add_metric([str(r)], float(getattr(st, f)))
            idle.add_metric([str(r)], 1.0 if st.idle else 0.0)
        yield from fams.values()
        yield idle


class SchedulerMetrics:
    def __init__(self, service: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("lockstep_scheduler_dispatch_decisions", "Placements by rank and reason "
                                 "(dispatch, explicit, full, timeout, wait_bound)", ["rank", "reason"], registry=r)
        self.batches = Counter("lockstep_scheduler_batch_releases", "Staggered batches released, by reason",
                               ["reason"], registry=r)
        self.queue = Histogram("lockstep_scheduler_queue_seconds", "Api-server acceptance to placement on a rank",
                               buckets=_WAIT, registry=r)
        self.hold = Histogram("lockstep_scheduler_batch_hold_seconds", "Time a batched request waited unplaced "
                              "before its batch was released", ["reason"], buckets=_WAIT, registry=r)
        r.register(_StateCollector(service))
        self._last_batch: str | None = None

    def on_dispatch(self, a: Any, req: Any, now: float) -> None:
        """One placement (called by the service for every request it sends to a rank)."""
        self.decisions.labels(str(a.rank), a.reason).inc()
        wait = max(0.0, now - float(req.arrival))
        self.queue.observe(wait)
        if a.batch:
            self.hold.labels(a.reason).observe(wait)
            if a.batch != self._last_batch:       # a batch's assignments are released together
                self._last_batch = a.batch
                self.batches.labels(a.reason).inc()


def start_metrics(service: Any, port: int, addr: str = "0.0.0.0", log: Any = None) -> SchedulerMetrics | None:
    """Serve the scheduler's metrics on ``port`` (0 = off). Returns the hook object or None."""
    if not port:
        return None
    m = SchedulerMetrics(service)
    serve(port, addr, m.registry, log)
    return m
