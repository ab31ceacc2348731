"""The policies the simulator compares, each with its real parameters, modeled from the
peers' CURRENT code (each class docstring names the file and behaviour; facts also in
/work/shared/PEERS.md; our own code, nothing copied).

A :class:`PolicySpec` says how a policy is deployed, not only how it picks: who decides
(one scheduler, or every api-server from its own view), how often the load view is
refreshed and how stale it is, which engine-side gate runs (``gate`` for the batch gate,
``group_gate`` for a peer's group-wide prefill gate from ``peer_gates.py``), whether requests
are bound late (``late_binding``), and the system's own default deployment
(``default_dispatch``). lockstep's own policies are built through
``shared.policy.registry.make_policy``; the baselines are the small classes below and in
``peer_gates.py``, implementing the protocols of shared/policy/base.py.

=========================  =================================================================
name                       model
=========================  =================================================================
round_robin                lockstep's RoundRobin (make_policy), one scheduler.
vllm_pre_21617             vLLM before PR #21617 (historical): every api-server decides;
                           score waiting×4 + running, strict ``<`` from a fixed start
                           ``(engines × client_index) // clients``; +1 local bump; 100 ms
                           view replacing all bumps; rank 0 before the first view (#22910).
vllm                       vLLM today (core_client.py ``DPLBAsyncMPClient``): score
                           ``max(clients × own in-flight, waiting + running)`` + KV penalty
                           ``waiting × 6 × max(0, kv − 0.5)`` (#49204); scan start rotates
                           after every decision (#47420); +client_count bump; the 100 ms
                           coordinator view replaces the local one; engines publish before
                           and after each step (#41626): here after it only (a view up to one
                           step staler). Default deployment: client.
sglang_total_requests      SGLang ``DPBudget`` (data_parallel_controller.py), one controller:
                           snapshots with an unchanged timestamp are skipped; first rank with
                           the fewest running + waiting; +1 bump; refresh <= 20 ms; ranks
                           republish on prefill / idle transition / every 15 decode steps.
sglang_total_tokens        same, min over (tokens, requests); +1 and +prompt bump (#22614).
sglang_prefill_delayer     sglang_total_tokens + the engines' PrefillDelayer
                           (prefill_delayer.py): all/none prefillable → prefill, mixed →
                           delay, at most max_delay_passes − 1 = 29 passes in a row.
trtllm_adp_balance         TensorRT-LLM attention DP: one global queue in the executor, bound
                           late (take <= ranks × max_active − active per iteration), heap on
                           (active prompt tokens, active requests), longest prompt first,
                           per-rank cap ceil(total / ranks); + ADP Balance gate
                           (``timeout_iters=50``, ``batching_wait_iters=10``).
trtllm_adp_placement_only  the same placement without the gate (TRT-LLM's default).
fastdeploy_staggered_pr    FastDeploy's UNMERGED PR #5558 → #6359, reconstructed by us
                           (sizing unpublished): never a goal reference (``reference=False``).
least_score                lockstep's LeastScore, one scheduler, a snapshot every step.
least_tokens               lockstep's LeastTokens (outstanding tokens), one scheduler.
staggered                  lockstep's StaggeredBatcher + the engine batch gate.
=========================  =================================================================

Not modeled (documented simplifications): vLLM's 32-step wave all-reduce and 5 s heartbeat;
vLLM's mixed-step views; SGLang's PrefillDelayer "all"-branch slot condition and opt-in queue
trigger; TRT-LLM's KV-cache-aware and conversation-aware ADP routers (not the default).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from shared.policy.base import Assignment, RequestInfo
from shared.policy.registry import make_policy, policy_class
from shared.policy.waterfill import level_for
from shared.stats import RankStats, Snapshot

from services.simulator.peer_gates import AdpBalanceGate, PrefillDelayer, TrtllmAdpRouter


class _SeqMixin:
    """Per-(dispatcher, rank) sequence numbers, as every Assignment must carry."""

    dispatcher_id: str

    def _assign(self, req: RequestInfo, rank: int, reason: str = "dispatch", **kw: Any) -> Assignment:
        seq = self._seqs.get(rank, 0) + 1
        self._seqs[rank] = seq
        return Assignment(request_id=req.id, rank=rank, reason=reason,
                          dispatcher=self.dispatcher_id, seq=seq, **kw)


class VllmDPLBLegacy(_SeqMixin):
    """vLLM's api-server DP load balancer as it was up to mid-2025 (kept as ``vllm_pre_21617``):
    score waiting×4 + running, strict ``<`` scan from a FIXED start
    ``(engines × client_index) // clients``, local bump +1 (+client_count after #21617),
    each coordinator message replaces the local view; rank 0 before the first view (#22910).
    """

    name = "vllm_pre_21617"

    def __init__(self, *, dispatcher_id: str, num_api_servers: int = 1, client_mode: bool = True,
                 ranks: list[int], client_index: int = 0, bump: int | None = None,
                 rank0_before_first_snapshot: bool = False, w_wait: int = 4, w_run: int = 1) -> None:
        self.dispatcher_id = dispatcher_id
        self.bump = num_api_servers if bump is None else bump
        self.rank0_first = rank0_before_first_snapshot
        self.w_wait, self.w_run = w_wait, w_run
        self._seqs: dict[int, int] = {}
        self.set_ranks(ranks)
        self._start = (len(self.ranks) * client_index) // max(1, num_api_servers)
        self.have_snapshot = False

    def set_ranks(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)
        self.waiting = [0] * len(self.ranks)
        self.running = [0] * len(self.ranks)

    def on_snapshot(self, snap: Snapshot) -> None:
        # each coordinator message replaces the whole local view (bumps included)
        for j, r in enumerate(self.ranks):
            st = snap.ranks.get(r)
            if st is not None:
                self.waiting[j], self.running[j] = st.waiting, st.running
        self.have_snapshot = True

    def choose(self, req: RequestInfo, now: float) -> Assignment:
        n = len(self.ranks)
        if self.rank0_first and not self.have_snapshot:
            return self._assign(req, self.ranks[0])
        w, ru, ww, wr = self.waiting, self.running, self.w_wait, self.w_run
        best, best_score = self._start % n, None
        for k in range(n):
            j = (self._start + k) % n
            score = w[j] * ww + ru[j] * wr
            if best_score is None or score < best_score:
                best, best_score = j, score
        w[best] += self.bump
        return self._assign(req, self.ranks[best])

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        return self._assign(req, rank, "explicit")


class VllmDPLB(_SeqMixin):
    """vLLM's internal DP load balancer as the current code is: ``DPLBAsyncMPClient``
    (vllm/v1/engine/core_client.py, ``get_core_engine_for_request``), one per api-server.

    * Score of engine i = ``max(client_count × inflight_i, waiting_i + running_i)`` plus, when
      ``waiting_i > 0``, ``waiting_i × 6 × max(0, kv_usage_i − 0.5)`` (PR #49204, which also
      propagates KV usage through the coordinator). ``inflight_i`` is this api-server's EXACT
      count of its own unfinished requests on engine i (``engine_inflight``: +1 at dispatch,
      −1 when the engine's output lists the request as finished) — it survives view
      replacement. Lowest score wins with a strict ``<``.
    * Scan start ``(engines × client_index) // client_count``, then rotated by one after every
      decision (``eng_start_index``, PR #47420).
    * After a pick the chosen engine's local waiting gets ``+client_count`` (#21617); every
      coordinator message replaces the whole local view (waiting, running, kv usage), bumps
      included. Before the first message the counts are zeros (#22910).
    * Engines publish (waiting, running) when changed, before and after each step (#41626,
      ``_maybe_publish_request_counts``); the coordinator (vllm/v1/engine/coordinator.py)
      forwards a view every ``stats_update_interval_ms`` (100 ms) while stats change. The
      simulator's ranks report at the end of each step only (its step aggregator takes one
      report a rank a step), so this view can trail vLLM's by up to one step.

    The simulator must call :meth:`note_finished` when a request this api-server dispatched
    finishes (the api-server sees it in the output stream at once).
    """

    name = "vllm"

    def __init__(self, *, dispatcher_id: str, num_api_servers: int = 1, client_mode: bool = True,
                 ranks: list[int], client_index: int = 0, kv_penalty: float = 6.0,
                 kv_knee: float = 0.5, rotate: bool = True) -> None:
        self.dispatcher_id = dispatcher_id
        self.client_count = max(1, num_api_servers)
        self.kv_penalty, self.kv_knee, self.rotate = kv_penalty, kv_knee, rotate
        self._seqs: dict[int, int] = {}
        self._where: dict[str, int] = {}        # request id -> rank index (reqs_in_flight)
        self.set_ranks(ranks)
        self._start = (len(self.ranks) * client_index) // self.client_count
        self.have_snapshot = False

    def set_ranks(self, ranks: list[int]) -> None:
        old = getattr(self, "ranks", [])
        old_inflight = dict(zip(old, getattr(self, "inflight", [])))
        self.ranks = sorted(ranks)
        self._index = {r: j for j, r in enumerate(self.ranks)}
        self.waiting = [0] * len(self.ranks)
        self.running = [0] * len(self.ranks)
        self.kv_usage = [0.0] * len(self.ranks)
        self.inflight = [old_inflight.get(r, 0) for r in self.ranks]

    def on_snapshot(self, snap: Snapshot) -> None:
        for j, r in enumerate(self.ranks):
            st = snap.ranks.get(r)
            if st is not None:
                self.waiting[j], self.running[j] = st.waiting, st.running
                self.kv_usage[j] = st.kv_usage
        self.have_snapshot = True

    def score(self, j: int) -> float:
        w = self.waiting[j]
        s: float = max(self.client_count * self.inflight[j], w + self.running[j])
        if w:
            s += w * self.kv_penalty * max(0.0, self.kv_usage[j] - self.kv_knee)
        return s

    def choose(self, req: RequestInfo, now: float) -> Assignment:
        n = len(self.ranks)
        best, best_score = 0, math.inf
        for k in range(n):
            j = (self._start + k) % n
            sc = self.score(j)
            if sc < best_score:
                best, best_score = j, sc
        self.waiting[best] += self.client_count
        if self.rotate:
            self._start = (self._start + 1) % n
        return self._record(req, best)

    def _record(self, req: RequestInfo, j: int, reason: str = "dispatch") -> Assignment:
        self._where[req.id] = j
        self.inflight[j] += 1
        return self._assign(req, self.ranks[j], reason)

    def note_finished(self, request_id: str, now: float = 0.0) -> None:
        j = self._where.pop(request_id, None)
        if j is not None and j < len(self.inflight) and self.inflight[j] > 0:
            self.inflight[j] -= 1

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        j = self._index.get(rank)
        if j is None:
            return self._assign(req, rank, "explicit")
        return self._record(req, j, "explicit")


class SglangDP(_SeqMixin):
    """SGLang's DP controller with ``total_requests`` or ``total_tokens``: ``DPBudget`` in
    python/sglang/srt/managers/data_parallel_controller.py (one controller process).

    * ``update_budget``: per rank, a load snapshot whose timestamp equals the last one seen is
      SKIPPED (the local bumps on that rank survive); otherwise total_requests = running +
      waiting and total_tokens = ``num_total_tokens`` replace the local values.
    * ``dispatch``: total_requests → first rank with the fewest requests
      (``list.index(min)``); total_tokens → ``min`` over (tokens, requests), lowest rank on
      ties. Then +1 request and +prompt tokens (``estimated_tokens``, #22614) on the chosen
      rank.
    * ``refresh_load_budget``: the controller re-reads the snapshots at most every 20 ms,
      before a dispatch (spec ``snapshot_interval_s=0.02``).

    The snapshot timestamp is ``RankStats.t``; a rank that did not republish (see
    :class:`SglangPublishFilter`) keeps its old ``t``.
    """

    def __init__(self, *, dispatcher_id: str, num_api_servers: int = 1, client_mode: bool = False,
                 ranks: list[int], metric: str = "requests") -> None:
        if metric not in ("requests", "tokens"):
            raise ValueError("metric is 'requests' or 'tokens'")
        self.dispatcher_id = dispatcher_id
        self.metric = metric
        self.name = f"sglang_total_{metric}"
        self._seqs: dict[int, int] = {}
        self.set_ranks(ranks)

    def set_ranks(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)
        self.requests = [0] * len(self.ranks)
        self.tokens = [0] * len(self.ranks)
        self.last_t = [None] * len(self.ranks)
        self.skipped = 0

    @property
    def load(self) -> list[int]:
        return self.requests if self.metric == "requests" else self.tokens

    def on_snapshot(self, snap: Snapshot) -> None:
        for j, r in enumerate(self.ranks):
            st = snap.ranks.get(r)
            if st is None:
                continue
            if self.last_t[j] is not None and st.t == self.last_t[j]:
                self.skipped += 1
                continue
            self.last_t[j] = st.t
            self.requests[j] = st.waiting + st.running
            self.tokens[j] = int(st.extra.get("tokens", st.outstanding))

    def choose(self, req: RequestInfo, now: float) -> Assignment:
        if self.metric == "requests":
            j = self.requests.index(min(self.requests))
        else:
            j = min(range(len(self.ranks)), key=lambda i: (self.tokens[i], self.requests[i]))
        self.requests[j] += 1
        self.tokens[j] += req.prompt_tokens
        return self._assign(req, self.ranks[j])

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        return self._assign(req, rank, "explicit")


class SglangPublishFilter:
    """A SGLang rank republishes its load on a prefill, on an idle transition, or every
    ``every`` decode iterations; in between the controller reads the old snapshot, with its
    old timestamp ``t`` (so :class:`SglangDP` skips it and keeps its local bumps)."""

    def __init__(self, every: int = 15) -> None:
        self.every = every
        self._last: dict[int, RankStats] = {}
        self._since: dict[int, int] = {}
        self._idle: dict[int, bool] = {}

    def __call__(self, stats: list[RankStats]) -> list[RankStats]:
        out = []
        for st in stats:
            r = st.rank
            idle = st.scheduled == 0
            since = self._since.get(r, self.every)
            last = self._last.get(r)
            if last is None or st.prefill > 0 or idle != self._idle.get(r) or since + 1 >= self.every:
                self._last[r] = st
                self._since[r] = 0
                self._idle[r] = idle
                out.append(st)
                continue
            self._since[r] = since + 1
            out.append(RankStats(r, st.wave, st.step, last.waiting, last.running, st.scheduled,
                                 st.prefill, st.decode, last.kv_used, last.kv_total,
                                 last.outstanding, st.idle, st.dur_ms, last.t, st.finished,
                                 st.held, st.recv, last.extra))
        return out


class FastDeployBatcher(_SeqMixin):
    """FastDeploy staggered batch scheduling — a model of an UNMERGED pull request
    (PaddlePaddle/FastDeploy #5558, continued as #6359), reconstructed by us: the external
    scheduler's sizing policy was never published, so the batching rule below (release when
    every rank can get one request, or ``window_s`` after the oldest, after
    ``FD_EP_BATCHED_TOKEN_TIMEOUT``=0.1 s; even split by count) is ours. The engines' batch
    gate (hold a batch's prefill until it arrived on every rank or rank 0's 500 ms
    ``FD_RECV_BATCH_TIMEOUT`` fires) is the spec's ``gate=("batch", 0.5)``.
    Never a goal reference: it is labeled ``fastdeploy_staggered_pr``."""

    name = "fastdeploy_staggered_pr"

    def __init__(self, *, dispatcher_id: str, num_api_servers: int = 1, client_mode: bool = False,
                 ranks: list[int], window_s: float = 0.1) -> None:
        self.dispatcher_id = dispatcher_id
        self.window_s = window_s
        self._seqs: dict[int, int] = {}
        self._unplaced: list[tuple[RequestInfo, float]] = []
        self._n = 0
        self._rot = 0
        self.set_ranks(ranks)

    def set_ranks(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)

    def on_snapshot(self, snap: Snapshot) -> None:
        pass  # the external scheduler's use of rank reports was not published

    def submit(self, req: RequestInfo, now: float) -> list[Assignment]:
        self._unplaced.append((req, now))
        if len(self._unplaced) >= len(self.ranks):
            return self._release()
        return []

    def poll(self, now: float) -> list[Assignment]:
        if self._unplaced and now >= self._unplaced[0][1] + self.window_s:
            return self._release()
        return []

    def next_deadline(self) -> float | None:
        return self._unplaced[0][1] + self.window_s if self._unplaced else None

    def _release(self) -> list[Assignment]:
        batch, self._unplaced = self._unplaced, []
        self._n += 1
        bid = f"{self.dispatcher_id}-fd{self._n}"
        m = len(self.ranks)
        where = [self.ranks[(self._rot + k) % m] for k in range(len(batch))]
        self._rot = (self._rot + len(batch)) % m
        counts = [0] * (self.ranks[-1] + 1)
        for r in where:
            counts[r] += 1
        ct = tuple(counts)
        return [self._assign(req, r, "batch", batch=bid, batch_counts=ct) for (req, _), r in zip(batch, where)]

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        return self._assign(req, rank, "explicit")


# ----------------------------------------------------------------------------- specs

Factory = Callable[..., Any]   # (dispatcher_id, client_index, num_api_servers, client_mode, ranks, block_size)


@dataclass(frozen=True)
class PolicySpec:
    name: str
    factory: Factory
    client_mode: bool = False            # every api-server decides from its own view
    snapshot_interval_s: float = 0.0     # aggregator min_interval_s (publication cadence)
    view_delay: bool = True              # False: the view is exchanged inside the step (TRT-LLM)
    publish_filter: Callable[[], Any] | None = None
    gate: tuple = ()                     # lockstep / FastDeploy engine batch gate: ("batch", timeout_s)
    group_gate: Callable[[], Any] | None = None   # factory of a peer_gates.GroupGate
    late_binding: bool = False           # requests wait in the policy; bind() at every step boundary
    with_tokens: bool = False            # ranks report extra["tokens"]
    step_budget: dict | None = None      # engine-side per-step token alignment (BudgetConfig kwargs)
    lockstep: bool = False               # one of lockstep's own policies
    default_dispatch: str = "scheduler"  # the system's own deployment: "scheduler" | "client"
    reference: bool = True               # False: a reconstruction of unmerged work, never a goal
    source: str = ""


def _lockstep(name: str, **extra: Any) -> Factory:
    def make(*, dispatcher_id: str, client_index: int, num_api_servers: int, client_mode: bool,
             ranks: list[int], block_size: int, step_tokens: int = 2048, max_seqs: int = 0, **params: Any) -> Any:
        kw = {**extra, **params}
        if name == "staggered":
            kw.setdefault("block_size", block_size)
        if name == "waterfill":   # what the scheduler learns from the ranks' info: their step size and slots
            kw.setdefault("level_tokens", level_for([step_tokens]))
            kw.setdefault("max_seqs", max_seqs)
        return make_policy(name, dispatcher_id=dispatcher_id, num_api_servers=num_api_servers,
                           client_mode=client_mode, ranks=list(ranks), **kw)
    make.policy_class = policy_class(name)   # type: ignore[attr-defined] - --param's checks (runner.py)
    return make


def _cls(cls: type, **extra: Any) -> Factory:
    def make(*, dispatcher_id: str, client_index: int, num_api_servers: int, client_mode: bool,
             ranks: list[int], block_size: int, step_tokens: int = 2048, max_seqs: int = 0, **params: Any) -> Any:
        kw = {**extra, **params}
        if cls in (VllmDPLB, VllmDPLBLegacy):
            kw["client_index"] = client_index
        return cls(dispatcher_id=dispatcher_id, num_api_servers=num_api_servers,
                   client_mode=client_mode, ranks=list(ranks), **kw)
    make.policy_class = cls   # type: ignore[attr-defined] - --param's checks (runner.py)
    return make


def policy_specs(lockstep_gate_timeout_s: float = 0.1) -> dict[str, PolicySpec]:
    specs = [
        PolicySpec("round_robin", _lockstep("round_robin"), lockstep=True,
                   source="lockstep shared/policy/dispatch.py RoundRobin"),
        PolicySpec("vllm_pre_21617",
                   _cls(VllmDPLBLegacy, bump=1, rank0_before_first_snapshot=True),
                   client_mode=True, snapshot_interval_s=0.1, default_dispatch="client",
                   source="vLLM vllm/v1/engine/core_client.py DPLBAsyncMPClient before "
                          "#21617/#22910: waiting*4+running, fixed scan start, +1 bump, "
                          "100 ms coordinator view, rank 0 before the first view"),
        PolicySpec("vllm", _cls(VllmDPLB), client_mode=True, snapshot_interval_s=0.1,
                   default_dispatch="client",
                   source="vLLM vllm/v1/engine/core_client.py DPLBAsyncMPClient."
                          "get_core_engine_for_request (current): max(clients*inflight, "
                          "waiting+running) + waiting*6*max(0, kv-0.5) (#49204), scan start "
                          "rotates per decision (#47420), +client_count bump, view replaced "
                          "by each coordinator message (coordinator.py, 100 ms); counts "
                          "published after each step (vLLM also before it, #41626)"),
        PolicySpec("sglang_total_requests", _cls(SglangDP, metric="requests"),
                   snapshot_interval_s=0.02, publish_filter=SglangPublishFilter,
                   source="SGLang python/sglang/srt/managers/data_parallel_controller.py "
                          "DPBudget total_requests: skip unchanged snapshot timestamps, "
                          "index(min), +1 bump, refresh <= 20 ms"),
        PolicySpec("sglang_total_tokens", _cls(SglangDP, metric="tokens"),
                   snapshot_interval_s=0.02, publish_filter=SglangPublishFilter, with_tokens=True,
                   source="SGLang data_parallel_controller.py DPBudget total_tokens: skip "
                          "unchanged timestamps, min by (tokens, requests), +1 / +prompt "
                          "bump (#22614), refresh <= 20 ms"),
        PolicySpec("sglang_prefill_delayer", _cls(SglangDP, metric="tokens"),
                   snapshot_interval_s=0.02, publish_filter=SglangPublishFilter, with_tokens=True,
                   group_gate=lambda: PrefillDelayer(),
                   source="SGLang DPBudget total_tokens + python/sglang/srt/managers/"
                          "prefill_delayer.py PrefillDelayer (all/none -> prefill, mixed -> "
                          "delay up to max_delay_passes=30, watermark off by default)"),
        PolicySpec("trtllm_adp_balance", _cls(TrtllmAdpRouter), view_delay=False,
                   late_binding=True, group_gate=lambda: AdpBalanceGate(50, 10),
                   source="TensorRT-LLM tensorrt_llm/_torch/pyexecutor/executor_request_queue.py "
                          "global queue (take <= ranks*max_active - active) + DefaultADPRouter "
                          "heap on (prompt tokens, requests), longest first, cap "
                          "ceil(total/ranks); py_executor.py _balance_adp_requests "
                          "timeout_iters=50, batching_wait_iters=10"),
        PolicySpec("trtllm_adp_ctx_wait", _cls(TrtllmAdpRouter), view_delay=False,
                   late_binding=True, group_gate=lambda: AdpBalanceGate(50, 0),
                   source="TensorRT-LLM global queue + DefaultADPRouter + _balance_adp_requests "
                          "with timeout_iters=50, batching_wait_iters=0: the ADP Balance blog's "
                          "'context wait' row (blog 10)"),
        PolicySpec("trtllm_adp_placement_only", _cls(TrtllmAdpRouter), view_delay=False,
                   late_binding=True,
                   source="TensorRT-LLM executor_request_queue.py global queue + "
                          "DefaultADPRouter placement, ADP Balance off (its default)"),
        PolicySpec("fastdeploy_staggered_pr", _cls(FastDeployBatcher), gate=("batch", 0.5),
                   reference=False,
                   source="FastDeploy UNMERGED PR #5558 -> #6359, reconstructed by us (sizing "
                          "unpublished): even split by count, engine batch gate with rank 0's "
                          "500 ms FD_RECV_BATCH_TIMEOUT; never a goal reference"),
        PolicySpec("least_score", _lockstep("least_score"), lockstep=True,
                   source="lockstep shared/policy/dispatch.py LeastScore"),
        PolicySpec("least_tokens", _lockstep("least_tokens"), lockstep=True,
                   source="lockstep shared/policy/dispatch.py LeastTokens"),
        PolicySpec("staggered", _lockstep("staggered"), lockstep=True,
                   gate=("batch", lockstep_gate_timeout_s),
                   source="lockstep shared/policy/staggered.py StaggeredBatcher + engine gate"),
        PolicySpec("aligned", _lockstep("least_tokens"), lockstep=True, step_budget={},
                   source="lockstep LeastTokens + per-step token budget (step_budget.py)"),
        PolicySpec("staggered_aligned", _lockstep("staggered"), lockstep=True,
                   gate=("batch", lockstep_gate_timeout_s), step_budget={},
                   source="lockstep StaggeredBatcher + engine gate + per-step token budget"),
        PolicySpec("waterfill", _lockstep("waterfill"), lockstep=True,
                   step_budget={"min_balance": 0.9, "max_capped_steps": 32, "step_ms": 0.0, "max_delay_ms": 3000.0},
                   source="lockstep WaterFill (late-binding prefill placement) + coordinated prefill budget"),
        _default_spec(),
    ]
    return {s.name: s for s in specs}


def _default_spec() -> PolicySpec:
    """What ``lockstep up`` runs with no flags: the scheduler's and the engines' settings
    defaults (shared/settings.py), so this entry can never drift from the product."""
    from services.engine_worker.step_budget import from_settings as budget_from_settings
    from shared.settings import EngineSettings, SchedulerSettings
    sched = SchedulerSettings()
    pol = sched.policy
    eng = EngineSettings(time_scale=1.0)   # the simulator's device is its own: no slow motion to follow
    cfg = budget_from_settings(eng)
    # max_tokens comes from the simulated profile's engine, like every other entry's
    budget = None if cfg is None else {k: v for k, v in dataclasses.asdict(cfg).items() if k != "max_tokens"}
    gate = ("batch", eng.gate_timeout_ms / 1000.0) if pol == "staggered" else ()
    what = f"{pol} placement" + (" + coordinated prefill in the engines" if budget is not None else "")
    placement = sched.waterfill_kwargs() if pol == "waterfill" else {}
    return PolicySpec("default", _lockstep(pol, **placement), lockstep=True, gate=gate, step_budget=budget,
                      source=f"what `lockstep up` runs with no flags: {what} (shared/settings.py defaults)")


POLICY_NAMES: tuple[str, ...] = tuple(policy_specs())
