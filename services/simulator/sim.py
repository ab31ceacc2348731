"""Discrete-event simulation of one engine group behind api-servers and a scheduler.

Virtual clock (seconds). Components and the hops between them, each a modeled latency
(``SimConfig``, in ms, plus a seeded jitter; per-inbox FIFO is kept, as Redis streams do):

    client --(trace)--> api-server a
      scheduler dispatch:  api --api_to_sched--> scheduler policy --sched_to_rank--> rank inbox
      client dispatch:     api-server a's own policy instance --api_to_rank--> rank inbox
    rank stats (end of step) --stats--> StepAggregator --publish--> every dispatcher's policy

Engines read their inboxes at step boundaries (a request that lands just after a step began
waits for the next boundary) and run in lockstep (engine_group.EngineGroup: every rank is
the live engine's RankStep). The policies
are the project's own objects (``make_policy``) or the baseline classes, driven through the
protocols of shared/policy/base.py; snapshots come from the project's StepAggregator
(``min_interval_s`` gives the peers' publication cadence). Everything is a pure function of
the trace, the config and the seed: the same inputs give the same numbers.

The ideal (for efficiency vs. ideal): the same trace on one pooled rank with the capacity
of all ranks (budget, sequences and KV × ranks) whose step costs
``step_ms(total tokens / ranks, longest context)`` — every step's tokens perfectly
balanced, no dispatch latency, no idle forwards. The context term is the longest sequence's,
as in every real group: that sequence is attended on one rank wherever it is placed, so
no balance can divide it (dividing it by the ranks, as this ideal once did, gave the ideal
an attention cost no placement can reach: 1.3 s of the default's 2.1 s gap on bursty at
load 1.0). ``efficiency = throughput / ideal throughput``.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from shared.cost_model import CostModel
from shared.policy.aggregator import StepAggregator
from shared.policy.base import RequestInfo
from services.simulator.baselines import PolicySpec, policy_specs
from services.engine_worker.step_view import Action
from services.simulator.engine_group import EngineConfig, EngineGroup, StepOut
from services.simulator.workload import Trace
from services.engine_worker.step_budget import BudgetConfig

ARRIVE, SCHED, DELIVER, STATS, SNAP, POLL, AGG_TICK, FINISHED = range(8)
INF = math.inf


@dataclass
class SimConfig:
    ranks: int = 8
    api_servers: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    cost: CostModel = field(default_factory=CostModel)
    api_to_sched_ms: float = 0.5     # api-server -> scheduler (XADD + XREADGROUP)
    sched_to_rank_ms: float = 0.5    # scheduler -> rank inbox
    api_to_rank_ms: float = 0.5      # api-server -> rank inbox (client dispatch)
    stats_ms: float = 0.5            # rank report -> scheduler
    publish_ms: float = 0.5          # snapshot -> dispatchers (pub/sub)
    jitter_ms: float = 0.5           # uniform extra latency per hop (seeded)
    grace_ms: float = 50.0           # StepAggregator grace
    lockstep_gate_timeout_ms: float = 100.0   # EngineSettings.gate_timeout_ms default
    dispatch: str | None = None      # None: each system's own deployment; "scheduler" | "client": all alike
    view_interval_ms: float = 100.0  # client dispatch: how often the api-servers' view is published
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["engine"] = asdict(self.engine)
        d["cost"] = self.cost.to_dict()
        return d


@dataclass
class RunResult:
    name: str
    arrival: np.ndarray
    output: np.ndarray
    first_t: np.ndarray
    finish_t: np.ndarray
    rank_of: np.ndarray
    step_t: np.ndarray          # step start times
    step_dur: np.ndarray        # seconds
    scheduled: np.ndarray       # steps x ranks (int32)
    decode_tokens: np.ndarray   # per step, all ranks
    wall_s: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return int(np.isfinite(self.finish_t).sum())


class _Recorder:
    def __init__(self, ranks: int) -> None:
        self.t: list[float] = []
        self.dur: list[float] = []
        self.rows: list[np.ndarray] = []
        self.dec: list[int] = []

    def add(self, t: float, dur: float, sched: np.ndarray, dec_total: int) -> None:
        self.t.append(t)
        self.dur.append(dur)
        self.rows.append(sched)
        self.dec.append(dec_total)

    def arrays(self, ranks: int) -> tuple[np.ndarray, ...]:
        sched = np.vstack(self.rows).astype(np.int32) if self.rows else np.zeros((0, ranks), np.int32)
        return (np.asarray(self.t), np.asarray(self.dur), sched, np.asarray(self.dec, dtype=np.int64))


HOLD_POLL_S = 0.002   # the worker's HOLD_POLL_MS: ranks whose work is all gated meet again this often


def _deployment(spec: PolicySpec, cfg: SimConfig) -> tuple[bool, float, bool]:
    """(client_mode, snapshot interval s, view delay) of ``spec`` under ``cfg.dispatch``.

    None: the system's own default deployment (``spec``). ``"scheduler"``: one dispatcher
    with a step-consistent view every step, for every system. ``"client"``: every
    api-server decides from a view published every ``cfg.view_interval_ms``, for every
    system. A dispatcher inside the engine (late binding, TensorRT-LLM) stays there: with
    N api-servers they all feed its one queue."""
    if getattr(spec, "late_binding", False) or cfg.dispatch is None:
        return spec.client_mode, spec.snapshot_interval_s, spec.view_delay
    if cfg.dispatch == "scheduler":
        return False, 0.0, True
    if cfg.dispatch == "client":
        return True, cfg.view_interval_ms / 1000.0, True
    raise ValueError(f"dispatch is 'scheduler' or 'client', not {cfg.dispatch!r}")


def _budget(spec: PolicySpec, cfg: SimConfig) -> BudgetConfig | None:
    if spec.step_budget is None:
        return None
    return BudgetConfig(**{"max_tokens": cfg.engine.max_num_batched_tokens, **spec.step_budget})


def _gate_timeout_s(spec: PolicySpec, cfg: SimConfig) -> float:
    g = getattr(spec, "gate", ())
    if g and g[0] == "batch":
        return float(g[1])
    return cfg.lockstep_gate_timeout_ms / 1000.0


def _paced_collector(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with the cyclic garbage collector paced at 100,000 allocations. A run
    allocates a few short-lived objects per simulated token (reference counting frees
    them); at the default pace (700) the collector keeps rescanning the trace's live
    requests: 15 % of a 100,000-request x 32-rank run (77 -> 65 s)."""
    @functools.wraps(fn)
    def paced(*args: Any, **kw: Any) -> Any:
        old = gc.get_threshold()
        gc.set_threshold(max(old[0], 100_000), max(old[1], 50), max(old[2], 100))
        try:
            return fn(*args, **kw)
        finally:
            gc.set_threshold(*old)
    return paced


