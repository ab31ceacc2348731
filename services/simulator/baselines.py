"""The policies the simulator compares, each with its real parameters (facts from
/work/shared/PEERS.md, the peers' public code and docs; our own code).

A :class:`PolicySpec` says how a policy is deployed, not only how it picks: who decides
(one scheduler, or every api-server from its own view), how often the load view is
refreshed and how stale it is, and which gate the engines apply. lockstep's own policies
are built through ``shared.policy.registry.make_policy`` (the objects the services run);
the baselines whose logic differs are the small classes below, implementing the same
protocols (shared/policy/base.py).

==========================  ================================================================
name                        model
==========================  ================================================================
round_robin                 lockstep's RoundRobin (make_policy), one scheduler.
vllm_pre_21617              vLLM internal DP LB before PR #21617: every api-server decides
                            (client mode); coordinator publishes every 100 ms
                            (aggregator ``min_interval_s=0.1``); after a pick the api-server
                            adds **+1** to that engine's local waiting, and each published
                            view replaces all local bumps; score waiting×4 + running, strict
                            ``<`` scan from ``(engines × client_index) // clients``; before the
                            first view everything goes to rank 0 (#22910).
vllm                        vLLM after #21617 (and #22910): step-consistent snapshot,
                            published every 100 ms; bump **+client_count** (the number of
                            api-servers); same score and scan; zeros before the first view.
sglang_total_requests       SGLang DP controller ``total_requests``: one controller, load =
                            waiting + running, refreshed at most every 20 ms (aggregator
                            ``min_interval_s=0.02``); a rank republishes its load only on a
                            prefill, on an idle transition or every 15 decode iterations;
                            +1 request bump between refreshes; ``min`` picks the lowest rank
                            on ties.
sglang_total_tokens         same, load = tokens held (KV context of running requests +
                            prompt tokens waiting), bump +prompt tokens.
trtllm_adp_balance          TensorRT-LLM attention-DP: requests go to the rank with the fewest
                            active requests (exact counts all-gathered at the step, no
                            staleness, +1 per placement), plus ADP Balance in the engines:
                            ``timeout_iters=50``, ``batching_wait_iters=10`` (the
                            AttentionDpConfig defaults).
fastdeploy_staggered        FastDeploy PR #5558/#6359: an external scheduler groups requests
                            into batches and splits each evenly by count over the ranks (its
                            sizing policy was not published: we release a batch when every
                            rank can get one request or 100 ms after the oldest, after
                            ``FD_EP_BATCHED_TOKEN_TIMEOUT``=0.1 s); the engines hold a batch's
                            prefill until it arrived on every rank or rank 0's 500 ms timer
                            (``FD_RECV_BATCH_TIMEOUT``) fires.
least_score                 lockstep's LeastScore (vLLM score, exact reconciliation by seq),
                            one scheduler, a snapshot every step.
least_tokens                lockstep's LeastTokens (outstanding tokens), one scheduler.
staggered                   lockstep's StaggeredBatcher (water-filling batches) + the engine
                            batch gate (timeout ``lockstep_gate_timeout_ms``).
==========================  ================================================================

Not modeled (documented simplifications): vLLM's 32-step wave all-reduce (our group pauses as
soon as no rank has work, for every policy); the 5 s heartbeat; vLLM's mixed-step views
(in the simulator all ranks report the same step at the same instant, so the pre-#21617
view is only staler and bumped less, not inconsistent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shared.policy.base import Assignment, RequestInfo
from shared.policy.registry import make_policy
from shared.stats import RankStats, Snapshot


class _SeqMixin:
    """Per-(dispatcher, rank) sequence numbers, as every Assignment must carry."""

    dispatcher_id: str

    def _assign(self, req: RequestInfo, rank: int, reason: str = "dispatch", **kw: Any) -> Assignment:
        seq = self._seqs.get(rank, 0) + 1
        self._seqs[rank] = seq
        return Assignment(request_id=req.id, rank=rank, reason=reason,
                          dispatcher=self.dispatcher_id, seq=seq, **kw)


class VllmDPLB(_SeqMixin):
    """vLLM's api-server side DP load balancer (one instance per api-server)."""

    name = "vllm"

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


class SglangDP(_SeqMixin):
    """SGLang's DP controller with ``total_requests`` or ``total_tokens``."""

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
        self.load = [0] * len(self.ranks)

    def on_snapshot(self, snap: Snapshot) -> None:
        for j, r in enumerate(self.ranks):
            st = snap.ranks.get(r)
            if st is None:
                continue
            if self.metric == "requests":
                self.load[j] = st.waiting + st.running
            else:
                self.load[j] = int(st.extra.get("tokens", st.outstanding))

    def choose(self, req: RequestInfo, now: float) -> Assignment:
        load = self.load
        j = load.index(min(load))
        load[j] += 1 if self.metric == "requests" else req.prompt_tokens
        return self._assign(req, self.ranks[j])

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        return self._assign(req, rank, "explicit")


class SglangPublishFilter:
    """A SGLang rank republishes its load on a prefill, on an idle transition, or every
    ``every`` decode iterations; in between the controller keeps the old values."""

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
                                 last.outstanding, st.idle, st.dur_ms, st.t, st.finished,
                                 st.held, st.recv, last.extra))
        return out


