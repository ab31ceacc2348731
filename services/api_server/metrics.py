"""Prometheus metrics of the api-servers (``lockstep_`` prefix, and vLLM's ``vllm:`` series).

All replicas of one port share it (SO_REUSEPORT), so a scrape reaches one of them at
random: with ``multiproc_dir`` (services/api_server/metrics_dir.py) every replica writes
its values there (prometheus_client's multiprocess mode) and any replica's /metrics
reports the sum over all of them: counters and histograms summed, ``inflight`` summed over
live replicas, the load-view gauges (the same snapshot on every replica) the most recent.

``vllm:num_requests_waiting`` counts every request accepted and not yet running on a rank:
the ranks' queues (the snapshot) and, read at each scrape, the requests the scheduler has
not placed yet, unread or unplaced on the request stream (its group's lag and pending).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared import keys as K
from shared.replies import as_str, str_keys

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# vLLM's buckets, so dashboards built for it read the same
_V_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)
_V_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_V_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
          960.0, 1920.0, 7680.0)
_V_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def _enable_multiprocess(path: str) -> None:
    """Metrics created from now on write to ``path`` (one file per process and kind)."""
    from prometheus_client import values
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values.ValueClass = values.MultiProcessValue()


class ApiMetrics:
    def __init__(self, model: str = "lockstep-moe", multiproc_dir: str | None = None) -> None:
        self.multiproc_dir = multiproc_dir
        if multiproc_dir:
            _enable_multiprocess(multiproc_dir)
        self.registry = CollectorRegistry()
        r = self.registry
        self.model = model
        self.requests = Counter("lockstep_api_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.inflight = Gauge("lockstep_api_inflight", "Requests in flight on the api-servers", registry=r,
                              multiprocess_mode="livesum")
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
        # distinct ones: in scheduler dispatch a replica reads the latest at each scrape, and a
        # scrape that finds the same one again is not another snapshot
        self.snapshots = Counter("lockstep_api_snapshots", "Distinct scheduler snapshots this replica has read "
                                 "(client dispatch: each it follows; scheduler dispatch: the latest, at each scrape)",
                                 registry=r)
        self._seen_seq: int | None = None
        last = "mostrecent"     # the same view on every replica: the latest one written
        self.snapshot_seq = Gauge("lockstep_api_snapshot_seq", "Sequence number of the last snapshot", registry=r,
                                  multiprocess_mode=last)
        self.snapshot_step = Gauge("lockstep_api_snapshot_step", "(wave, step) of the last snapshot",
                                   ["part"], registry=r, multiprocess_mode=last)
        self.snapshot_time = Gauge("lockstep_api_snapshot_time_seconds", "Unix time of the last snapshot's step",
                                   registry=r, multiprocess_mode=last)
        self.rank_load = Gauge("lockstep_api_rank_load", "Per-rank load in the last snapshot",
                               ["rank", "what"], registry=r, multiprocess_mode=last)
        self.rank_received = Gauge("lockstep_api_rank_dispatches_received",
                                   "Dispatch decisions a rank had received (by dispatcher) in the last snapshot",
                                   ["rank", "dispatcher"], registry=r, multiprocess_mode=last)
        # The engine group as the replicas' heartbeats see it: live < ranks for long is an outage
        # (the group steps only with every rank; engine_down_timeout_s then fails requests).
        self.engine_ranks = Gauge("lockstep_api_engine_ranks", "Ranks of the engine group", registry=r,
                                  multiprocess_mode=last)
        self.engine_ranks_live = Gauge("lockstep_api_engine_ranks_live", "Ranks of the engine group with a heartbeat",
                                       registry=r, multiprocess_mode=last)
        self.policy = Gauge("lockstep_api_policy", "Client-dispatch policy counters, summed over the replicas",
                            ["counter"], registry=r, multiprocess_mode="livesum")
        # vLLM's series (docs/operations.md), labelled with the served model as vLLM does
        m = ["model_name"]
        self.v_running = Gauge("vllm:num_requests_running", "Requests running on the ranks (KV allocated)", m,
                               registry=r, multiprocess_mode=last).labels(model)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Requests accepted and not yet running: queued on "
                               "the ranks or not yet placed by the scheduler", m,
                               registry=r, multiprocess_mode=last).labels(model)
        self._rank_waiting = 0      # the two parts of v_waiting: the last snapshot's ...
        self._unplaced = 0          # ... and the scheduler's stream at the last scrape
        self.v_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, mean over the ranks (1 = full)", m,
                          registry=r, multiprocess_mode=last).labels(model)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m, buckets=_V_TTFT,
                                registry=r).labels(model)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "Time between streamed token deltas", m,
                               buckets=_V_TPOT, registry=r).labels(model)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first",
                                m, buckets=_V_TPOT, registry=r).labels(model)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency end to end", m, buckets=_V_E2E,
                               registry=r).labels(model)
        self.v_prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", m, registry=r).labels(model)
        self.v_gen = Counter("vllm:generation_tokens", "Generated tokens of finished requests", m,
                             registry=r).labels(model)
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                 ["model_name", "finished_reason"], registry=r)
        self.v_req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", m,
                                      buckets=_V_TOKENS, registry=r).labels(model)
        self.v_req_gen = Histogram("vllm:request_generation_tokens", "Generated tokens per request", m,
                                   buckets=_V_TOKENS, registry=r).labels(model)

    def request_done(self, ch: Any, t0: float, now: float) -> None:
        """A request's channel finished (RequestChannel): the per-request series."""
        n = len(ch.tokens)
        if ch.first_t:
            self.ttft.observe(ch.first_t - t0)
            self.v_ttft.observe(ch.first_t - t0)
            if n > 1 and ch.last_t > ch.first_t:
                self.v_tpot.observe((ch.last_t - ch.first_t) / (n - 1))
        self.e2e.observe(now - t0)
        self.v_e2e.observe(now - t0)
        self.completion_tokens.inc(n)
        self.v_gen.inc(n)
        self.v_prompt.inc(ch.prompt_tokens)
        self.v_req_prompt.observe(ch.prompt_tokens)
        self.v_req_gen.observe(n)
        self.v_success.labels(self.model, ch.finish or "stop").inc()

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.v_itl.observe(seconds)

    def exposition(self) -> bytes:
        """The text a scrape gets: every replica's values when they share a directory."""
        if not self.multiproc_dir:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess
        agg = CollectorRegistry()
        multiprocess.MultiProcessCollector(agg, path=self.multiproc_dir)
        return generate_latest(agg)

    def observe_snapshot(self, snap: Any) -> None:
        """Gauges of one published Snapshot (shared/stats.py)."""
        if snap.seq != self._seen_seq:
            self._seen_seq = snap.seq
            self.snapshots.inc()
        self.snapshot_seq.set(snap.seq)
        self.snapshot_step.labels("wave").set(snap.wave)
        self.snapshot_step.labels("step").set(snap.step)
        self.snapshot_time.set(snap.t)
        carried = set(snap.carried)
        ranks = list(snap.ranks.values())
        self.v_running.set(sum(st.running for st in ranks))
        self._rank_waiting = sum(st.waiting for st in ranks)
        self.v_waiting.set(self._rank_waiting + self._unplaced)
        self.v_kv.set(sum(st.kv_usage for st in ranks) / len(ranks) if ranks else 0.0)
        for rank, st in snap.ranks.items():
            rk = str(rank)
            for what, v in (("waiting", st.waiting), ("running", st.running), ("outstanding", st.outstanding),
                            ("scheduled", st.scheduled), ("kv_usage", st.kv_usage), ("held", st.held),
                            ("carried", rank in carried)):
                self.rank_load.labels(rk, what).set(float(v))
            for dispatcher, seq in st.recv.items():
                self.rank_received.labels(rk, dispatcher).set(seq)

    def observe_group(self, ranks: int, live: int | None) -> None:
        """The engine group's size and how many of its ranks have a heartbeat (None: unknown)."""
        self.engine_ranks.set(ranks)
        if live is not None:
            self.engine_ranks_live.set(live)

    def observe_unplaced(self, n: int) -> None:
        """Requests the scheduler has not placed on a rank yet (:func:`unplaced`)."""
        self._unplaced = n
        self.v_waiting.set(self._rank_waiting + n)

    def observe_policy(self, policy: Any) -> None:
        """Numeric counters of a client-dispatch policy (decisions, reconciled, ...)."""
        get = getattr(policy, "counters", None) or getattr(policy, "stats", None)
        if get is None:
            return
        for k, v in get().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.policy.labels(k).set(v)


def unplaced_of(groups: Any) -> int:
    """From XINFO GROUPS of the request stream: entries the scheduler's group has not read
    (lag) or read and not acked (pending: unplaced, or deferred). An entry is
    acked in the same transaction that places it (services/scheduler/intake.py)."""
    for g in groups if isinstance(groups, list) else ():
        g = str_keys(g)
        if as_str(g.get("name", "")) == K.SCHEDULER_GROUP:
            return int(g.get("pending") or 0) + int(g.get("lag") or 0)   # lag is nil when Redis cannot tell
    return 0


async def unplaced(r: Any, keys: K.Keys) -> int:
    """Requests accepted and not yet placed on a rank (one XINFO GROUPS)."""
    pipe = r.pipeline(transaction=False)      # raise_on_error=False: a stream not made yet is 0
    pipe.xinfo_groups(keys.requests)
    (groups,) = await pipe.execute(raise_on_error=False)
    return unplaced_of(groups)
