"""Immediate dispatch policies: ``round_robin``, ``least_score``, ``least_tokens``.

Each policy keeps a *local view* of every rank: the rank's stats from the last snapshot plus
the dispatches the snapshot does not show yet. Why this is exact rather than a guess:

* On a snapshot a policy drops exactly its own dispatches the snapshot shows and keeps
  the rest as local additions (seq/recv reconciliation, shared/policy/unseen.py). vLLM
  instead replaces its local bumps with each snapshot, forgetting what the engine has not
  picked up yet (``reconcile=False`` gives that behaviour, for baselines).
* The scheduler is normally the only decision maker, so its own dispatches are all the
  traffic there is: a local addition counts once. In ``client_mode`` each of
  ``num_api_servers`` api-servers chooses from the same published snapshot and cannot see
  the others' dispatches since it. With the traffic spread over api-servers by a
  front-end load balancer, each one's share is about 1/N of the total, so its own unseen
  dispatches times N estimate all unseen traffic: each local addition is scaled by
  ``num_api_servers`` (vLLM's ×client_count bump, #21617). Reconciliation still removes
  them exactly as their engines report them, so the guess only covers the gap between
  snapshots. ``local_scale`` overrides the factor (1.0 reproduces vLLM before #21617).
* Before the first snapshot the view is all local additions, so a burst spreads evenly
  instead of landing on rank 0 (vLLM #22910).
* Ties rotate: the scan starts one rank further after every decision, and the first rank
  with the lowest score from there wins, so repeated ties do not favour low ranks (vLLM
  #47420). The initial start is a stable hash of ``dispatcher_id`` so api-servers in client
  mode break their first ties differently.
* Local additions older than ``local_ttl_s`` are dropped on a snapshot: a bound for an
  engine that restarts (its recv resets) or never echoes recv. Age is judged on the
  dispatcher's own clock (the ``now`` of its decisions). None disables it.

A decision is O(ranks) but runs in C: per-rank scores live in a list kept up to date on
each decision (one rank) and each snapshot (all ranks), and ``min`` plus ``list.index``
find the winner. Pure: no I/O, no clock; ``now`` is passed in.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

from shared.policy.base import Assignment, RequestInfo
from shared.policy.unseen import UnseenSends
from shared.stats import Snapshot


KV_ROOM_USAGE = 0.9   # a rank whose KV is used below this, with nobody waiting, has room again


def kv_seqs_learned(known: int | None, st: Any) -> int | None:
    """How many sequences a rank's KV holds, as it last showed: its running count when a
    report says its queue's head waits for KV, raised as it runs more, forgotten once its
    KV has clear room with nobody waiting (its requests' lengths changed)."""
    if known is None:
        return st.running if st.kv_blocked else None
    if not st.kv_blocked and st.waiting == 0 and st.kv_usage < KV_ROOM_USAGE:
        return None
    return max(known, st.running)


class _RankView:
    """One rank as this dispatcher sees it: last snapshot values plus unseen dispatches."""

    __slots__ = ("waiting", "running", "kv_usage", "kv_blocked", "kv_seqs", "outstanding", "pending", "unseen")

    def __init__(self) -> None:
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0
        self.kv_blocked = False        # its queue's head waits for KV blocks
        self.kv_seqs: int | None = None   # sequences its KV held when it last ran out (None: never lately)
        self.outstanding = 0
        self.pending = 0               # prefill tokens not yet computed
        self.unseen = UnseenSends()    # its .amount: the local addition


class _LocalViewPolicy:
    """Shared machinery: rank set, local view, reconciliation, rotating scan."""

    name = ""

    def __init__(
        self,
        *,
        dispatcher_id: str = "scheduler",
        num_api_servers: int = 1,
        client_mode: bool = False,
        ranks: Iterable[int] | None = None,
        local_scale: float | None = None,
        reconcile: bool = True,
        local_ttl_s: float | None = 30.0,
    ) -> None:
        if num_api_servers < 1:
            raise ValueError("num_api_servers must be >= 1")
        self.dispatcher_id = dispatcher_id
        self.num_api_servers = num_api_servers
        self.client_mode = client_mode
        self.scale = float(local_scale if local_scale is not None else (num_api_servers if client_mode else 1))
        self.reconcile = reconcile
        self.local_ttl_s = local_ttl_s
        self._views: dict[int, _RankView] = {}
        self._ranks: list[int] = []
        self._scores: list[float] = []
        self._ranks_set_explicitly = ranks is not None
        self._start = zlib.crc32(dispatcher_id.encode())  # rotating scan start (mod len)
        self._snap_key: tuple[int, int] | None = None
        self._snap_seq = -1
        self._now = float("-inf")  # latest decision time seen: the clock local_ttl_s is judged on
        # counters
        self.decisions = 0
        self.explicit = 0
        self.snapshots = 0
        self.snapshots_ignored = 0
        self.reconciled = 0   # own dispatches found in a snapshot (dropped from the local view)
        self.expired = 0      # local additions dropped by local_ttl_s
        if ranks is not None:
            self._set_ranks(ranks)

    # ---------------------------------------------------------------- protocol

    def set_ranks(self, ranks: list[int]) -> None:
        """Live, non-drained ranks that may receive work. Views of the others are kept, so
        a rank coming back (or a drained one still reporting) stays reconciled."""
        self._ranks_set_explicitly = True
        self._set_ranks(ranks)

    def on_snapshot(self, snap: Snapshot) -> None:
        """Take the rank stats of a newer snapshot and keep only the own dispatches it does
        not show. Older or repeated snapshots (same key and seq) are ignored."""
        if self._snap_key is not None and snap.key <= self._snap_key and snap.seq <= self._snap_seq:
            self.snapshots_ignored += 1
            return
        self._snap_key, self._snap_seq = snap.key, snap.seq
        self.snapshots += 1
        me = self.dispatcher_id
        # judged on the dispatcher's own clock (the `now` of its decisions), never snap.t,
        # which another process stamped
        ttl_cut = self._now - self.local_ttl_s if self.local_ttl_s is not None else None
        for r, st in snap.ranks.items():
            v = self._views.get(r)
            if v is None:
                v = self._views[r] = _RankView()
            v.waiting, v.running, v.outstanding = st.waiting, st.running, st.outstanding
            v.pending = st.prefill_pending
            v.kv_usage, v.kv_blocked = st.kv_usage, st.kv_blocked
            v.kv_seqs = kv_seqs_learned(v.kv_seqs, st)
            q = v.unseen
            if not q.sends:
                continue
            if not self.reconcile:
                q.clear()
                continue
            seen, expired = q.reconcile(st.recv.get(me, 0), ttl_cut)
            self.reconciled += seen
            self.expired += expired
        if not self._ranks_set_explicitly:
            self._set_ranks(snap.ranks)
        else:
            self._rescore()

    def choose(self, req: RequestInfo, now: float) -> Assignment:
        """Pick the rank with the lowest score (ties: first from the rotating start)."""
        n = len(self._ranks)
        if n == 0:
            raise ValueError(f"{self.name}: no rank to dispatch to (no live, non-drained ranks set)")
        i = self._pick(n)
        self._start = i + 1
        self.decisions += 1
        return self._record(req, self._ranks[i], i, now, "dispatch")

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        """Record a client-pinned request exactly like a chosen one, so the view stays right.
        The rank may be outside the choosable set (e.g. drained); it is recorded anyway."""
        self.explicit += 1
        try:
            i = self._ranks.index(rank)
        except ValueError:
            i = -1
        return self._record(req, rank, i, now, "explicit")

    # ---------------------------------------------------------------- views for tests / status

    def local_load(self, rank: int) -> float:
        """Unscaled sum of this dispatcher's dispatches to ``rank`` not yet shown by a snapshot."""
        v = self._views.get(rank)
        return v.unseen.amount if v else 0.0

    def scores(self) -> dict[int, float]:
        return dict(zip(self._ranks, self._scores))

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (
            "decisions", "explicit", "snapshots", "snapshots_ignored", "reconciled", "expired")}

    # ---------------------------------------------------------------- policy hooks

    def _amount(self, req: RequestInfo) -> float:
        """What one request adds to a rank's local view (before scaling)."""
        return 1.0

    def _score(self, v: _RankView) -> float:
        raise NotImplementedError

    def _score_of(self, rank: int, v: _RankView) -> float:
        """``rank``'s score (a policy with per-rank limits overrides this)."""
        return self._score(v)

    def _pick(self, n: int) -> int:
        scores = self._scores
        best = min(scores)
        start = self._start % n
        try:
            return scores.index(best, start)
        except ValueError:
            return scores.index(best, 0, start)

    # ---------------------------------------------------------------- internals

    def _view(self, rank: int) -> _RankView:
        v = self._views.get(rank)
        if v is None:
            v = self._views[rank] = _RankView()
        return v

    def _set_ranks(self, ranks: Iterable[int]) -> None:
        self._ranks = sorted(set(ranks))
        for r in self._ranks:
            self._view(r)
        self._rescore()

    def _rescore(self) -> None:
        views, score = self._views, self._score_of
        self._scores = [score(r, views[r]) for r in self._ranks]

    def _record(self, req: RequestInfo, rank: int, i: int, now: float, reason: str) -> Assignment:
        if now > self._now:
            self._now = now
        v = self._view(rank)
        seq = v.unseen.send(self._amount(req), 0, now)
        if i >= 0:
            self._scores[i] = self._score_of(rank, v)
        return Assignment(request_id=req.id, rank=rank, reason=reason,
                          dispatcher=self.dispatcher_id, seq=seq)