@_paced_collector
def run_policy(trace: Trace, spec: PolicySpec, cfg: SimConfig,
               progress: Callable[[int], None] | None = None) -> RunResult:
    """Simulate ``trace`` under one policy. Deterministic in (trace, spec, cfg)."""
    wall0 = time.perf_counter()
    R, N = cfg.ranks, cfg.api_servers
    n = len(trace)
    ranks = list(range(R))
    client_mode, snap_interval, view_delay = _deployment(spec, cfg)
    late = bool(getattr(spec, "late_binding", False))
    gate_factory = getattr(spec, "group_gate", None)
    caps = trace.caps(cfg.engine.max_model_len)
    eng = EngineGroup(R, cfg.engine, cfg.cost, trace.prompt, trace.output, caps,
                      gate_timeout_s=_gate_timeout_s(spec, cfg), budget=_budget(spec, cfg),
                      group_gate=gate_factory() if gate_factory else None,
                      report_outstanding=spec.lockstep, report_tokens=spec.with_tokens)
    rng = np.random.default_rng(cfg.seed + 7919)
    jit = cfg.jitter_ms / 1000.0
    jitters = rng.uniform(0.0, jit, size=4 * n + 16) if jit > 0 else np.zeros(4 * n + 16)
    jpos = 0

    n_disp = N if client_mode and not late else 1
    pols = [spec.factory(dispatcher_id=(f"api-{a}" if n_disp > 1 else "scheduler"),
                         client_index=a, num_api_servers=N, client_mode=n_disp > 1,
                         ranks=ranks, block_size=cfg.engine.block_size,
                         step_tokens=cfg.engine.max_num_batched_tokens, max_seqs=cfg.engine.max_num_seqs)
            for a in range(n_disp)]
    # as the services: the scheduler holds (submit/poll); api-servers place at once (choose)
    batching = hasattr(pols[0], "submit") and (n_disp == 1 or not hasattr(pols[0], "choose"))
    agg = StepAggregator(ranks, grace_s=cfg.grace_ms / 1000.0, min_interval_s=snap_interval)
    filt = spec.publish_filter() if spec.publish_filter else None
    stats_lag = cfg.stats_ms / 1000.0 if view_delay else 0.0
    pub_lag = cfg.publish_ms / 1000.0 if view_delay else 0.0

    t_arr = trace.t.tolist()
    api = trace.api.tolist()
    prompt = trace.prompt.tolist()
    cap = caps.tolist()
    reqs: list[RequestInfo | None] = [None] * n
    heap: list[tuple] = []
    ctr = 0
    inbox_last = [0.0] * R          # FIFO per rank inbox
    sched_last = [0.0] * N          # FIFO per api-server -> scheduler connection
    poll_armed: list[float | None] = [None] * n_disp
    agg_armed: list[float | None] = [None]
    lat_a2s = cfg.api_to_sched_ms / 1000.0
    lat_s2r = cfg.sched_to_rank_ms / 1000.0
    lat_a2r = cfg.api_to_rank_ms / 1000.0

    def push(t: float, kind: int, a: Any = None, b: Any = None) -> None:
        nonlocal ctr
        ctr += 1
        heapq.heappush(heap, (t, ctr, kind, a, b))

    def hop(t: float, lat: float, last: list[float], k: int) -> float:
        """When a message sent at ``t`` arrives: the hop's latency and jitter (a burst does
        not arrive in one instant), in order behind the last one on the same queue ``k``."""
        nonlocal jpos
        td = t + lat + jitters[jpos % jitters.size]
        jpos += 1
        if td < last[k]:
            td = last[k]
        last[k] = td
        return td

    def send(asg, t: float, lat: float) -> None:
        push(hop(t, lat, inbox_last, asg.rank), DELIVER, asg)

    def hop_to_scheduler(i: int, t: float) -> None:
        push(hop(t, lat_a2s, sched_last, api[i]), SCHED, i)   # each api-server's connection in order

    def arm_poll(k: int) -> None:
        d = pols[k].next_deadline()
        if d is not None and d != poll_armed[k]:
            poll_armed[k] = d
            push(d, POLL, k)

    def arm_agg() -> None:
        d = agg.next_deadline()
        if d is not None and d != agg_armed[0]:
            agg_armed[0] = d
            push(d, AGG_TICK)

    def publish(snap, t: float) -> None:
        if snap is not None:
            push(t + pub_lag, SNAP, snap)

    def request(i: int) -> RequestInfo:
        q = reqs[i]
        if q is None:   # what a real deployment knows: prompt length and the client's cap
            q = reqs[i] = RequestInfo(str(i), prompt[i], cap[i], t_arr[i])
        return q

    def dispatch(k: int, i: int, t: float, lat: float) -> None:
        p = pols[k]
        if batching:
            for asg in p.submit(request(i), t):
                send(asg, t, lat)
            arm_poll(k)
        else:
            send(p.choose(request(i), t), t, lat)

    def handle(t: float, kind: int, a: Any, b: Any) -> None:
        if kind == ARRIVE:
            if n_disp > 1:
                dispatch(api[a], a, t, lat_a2r)
            else:
                hop_to_scheduler(a, t)
        elif kind == SCHED:
            dispatch(0, a, t, lat_s2r)
        elif kind == DELIVER:
            eng.deliver(a, int(a.request_id))
        elif kind == STATS:
            snap = None
            for st in a:
                s = agg.report(st, t)
                if s is not None:
                    snap = s
            publish(snap, t)
            arm_agg()
        elif kind == SNAP:
            for k, p in enumerate(pols):
                p.on_snapshot(a)
                if batching:     # a fresher view may release unplaced requests (the scheduler polls too)
                    for asg in p.poll(t):
                        send(asg, t, lat_a2r if n_disp > 1 else lat_s2r)
                    arm_poll(k)
        elif kind == POLL:
            if poll_armed[a] == t:
                poll_armed[a] = None
                released = pols[a].poll(t)
                for asg in released:
                    send(asg, t, lat_a2r if n_disp > 1 else lat_s2r)
                d = pols[a].next_deadline()
                if not released and d is not None and d <= t:
                    # it would be polled again at this instant forever: fail, never hang
                    raise RuntimeError(f"{spec.name}: released nothing at its own deadline {d!r} (t={t!r})")
                arm_poll(a)
        elif kind == AGG_TICK:
            if agg_armed[0] == t:
                agg_armed[0] = None
                publish(agg.tick(t), t)
                arm_agg()
        elif kind == FINISHED:      # the dispatcher saw the request's last output (vLLM's in-flight count)
            pols[a].note_finished(str(b), t)

    ai = 0

    def process_until(T: float) -> None:
        nonlocal ai
        while True:
            ta = t_arr[ai] if ai < n else INF
            th = heap[0][0] if heap else INF
            if ta <= th:
                if ta > T:
                    return
                ai += 1
                handle(ta, ARRIVE, ai - 1, None)
            else:
                if th > T:
                    return
                e = heapq.heappop(heap)
                handle(e[0], e[2], e[3], e[4])

    def next_event() -> float:
        ta = t_arr[ai] if ai < n else INF
        th = heap[0][0] if heap else INF
        return min(ta, th)

    rec = _Recorder(R)
    wave = step = 0
    paused = True
    t = t_arr[0] if n else 0.0
    last_done = 0
    filt_on = filt is not None
    binder = pols[0] if late else None
    track_finish = hasattr(pols[0], "note_finished")
    while eng.done < n:
        process_until(t)
        if binder is not None:
            for asg in binder.bind(t, eng.loads()):
                eng.deliver(asg, int(asg.request_id))
        out = eng.step(t)
        if track_finish:
            for i in eng.take_rejected():
                push(t + stats_lag, FINISHED, api[i] if n_disp > 1 else 0, i)
        if out is Action.PAUSE or out is Action.HOLD:
            if out is Action.PAUSE and not paused:
                paused = True
                wave += 1
                step = 0
            tn = next_event()
            if out is Action.HOLD:
                tn = min(tn, t + HOLD_POLL_S)
            if tn == INF:
                raise RuntimeError(f"{spec.name}: stuck at t={t:.3f}s with {n - eng.done} requests "
                                   f"unfinished (delivered {eng.delivered})")
            t = max(tn, t)
            continue
        paused = False
        step += 1
        t_end = t + out.dur_s
        rec.add(t, out.dur_s, out.scheduled, int(out.decode.sum()))
        if track_finish:
            for i in out.finished:
                push(t_end + stats_lag, FINISHED, api[i] if n_disp > 1 else 0, i)
        stats = eng.rank_stats(wave, step, t_end, out)
        if filt_on:
            stats = filt(stats)
        push(t_end + stats_lag, STATS, stats)
        t = t_end
        if progress is not None and eng.done - last_done >= 1000:
            progress(eng.done - last_done)
            last_done = eng.done
    if progress is not None and eng.done > last_done:
        progress(eng.done - last_done)
    st, dur, sched, dec = rec.arrays(R)
    counters: dict[str, Any] = {"steps": int(st.size), "waves": wave + (0 if paused else 1),
                                "aggregator": agg.counters(), "preemptions": eng.preemptions,
                                "rejected": eng.errors, "hold_rounds": eng.holds,
                                "deployment": {"dispatchers": n_disp, "view_interval_ms": snap_interval * 1000.0,
                                               "late_binding": late}}
    g0 = eng.ranks[0].gate
    if g0.released_full or g0.released_timeout:
        counters["gate_released_full"] = g0.released_full
        counters["gate_released_timeout"] = g0.released_timeout
    if eng.group_gate is not None and hasattr(eng.group_gate, "counters"):
        counters["group_gate"] = eng.group_gate.counters()
    p0 = pols[0]
    if hasattr(p0, "stats") and callable(p0.stats):
        try:
            counters["policy"] = {k: v for k, v in p0.stats().items()
                                  if isinstance(v, (int, float, str, dict)) or v is None}
        except Exception:  # a policy's status view must not break a run
            pass
    return RunResult(spec.name, trace.t, eng.generated, eng.first_t, eng.finish_t, eng.rank_of,
                     st, dur, sched, dec, time.perf_counter() - wall0, counters)