class TrtllmAdpDispatch(_SeqMixin):
    """TensorRT-LLM attention-DP request placement: fewest active requests wins (lowest
    rank on ties), counts exchanged every step, +1 per placement until the next step."""

    name = "trtllm_adp_balance"

    def __init__(self, *, dispatcher_id: str, num_api_servers: int = 1, client_mode: bool = False,
                 ranks: list[int]) -> None:
        self.dispatcher_id = dispatcher_id
        self._seqs: dict[int, int] = {}
        self.set_ranks(ranks)

    def set_ranks(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)
        self.active = [0] * len(self.ranks)

    def on_snapshot(self, snap: Snapshot) -> None:
        for j, r in enumerate(self.ranks):
            st = snap.ranks.get(r)
            if st is not None:
                self.active[j] = st.waiting + st.running

    def choose(self, req: RequestInfo, now: float) -> Assignment:
        a = self.active
        j = a.index(min(a))
        a[j] += 1
        return self._assign(req, self.ranks[j])

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        return self._assign(req, rank, "explicit")


class FastDeployBatcher(_SeqMixin):
    """FastDeploy's external batch scheduler (sizing unpublished; see the module table)."""

    name = "fastdeploy_staggered"

    def __init__(self, *, dispatcher_id: str, num_api_servers: int = 1, client_mode: bool = False,
                 ranks: list[int], window_s: float = 0.1) -> None:
        self.dispatcher_id = dispatcher_id
        self.window_s = window_s
        self._seqs: dict[int, int] = {}
        self._held: list[tuple[RequestInfo, float]] = []
        self._n = 0
        self._rot = 0
        self.set_ranks(ranks)

    def set_ranks(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)

    def on_snapshot(self, snap: Snapshot) -> None:
        pass  # the external scheduler's use of rank reports was not published

    def submit(self, req: RequestInfo, now: float) -> list[Assignment]:
        self._held.append((req, now))
        if len(self._held) >= len(self.ranks):
            return self._release()
        return []

    def poll(self, now: float) -> list[Assignment]:
        if self._held and now >= self._held[0][1] + self.window_s:
            return self._release()
        return []

    def next_deadline(self) -> float | None:
        return self._held[0][1] + self.window_s if self._held else None

    def _release(self) -> list[Assignment]:
        held, self._held = self._held, []
        self._n += 1
        bid = f"{self.dispatcher_id}-fd{self._n}"
        m = len(self.ranks)
        where = [self.ranks[(self._rot + k) % m] for k in range(len(held))]
        self._rot = (self._rot + len(held)) % m
        counts = [0] * (self.ranks[-1] + 1)
        for r in where:
            counts[r] += 1
        ct = tuple(counts)
        return [self._assign(req, r, "batch", batch=bid, batch_counts=ct) for (req, _), r in zip(held, where)]

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
    gate: tuple = ()                     # ("batch", timeout_s) | ("adp", timeout_iters, batching_wait_iters)
    with_tokens: bool = False            # ranks report extra["tokens"]
    step_budget: dict | None = None      # engine-side per-step token alignment (BudgetConfig kwargs)
    lockstep: bool = False               # one of lockstep's own policies
    source: str = ""


def _lockstep(name: str, **extra: Any) -> Factory:
    def make(*, dispatcher_id: str, client_index: int, num_api_servers: int, client_mode: bool,
             ranks: list[int], block_size: int, **params: Any) -> Any:
        kw = {**extra, **params}
        if name == "staggered":
            kw.setdefault("block_size", block_size)
        return make_policy(name, dispatcher_id=dispatcher_id, num_api_servers=num_api_servers,
                           client_mode=client_mode, ranks=list(ranks), **kw)
    return make


def _cls(cls: type, **extra: Any) -> Factory:
    def make(*, dispatcher_id: str, client_index: int, num_api_servers: int, client_mode: bool,
             ranks: list[int], block_size: int, **params: Any) -> Any:
        kw = {**extra, **params}
        if cls is VllmDPLB:
            kw["client_index"] = client_index
        return cls(dispatcher_id=dispatcher_id, num_api_servers=num_api_servers,
                   client_mode=client_mode, ranks=list(ranks), **kw)
    return make


def policy_specs(lockstep_gate_timeout_s: float = 0.1) -> dict[str, PolicySpec]:
    specs = [
        PolicySpec("round_robin", _lockstep("round_robin"), lockstep=True,
                   source="lockstep shared/policy/dispatch.py RoundRobin"),
        PolicySpec("vllm_pre_21617", _cls(VllmDPLB, bump=1, rank0_before_first_snapshot=True),
                   client_mode=True, snapshot_interval_s=0.1,
                   source="vLLM DP LB before #21617/#22910: 100 ms view, +1 bump, rank 0 first"),
        PolicySpec("vllm", _cls(VllmDPLB), client_mode=True, snapshot_interval_s=0.1,
                   source="vLLM DP LB after #21617: step-consistent 100 ms view, +client_count bump"),
        PolicySpec("sglang_total_requests", _cls(SglangDP, metric="requests"),
                   snapshot_interval_s=0.02, publish_filter=SglangPublishFilter,
                   source="SGLang DP controller total_requests, refresh <= 20 ms, +1 bump"),
        PolicySpec("sglang_total_tokens", _cls(SglangDP, metric="tokens"),
                   snapshot_interval_s=0.02, publish_filter=SglangPublishFilter, with_tokens=True,
                   source="SGLang DP controller total_tokens, refresh <= 20 ms, +prompt bump"),
        PolicySpec("trtllm_adp_balance", _cls(TrtllmAdpDispatch), view_delay=False,
                   gate=("adp", 50, 10),
                   source="TensorRT-LLM ADP Balance, timeout_iters=50, batching_wait_iters=10"),
        PolicySpec("fastdeploy_staggered", _cls(FastDeployBatcher), gate=("batch", 0.5),
                   source="FastDeploy #5558/#6359 batch gate, 500 ms timeout, even split"),
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
    ]
    return {s.name: s for s in specs}


POLICY_NAMES: tuple[str, ...] = tuple(policy_specs())