class RoundRobin(_LocalViewPolicy):
    """Rotate over the live ranks, ignoring load. The local view is still kept (cheaply) so
    status output and a policy switch see the same numbers."""

    name = "round_robin"

    def _score(self, v: _RankView) -> float:
        return 0.0

    def _pick(self, n: int) -> int:
        return self._start % n


class LeastScore(_LocalViewPolicy):
    """vLLM's score: waiting×w_wait + running×w_run, lowest wins. Unseen dispatches count as
    waiting (×scale). With ``kv_penalty`` > 0 a rank whose KV cache is over half full is
    penalised by waiting×kv_penalty×(kv_usage−0.5), after vLLM #49204."""

    name = "least_score"

    def __init__(self, *, w_wait: float = 4.0, w_run: float = 1.0, kv_penalty: float = 0.0, **kw: Any) -> None:
        self.w_wait, self.w_run, self.kv_penalty = float(w_wait), float(w_run), float(kv_penalty)
        super().__init__(**kw)

    def _score(self, v: _RankView) -> float:
        waiting = v.waiting + v.unseen.amount * self.scale
        s = waiting * self.w_wait + v.running * self.w_run
        if self.kv_penalty > 0.0 and v.kv_usage > 0.5:
            s += waiting * self.kv_penalty * (v.kv_usage - 0.5)
        return s


class LeastTokens(_LocalViewPolicy):
    """SGLang's total_tokens: outstanding tokens on the rank (prompt not yet computed plus
    output still to come), plus prompt_tokens + max_tokens of each unseen dispatch (×scale)."""

    name = "least_tokens"

    def _amount(self, req: RequestInfo) -> float:
        return float(req.prompt_tokens + req.max_tokens)

    def _score(self, v: _RankView) -> float:
        return v.outstanding + v.unseen.amount * self.scale