@_paced_collector
def run_ideal(trace: Trace, cfg: SimConfig) -> RunResult:
    """The same trace with perfectly balanced steps (see the module docstring)."""
    wall0 = time.perf_counter()
    R = cfg.ranks
    eng = EngineGroup(1, cfg.engine.pooled(R), cfg.cost, trace.prompt, trace.output,
                      trace.caps(cfg.engine.max_model_len), cost_divisor=R, report_outstanding=False)
    t_arr = trace.t.tolist()
    n = len(t_arr)
    rec = _Recorder(1)
    ai = 0
    t = t_arr[0]
    while eng.done < n:
        while ai < n and t_arr[ai] <= t:
            eng.deliver(None, ai, 0)
            ai += 1
        out = eng.step(t)
        if not isinstance(out, StepOut):
            if ai >= n:
                raise RuntimeError("ideal run stuck")
            t = t_arr[ai]
            continue
        rec.add(t, out.dur_s, out.scheduled, int(out.decode.sum()))
        t += out.dur_s
    st, dur, sched, dec = rec.arrays(1)
    return RunResult("ideal", trace.t, eng.generated, eng.first_t, eng.finish_t, eng.rank_of,
                     st, dur, sched, dec, time.perf_counter() - wall0,
                     {"steps": int(st.size), "preemptions": eng.preemptions})


def resolve_policies(names: str | list[str], cfg: SimConfig) -> list[PolicySpec]:
    specs = policy_specs(cfg.lockstep_gate_timeout_ms / 1000.0)
    if isinstance(names, str):
        names = [x.strip() for x in names.split(",") if x.strip()]
    names = list(dict.fromkeys(names))      # a policy named twice runs once
    # lockstep's staggered batches need its one scheduler: `up --dispatch client` refuses
    # them, so a client-dispatch simulation of them would report a cluster nobody can run
    scheduler_only = {"staggered", "staggered_aligned"} if cfg.dispatch == "client" else set()
    if not names or names == ["all"]:
        return [s for name, s in specs.items() if name not in scheduler_only]
    bad = [x for x in names if x not in specs]
    if bad:
        raise ValueError(f"unknown policies {bad}; choose from: all, {', '.join(specs)}")
    served = [x for x in names if x in scheduler_only]
    if served:
        raise ValueError(f"{', '.join(served)}: lockstep's staggered batches are formed by its one scheduler, so "
                         "`lockstep up` serves them with dispatch scheduler only; use --dispatch scheduler (or "
                         "leave --dispatch out), or drop them")
    return [specs[x] for x in names]
