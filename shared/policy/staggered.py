"""Staggered batches, scheduler side (policy ``staggered``): keep requests briefly and
release them as one batch, placed so that no rank ends up more loaded than it must and
tagged so the ranks start its prefill in the same step (the engine side: batch_gate.py).

Pure: the caller passes ``now`` (one monotonic time base), calls :meth:`poll` at
:meth:`next_deadline` and sends every returned Assignment to its rank's inbox. A request is
never kept past its window; nothing is dropped. Release rule, learned window, placement,
tags and bounds, with their figures: docs/architecture.md, "Staggered batcher".
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from shared.policy.base import Assignment, RequestInfo
from shared.policy.unseen import UnseenSends
from shared.stats import Snapshot

DEFAULT_WINDOW_MS = 50.0   # window before any step time is measured (about 2 steps of 25 ms)
STEP_EWMA_ALPHA = 0.2      # weight of a new step-time measurement
GAP_SAMPLES = 8            # inter-arrival gaps kept for the arrival-rate estimate (median)
MAX_GAP_S = 60.0           # a longer gap (idle) counts as this long
MIN_HOLD_MS = 1.0          # a window shorter than this is not worth a timer: release now
REASONS = ("full", "timeout", "wait_bound")


class BatcherFull(RuntimeError):
    """The unplaced queue is at ``max_unplaced`` (only possible while no rank is live)."""


@dataclass(slots=True)
class _Unplaced:
    req: RequestInfo
    t: float          # now at submit
    deadline: float   # t + window (seconds)
    clipped: bool     # window clipped by hard_max_wait_ms


class StaggeredBatcher:
    """Keep requests unplaced and release them in staggered batches (see the module docstring)."""

    name = "staggered"

    def __init__(
        self,
        *,
        dispatcher_id: str = "scheduler",
        num_api_servers: int = 1,
        client_mode: bool = False,
        ranks: Iterable[int] | None = None,
        max_wait_ms: float = 0.0,
        hard_max_wait_ms: float = 500.0,
        min_batch_per_rank: int = 1,
        block_size: int = 16,
        adaptive: bool = True,
        max_unplaced: int = 65536,
        max_pending: int = 65536,
        search_nodes: int = 4000,
    ) -> None:
        if hard_max_wait_ms < 0 or max_wait_ms < 0:
            raise ValueError("wait bounds must be >= 0")
        if min_batch_per_rank < 1:
            raise ValueError("min_batch_per_rank must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if max_unplaced < 1 or max_pending < 1:
            raise ValueError("max_unplaced and max_pending must be >= 1")
        self.dispatcher_id = dispatcher_id
        self.num_api_servers = max(1, int(num_api_servers))
        self.client_mode = client_mode
        self.max_wait_ms = float(max_wait_ms)
        self.hard_max_wait_ms = float(hard_max_wait_ms)
        self.min_batch_per_rank = int(min_batch_per_rank)
        self.block_size = int(block_size)
        self.adaptive = adaptive
        self.max_unplaced = int(max_unplaced)
        self.max_pending = int(max_pending)
        self.search_nodes = int(search_nodes)

        self._ranks: list[int] = []
        self._unplaced: deque[_Unplaced] = deque()   # requests waiting here for their batch
        self._unplaced_tokens = 0                     # their prompt tokens (the queue's ETA)
        self._min_deadline: float | None = None
        # per rank id
        self._unseen: dict[int, UnseenSends] = {}   # amount: cost, blocks: prompt blocks
        self._snap_load: dict[int, int] = {}
        self._snap_free: dict[int, int | None] = {}
        self._snap_seq = 0
        self._gaps: deque[float] = deque(maxlen=GAP_SAMPLES)
        self._last_arrival: float | None = None
        self._batch_n = 0
        self._rot = 0

        # counters (read by metrics / status)
        self.step_ms: float | None = None      # learned lockstep step time
        self.window_ms: float = self._base_ms()  # window given to the latest request
        self.batches_released = 0
        self.batches_by_reason: dict[str, int] = {r: 0 for r in REASONS}
        self.requests_released = 0             # requests released in batches
        self.explicit = 0                      # note_explicit calls
        self.hold_ms_last = 0.0
        self.hold_ms_max = 0.0
        self._hold_ms_sum = 0.0
        self.kv_overflow = 0                   # requests placed where no rank had KV room
        self.stale_snapshots = 0
        self.pending_evicted = 0               # sends assumed seen because of max_pending

        if ranks is not None:
            self.set_ranks(list(ranks))

    # ------------------------------------------------------------------ views
    @property
    def unplaced(self) -> int:
        return len(self._unplaced)

    @property
    def unplaced_tokens(self) -> int:
        """Prompt tokens of the unplaced requests."""
        return self._unplaced_tokens

    def oldest_unplaced(self) -> float | None:
        return self._unplaced[0].t if self._unplaced else None

    @property
    def hold_ms_mean(self) -> float:
        return self._hold_ms_sum / self.requests_released if self.requests_released else 0.0

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    @property
    def arrival_gap_ms(self) -> float | None:
        return statistics.median(self._gaps) * 1000.0 if self._gaps else None

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and ``lockstep status``."""
        return {
            "policy": self.name,
            "unplaced": self.unplaced,
            "window_ms": self.window_ms,
            "step_ms": self.step_ms,
            "arrival_gap_ms": self.arrival_gap_ms,
            "batches_released": self.batches_released,
            "batches_by_reason": dict(self.batches_by_reason),
            "requests_released": self.requests_released,
            "explicit": self.explicit,
            "hold_ms_last": self.hold_ms_last,
            "hold_ms_mean": self.hold_ms_mean,
            "hold_ms_max": self.hold_ms_max,
            "kv_overflow": self.kv_overflow,
            "stale_snapshots": self.stale_snapshots,
            "pending_evicted": self.pending_evicted,
        }

    def load(self, rank: int) -> int:
        """Estimated outstanding tokens of ``rank``: snapshot + unacknowledged sends."""
        bump = self.num_api_servers if self.client_mode else 1
        u = self._unseen.get(rank)
        return self._snap_load.get(rank, 0) + (bump * int(u.amount) if u else 0)

    def free_blocks(self, rank: int) -> int | None:
        """Estimated free KV blocks of ``rank``; None when unknown (unlimited)."""
        free = self._snap_free.get(rank)
        if free is None:
            return None
        u = self._unseen.get(rank)
        return free - (u.blocks if u else 0)

    def cost(self, req: RequestInfo) -> int:
        return max(0, req.prompt_tokens) + max(0, req.max_tokens)

    def blocks(self, req: RequestInfo) -> int:
        return -(-max(0, req.prompt_tokens) // self.block_size)

    # --------------------------------------------------------------- protocol
    def set_ranks(self, ranks: list[int]) -> None:
        """Live ranks. Call :meth:`poll` afterwards: fewer ranks can make a batch full."""
        self._ranks = sorted(set(int(r) for r in ranks))
        live = set(self._ranks)
        for r, u in self._unseen.items():
            if r not in live:
                u.clear()

    def on_snapshot(self, snap: Snapshot) -> None:
        if snap.seq and snap.seq < self._snap_seq:
            self.stale_snapshots += 1
            return
        self._snap_seq = max(self._snap_seq, snap.seq)
        durs = [s.dur_ms for s in snap.ranks.values() if s.dur_ms > 0]
        if durs:
            d = max(durs)
            self.step_ms = d if self.step_ms is None else (
                (1 - STEP_EWMA_ALPHA) * self.step_ms + STEP_EWMA_ALPHA * d)
        for r, s in snap.ranks.items():
            self._snap_load[r] = max(0, s.outstanding)
            self._snap_free[r] = max(0, s.kv_total - s.kv_used) if s.kv_total > 0 else None
            u = self._unseen.get(r)
            if u is not None:
                u.reconcile(s.recv.get(self.dispatcher_id, 0))

    def submit(self, req: RequestInfo, now: float) -> list[Assignment]:
        if len(self._unplaced) >= self.max_unplaced:
            raise BatcherFull(f"{len(self._unplaced)} requests unplaced and no rank to release to")
        if self._last_arrival is not None:
            gap = req.arrival - self._last_arrival
            self._gaps.append(min(max(gap, 0.0), MAX_GAP_S))
        self._last_arrival = req.arrival if self._last_arrival is None else max(
            self._last_arrival, req.arrival)
        raw = self._window_raw_ms(len(self._unplaced) + 1)
        w = min(raw, self.hard_max_wait_ms)
        self.window_ms = w
        h = _Unplaced(req, now, now + w / 1000.0, raw > self.hard_max_wait_ms)
        self._unplaced.append(h)
        self._unplaced_tokens += req.prompt_tokens
        if self._min_deadline is None or h.deadline < self._min_deadline:
            self._min_deadline = h.deadline
        return self._release_due(now)

    def poll(self, now: float) -> list[Assignment]:
        return self._release_due(now)

    def next_deadline(self) -> float | None:
        """Earliest time an unplaced request is due; a past time when a batch is already
        full; None when none waits or no rank is live (poll after :meth:`set_ranks`)."""
        if not self._unplaced or not self._ranks:
            return None
        if len(self._unplaced) >= self._full_size():
            return self._unplaced[0].t
        return self._min_deadline

    def drop(self, request_id: str) -> bool:
        """Forget an unplaced request (its client went away); True if it was here."""
        for h in self._unplaced:
            if h.req.id == request_id:
                self._unplaced.remove(h)
                self._unplaced_tokens -= h.req.prompt_tokens
                self._min_deadline = min((x.deadline for x in self._unplaced), default=None)
                return True
        return False

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        self.explicit += 1
        seq = self._record_send(rank, req)
        return Assignment(request_id=req.id, rank=rank, reason="explicit",
                          dispatcher=self.dispatcher_id, seq=seq)

    # ---------------------------------------------------------------- window
    def _base_ms(self) -> float:
        if self.max_wait_ms > 0:
            base = self.max_wait_ms
        elif self.step_ms is not None:
            base = 2.0 * self.step_ms
        else:
            base = DEFAULT_WINDOW_MS
        return base

    def _window_raw_ms(self, unplaced_after: int) -> float:
        """Window for a request arriving now with ``unplaced_after`` requests unplaced
        (itself included), before the hard cap."""
        base = self._base_ms()
        if not self.adaptive or not self._gaps:
            return base
        missing = max(0, self._full_size() - unplaced_after)
        fill_ms = missing * statistics.median(self._gaps) * 1000.0
        if fill_ms <= min(base, self.hard_max_wait_ms):
            return base
        clipped = min(base, self.hard_max_wait_ms)
        w = clipped * clipped / fill_ms
        return 0.0 if w < MIN_HOLD_MS else w

    # --------------------------------------------------------------- release
    def _full_size(self) -> int:
        return max(1, min(len(self._ranks) * self.min_batch_per_rank, self.max_unplaced))

    def _release_due(self, now: float) -> list[Assignment]:
        if not self._unplaced or not self._ranks:
            return []
        if len(self._unplaced) >= self._full_size():
            reason = "full"
        elif self._min_deadline is not None and now >= self._min_deadline:
            due = min(self._unplaced, key=lambda h: h.deadline)
            reason = "wait_bound" if due.clipped else "timeout"
        else:
            return []
        batch = list(self._unplaced)
        self._unplaced.clear()
        self._unplaced_tokens = 0
        self._min_deadline = None
        return self._release(batch, reason, now)

    def _release(self, batch: list[_Unplaced], reason: str, now: float) -> list[Assignment]:
        ranks = self._ranks
        reqs = [h.req for h in batch]
        where = self._place(reqs, ranks)
        self._batch_n += 1
        self._rot += 1
        bid = f"{self.dispatcher_id}-{self._batch_n}"
        counts = [0] * (ranks[-1] + 1)
        for r in where:
            counts[r] += 1
        ct = tuple(counts)
        out = []
        for h, r in zip(batch, where):
            free = self.free_blocks(r)
            if free is not None and free < self.blocks(h.req):
                self.kv_overflow += 1
            seq = self._record_send(r, h.req)
            out.append(Assignment(request_id=h.req.id, rank=r, batch=bid, batch_counts=ct,
                                  reason=reason, dispatcher=self.dispatcher_id, seq=seq))
            hold = max(0.0, (now - h.t) * 1000.0)
            self.hold_ms_last = hold
            self.hold_ms_max = max(self.hold_ms_max, hold)
            self._hold_ms_sum += hold
        self.requests_released += len(batch)
        self.batches_released += 1
        self.batches_by_reason[reason] += 1
        return out

    def _record_send(self, rank: int, req: RequestInfo) -> int:
        u = self._unseen.get(rank)
        if u is None:
            u = self._unseen[rank] = UnseenSends()
        seq = u.send(self.cost(req), self.blocks(req))
        while len(u.sends) > self.max_pending:
            u.drop_oldest()
            self.pending_evicted += 1
        return seq

    # --------------------------------------------------------------- sizing
    def _place(self, reqs: list[RequestInfo], ranks: list[int]) -> list[int]:
        """Rank for each request (same order as ``reqs``): LPT greedy, then a bounded search
        when it is not provably optimal (docs/architecture.md, "Staggered batcher")."""
        m, n = len(ranks), len(reqs)
        load0 = [self.load(r) for r in ranks]
        free0 = [self.free_blocks(r) for r in ranks]
        cost = [self.cost(q) for q in reqs]
        need = [self.blocks(q) for q in reqs]
        order = sorted(range(n), key=lambda i: (-cost[i], i))
        rot = self._rot % m

        # LPT greedy: least KV overflow added (0 on any rank with room), then least load;
        # ties rotate across batches. A lazy heap finds the least-loaded rank; only when it
        # lacks KV room are the other ranks looked at.
        load, used = list(load0), [0] * m
        inf = float("inf")
        room = [inf if f is None else f for f in free0]       # free blocks left
        rk = [(j - rot) % m for j in range(m)]
        heap = [(load[j], rk[j], j) for j in range(m)]        # stale if load moved
        heapq.heapify(heap)
        pick = [0] * n
        for i in order:
            while heap[0][0] != load[heap[0][2]]:
                heapq.heappop(heap)
            j, b = heap[0][2], need[i]
            if room[j] < b:
                top = max(room)
                if top >= b:                 # least-loaded rank with room
                    j = min((x for x in range(m) if room[x] >= b), key=lambda x: (load[x], rk[x]))
                elif top > 0:                # none has room: least overflow, then load
                    j = min((x for x in range(m) if room[x] == top),
                            key=lambda x: (load[x], rk[x]))
                # else: every rank overflows by b; keep the least-loaded one
            pick[i] = j
            load[j] += cost[i]
            used[j] += b
            room[j] -= b
            heapq.heappush(heap, (load[j], rk[j], j))

        over = sum(max(0, used[j] - free0[j]) for j in range(m) if free0[j] is not None)
        best = (over, max(load), sum(x * x for x in load))
        best_pick = list(pick)
        if (m > 1 and n > 1 and self.search_nodes > 0
                and best[:2] > (0, self._max_load_bound(load0, cost))):
            best, best_pick = self._search(order, cost, need, load0, free0, best, best_pick)
        return [ranks[best_pick[i]] for i in range(n)]

    @staticmethod
    def _max_load_bound(load0: list[int], cost: list[int]) -> int:
        """A lower bound on the largest load after placing ``cost``: the current maximum,
        the water level (pour all the work onto the least-loaded ranks), and the least
        loaded rank plus the largest request."""
        total = sum(cost)
        xs = sorted(load0)
        prefix = 0
        for k in range(1, len(xs) + 1):       # fill the k least-loaded ranks to one level
            prefix += xs[k - 1]
            if k == len(xs) or k * xs[k] - prefix >= total:
                level = -(-(total + prefix) // k)
                break
        return max(xs[-1], level, xs[0] + max(cost))

    def _search(self, order, cost, need, load0, free0, best, best_pick):
        """Bounded depth-first branch-and-bound over the LPT order. Every objective
        component only grows as requests are added, so a partial objective that is already
        no better than the best complete one prunes the subtree. The objective is kept
        incrementally (O(1) per tried placement); the budget counts tried placements plus
        ``m`` per node for ordering its children, so one batch costs O(search_nodes)."""
        m, n = len(load0), len(order)
        load, used = list(load0), [0] * m
        cur = [0] * len(cost)
        st = {"best": best, "pick": best_pick, "budget": self.search_nodes}
        over0 = sum(max(0, -f) for f in free0 if f is not None)
        sq0 = sum(x * x for x in load0)
        # The largest load can never end below the water level of all the work: a partial
        # placement is compared with max(its max, level), which prunes far more.
        level = -(-(sum(load0) + sum(cost)) // m)
        # ... and the KV overflow never below what the free blocks cannot hold. Once the
        # best placement reaches both bounds it is optimal on them: stop searching.
        over_lb = (max(0, sum(need) - sum(max(0, f) for f in free0)) + over0
                   if all(f is not None for f in free0) else over0)

        def dfs(k: int, over: int, mx: int, sq: int) -> None:
            if k == n:
                if (over, mx, sq) < st["best"]:
                    st["best"], st["pick"] = (over, mx, sq), list(cur)
                    if (over, mx) <= (over_lb, level):
                        st["budget"] = 0
                return
            st["budget"] -= m
            i = order[k]
            c, b = cost[i], need[i]
            seen: set[tuple[int, int, int | None]] = set()
            for j in sorted(range(m), key=load.__getitem__):
                if st["budget"] <= 0:
                    return
                sig = (load[j], used[j], free0[j])
                if sig in seen:        # interchangeable with a rank already tried
                    continue
                seen.add(sig)
                st["budget"] -= 1
                f = free0[j]
                d_over = 0 if f is None else (
                    max(0, used[j] + b - f) - max(0, used[j] - f))
                new = (over + d_over, max(mx, load[j] + c), sq + 2 * load[j] * c + c * c)
                if (new[0], max(new[1], level), new[2]) >= st["best"]:
                    continue
                load[j] += c
                used[j] += b
                cur[i] = j
                dfs(k + 1, *new)
                load[j] -= c
                used[j] -= b

        dfs(0, over0, max(load0), sq0)
        return st["best"], st["pick"]
