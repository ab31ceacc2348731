"""``waterfill``: late-binding placement of prefill work (lockstep's default).

Near and above capacity, what a DP+EP group computes is mostly prefill, and a step with
prefill is balanced only when every rank has prefill to do in it. So a request is bound to
a rank as late as possible: when some rank's pending prefill (prompt tokens queued or
mid-prefill there, from the step-consistent snapshot, plus this dispatcher's sends the
snapshot does not show yet) is below ``level_tokens``, the oldest unplaced request goes to the
rank with the least pending prefill (water-filling); while every rank is above the level,
requests wait here unplaced, in arrival order, and each rank pulls more as it drains. With headroom
nothing waits beyond ``collect_s``: every rank is below the level, so a request is placed
within 2 ms, on the least loaded rank (TTFT first). The engines then cap each step at a
budget most ranks can fill (``BudgetConfig.min_balance``, services/engine_worker/step_budget.py).

Why ``level_tokens`` = 2 steps of prefill (2 x ``max_num_batched_tokens``): a rank must
still have a full step's prefill queued when the next snapshot and dispatch land (one step
plus two Redis hops later), or it idles through a step of prefill; more than that only
moves the queue from here, where any rank can take it, to one rank's inbox. The scheduler
follows the engines' step size (:func:`level_for` of what the ranks report in their info),
unless an operator set ``level_tokens``.

Arrivals together: an offline batch or a burst reaches the scheduler one request at a time,
and placed in arrival order each goes to the least loaded rank of the moment, so a long
prompt late in the batch lands on a rank that already got its share (tokens and counts 1.3x
the mean) and prefills alone at the end of the prefill phase while the others decode. So a new
request waits ``collect_s`` (2 ms) unplaced, and the requests that arrived within
``together_s`` (50 ms) of the oldest are then placed longest prompt first (the classic
longest-processing-time rule of makespan scheduling) -- only while they all fit in the
group's free sequence slots: beyond that, reordering would change which requests are served
first, not only how they spread. On ``offline`` (16 ranks, 1.0x) efficiency 0.972 -> 0.976,
on ``deepseek-v3-gb200`` 0.963 -> 0.990 with ITL p99 525 -> 143 ms; bursty TTFT p99 at 0.3x
2.49 -> 1.78 s; poisson and ramp within noise (docs/benchmarks.md, item 1).

Ties on pending prefill (most often: several ranks with none) go to the rank with the fewest
sequences (running, waiting, sent), a thousandth of a token each: its decodes are the step's
floor, so this evens the decode batches (32 ranks, onoff at load 1.0: the busiest rank's
decodes 12.5 -> 10.5 a step against a mean of 7.8).

Slots too: a rank whose sequence slots are all taken (``max_num_seqs``: running + waiting
there + this dispatcher's unseen sends) takes one more request to queue (``QUEUE_ROOM``) and
then nothing, whatever its pending prefill, until one frees: more would only wait behind its
full batch while another rank admits at once. That one queued request is what lets a full
group admit together: a rank starts it the step a slot frees, with no dispatch round trip,
and the queued prompts are the pending prefill the step budget sees, so a group whose every
slot is taken turns busy and starts them in shared steps. With none queued (all held here),
each freed slot started one prompt alone while the others decoded: on the ``blog`` workload
(``deepseek-v3-gb200``, 6,000 requests for 4,096 slots) 23,859 tok/s and TTFT p99 312 s,
against 26,184 tok/s and 233 s with one queued (26,123-26,333 tok/s and 229-231 s with 4-51
queued; on ``offline`` at 1.0x, 2,000 slots, 4 queued raised TTFT p99 from 5.5 to 6.3 s).
The scheduler learns each rank's ``max_num_seqs`` from its info (:meth:`set_max_seqs`).
KV the same way (where requests can wait here: the scheduler): a rank whose next waiting
request cannot start for want of KV blocks
(``kv_blocked`` in its report) takes nothing more until a report says it can, and then only
up to as many sequences as its KV held when it ran out, plus a few queued (:func:`kv_queue_room`;
``dispatch.kv_seqs_learned``, forgotten once its KV has clear room): more would wait behind
its full KV while another rank admits at once. Without it a group whose KV ran out before
its slots took every request onto the ranks' queues, where the api-servers'
``max_queue_wait_s`` never saw them: no 429, and TTFT of a minute behind a 3 s bound (a
torch probe: 2 ranks of 32 KV blocks, a burst of 300).

Bounds: a fresh view is trusted however long a request waits on it, since every rank
above the level or out of slots is exactly when sending it would only move the wait into
one rank's queue (on ``offline``, 2,500 / 3,100 requests for 2,048 slots: efficiency 0.931 /
0.952 -> 0.970 / 0.966 with this and the slot rule; releasing after 5 s whatever the view
said gave 0.958 / 0.952). A stale or missing one cannot strand a request: once no snapshot
has come for ``max_hold_s``, every request unplaced that long goes to the least loaded rank.
The unplaced queue is at most ``max_unplaced`` (then :class:`BatcherFull`: the caller leaves
the request on its stream; the api-servers' ``max_inflight`` bounds what reaches it). Pure:
no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from heapq import heapify, heappop
from typing import Any

from shared.policy.base import Assignment, RequestInfo
from shared.policy.dispatch import _LocalViewPolicy, _RankView
from shared.policy.staggered import BatcherFull
from shared.stats import Snapshot

LEVEL_STEPS = 2              # steps of prefill a rank holds (module docstring)
DEFAULT_STEP_TOKENS = 2048   # EngineSettings.max_num_batched_tokens' default: until a rank reports its own
FULL = 1e15                  # added to a full rank's score: above any level, below +inf (ties still rotate)
QUEUE_ROOM = 1              # requests a rank whose slots are all taken may still queue
COLLECT_S = 0.002            # an unplaced request waits this long for the requests arriving with it
TOGETHER_S = 0.05            # requests that arrived this close to the oldest are placed longest first
KV_QUEUE_SHARE = 8           # a rank out of KV may queue 1/8 of the sequences its KV held (at least QUEUE_ROOM)
SEQ_TIE_BREAK = 1e-3         # per sequence on the rank: equal pending prefill goes to the rank with fewer


def level_for(step_tokens: Iterable[Any] | None) -> int:
    """The level for engines whose steps take ``step_tokens`` tokens (the largest counts:
    every rank must still hold a full step); the default engine's while none is known."""
    known = [int(t) for t in step_tokens or () if t]
    return LEVEL_STEPS * (max(known) if known else DEFAULT_STEP_TOKENS)


def kv_queue_room(kv_seqs: int) -> int:
    """Requests a rank that ran out of KV may queue beyond what its KV held: one where it
    holds few (a burst of short prompts must not pile onto its queue, out of the admission
    bound's sight), an eighth where it holds many, so that it starts several the step
    several finish (ramp at 1.2 / 1.5x, seed 1: efficiency 0.952 / 0.947 with one queued,
    0.950 / 0.952 with an eighth, 0.954 / 0.950 without the KV rule; docs/benchmarks.md)."""
    return max(QUEUE_ROOM, kv_seqs // KV_QUEUE_SHARE)


class WaterFill(_LocalViewPolicy):
    name = "waterfill"

    def __init__(self, *, level_tokens: int = 4096, max_hold_s: float = 5.0, max_unplaced: int = 65536,
                 max_seqs: dict[int, int] | int | None = None, collect_s: float = COLLECT_S,
                 together_s: float = TOGETHER_S, **kw: Any) -> None:
        kw.pop("block_size", None)
        self._max_seqs: dict[int, int] = {}
        self._all_max_seqs = 0               # every rank's limit, where one number is given
        super().__init__(**kw)
        self.set_max_seqs(max_seqs)
        if level_tokens < 1 or max_hold_s < 0 or max_unplaced < 1 or collect_s < 0 or together_s < 0:
            raise ValueError("level_tokens and max_unplaced must be >= 1; max_hold_s, collect_s, together_s >= 0")
        self.level = float(level_tokens)
        self.max_hold_s = max_hold_s
        self.collect_s = min(collect_s, max_hold_s)   # the bound wins: nothing waits longer than max_hold_s
        self.together_s = together_s
        self.max_unplaced = max_unplaced
        self._queue: deque[tuple[RequestInfo, float]] = deque()
        self._queued_tokens = 0          # prompt tokens in _queue (the queue's ETA: scheduler/queue_eta.py)
        self._view_at = float("-inf")    # when this dispatcher first acted on its newest snapshot
        self._view_snaps = 0
        self.released = 0
        self.released_by_bound = 0
        self.hold_s_total = 0.0

    def set_level(self, level_tokens: int) -> None:
        """Follow the engines' step size (the scheduler learns it from the ranks' info)."""
        if level_tokens < 1:
            raise ValueError("level_tokens must be >= 1")
        self.level = float(level_tokens)

    def set_max_seqs(self, max_seqs: dict[int, int] | int | None) -> None:
        """Each rank's sequence slots (``{rank: max_num_seqs}``, one number for all, or None:
        unknown, never full)."""
        if isinstance(max_seqs, dict):
            self._max_seqs, self._all_max_seqs = {int(r): int(m) for r, m in max_seqs.items() if m}, 0
        else:
            self._max_seqs, self._all_max_seqs = {}, int(max_seqs or 0)
        if self._ranks:
            self._rescore()

    # ---------------------------------------------------------------- score
    def _amount(self, req: RequestInfo) -> float:
        return float(req.prompt_tokens)

    def _seqs(self, v: _RankView) -> float:
        """Sequences a rank holds in this view: running, waiting there, and unseen sends."""
        return v.running + v.waiting + len(v.unseen) * self.scale

    def _score(self, v: _RankView) -> float:
        return v.pending + v.unseen.amount * self.scale + SEQ_TIE_BREAK * self._seqs(v)

    def _free_slots(self) -> float:
        """Sequence slots free across the group, +inf while some rank's limit is unknown."""
        free = 0.0
        for rank in self._ranks:
            limit = self._max_seqs.get(rank, self._all_max_seqs)
            if not limit:
                return float("inf")
            free += max(0.0, limit - self._seqs(self._views[rank]))
        return free

    def _score_of(self, rank: int, v: _RankView) -> float:
        s = self._score(v)
        limit = self._max_seqs.get(rank, self._all_max_seqs)
        seqs = self._seqs(v)
        if (limit and seqs >= limit + QUEUE_ROOM) or (not self.client_mode and (v.kv_blocked or (
                v.kv_seqs is not None and seqs >= v.kv_seqs + kv_queue_room(v.kv_seqs)))):
            # slots (or the KV's sequences) taken and one queued: nothing until room frees. (KV
            # only where requests can wait here: an api-server places every request at once, and
            # on its older view turning from a rank out of KV only crowded the others: ramp at
            # 1.5x, client dispatch, 0.93 -> 0.87 of ideal)
            s += FULL
        return s

    # ---------------------------------------------------------------- batching protocol
    def submit(self, req: RequestInfo, now: float) -> list[Assignment]:
        if len(self._queue) >= self.max_unplaced:
            raise BatcherFull(f"waterfill: {len(self._queue)} requests unplaced (max_unplaced)")
        self._queue.append((req, now))
        self._queued_tokens += req.prompt_tokens
        return self._drain(now)

    def poll(self, now: float) -> list[Assignment]:
        return self._drain(now)

    def next_deadline(self) -> float | None:
        if not self._queue:
            return None
        t0 = self._queue[0][1]
        bound_at = max(t0, self._view_at) + self.max_hold_s
        if self.collect_s and self._scores and min(self._scores) < self.level:
            return min(t0 + self.collect_s, bound_at)   # some rank has room: place it once collected
        return bound_at

    def on_snapshot(self, snap: Snapshot) -> None:
        super().on_snapshot(snap)   # the caller polls after a snapshot: ranks may have drained

    def drop(self, request_id: str) -> bool:
        for k, (req, _) in enumerate(self._queue):
            if req.id == request_id:
                del self._queue[k]
                self._queued_tokens -= req.prompt_tokens
                return True
        return False

    @property
    def unplaced(self) -> int:
        return len(self._queue)

    @property
    def unplaced_tokens(self) -> int:
        """Prompt tokens of the unplaced requests."""
        return self._queued_tokens

    def oldest_unplaced(self) -> float | None:
        return self._queue[0][1] if self._queue else None

    def stats(self) -> dict[str, Any]:
        return {"unplaced": len(self._queue), "released": self.released,
                "released_by_bound": self.released_by_bound,
                "hold_ms_mean": self.hold_s_total / self.released * 1000.0 if self.released else None,
                "level_tokens": self.level, **self.counters()}

    # ---------------------------------------------------------------- placement
    def _drain(self, now: float) -> list[Assignment]:
        out: list[Assignment] = []
        q = self._queue
        n = len(self._ranks)
        if n == 0:
            return out
        if self.snapshots != self._view_snaps:    # the caller polls after every snapshot
            self._view_snaps, self._view_at = self.snapshots, now
        scores = self._scores
        stale = now >= self._view_at + self.max_hold_s
        while q:
            best = min(scores)
            req, t0 = q[0]
            bound = stale and now >= t0 + self.max_hold_s    # the very expression next_deadline returns
            if best >= self.level and not bound:
                break
            if bound:
                q.popleft()
                out.append(self._place(req, t0, now, by_bound=best >= self.level))
                continue
            if now < t0 + self.collect_s:
                break                                        # the requests arriving with it may not be here yet
            if self.together_s and len(q) > 1 and len(q) <= self._free_slots():
                self._place_longest_first(now, out)
                continue
            q.popleft()
            out.append(self._place(req, t0, now))
        return out

    def _place_longest_first(self, now: float, out: list[Assignment]) -> None:
        """Place the requests that arrived within ``together_s`` of the oldest, longest
        prompt first, while some rank is below the level (module docstring: arrivals together)."""
        q = self._queue
        cutoff = q[0][1] + self.together_s
        together: list[tuple[RequestInfo, float]] = []
        for entry in q:
            if entry[1] > cutoff:
                break
            together.append(entry)
        taken = [False] * len(together)
        # a heap, not a sort: most drains place a few of them (equal prompts: arrival order)
        heap = [(-req.prompt_tokens, k) for k, (req, _) in enumerate(together)]
        heapify(heap)
        while heap and min(self._scores) < self.level:
            k = heappop(heap)[1]
            req, t0 = together[k]
            out.append(self._place(req, t0, now))
            taken[k] = True
        for _ in range(len(together)):
            q.popleft()
        q.extendleft(reversed([e for e, t in zip(together, taken) if not t]))

    def _place(self, req: RequestInfo, t0: float, now: float, by_bound: bool = False) -> Assignment:
        n = len(self._ranks)
        i = self._pick(n)
        self._start = i + 1
        self.decisions += 1
        self.released += 1
        self.released_by_bound += int(by_bound)
        self.hold_s_total += now - t0
        self._queued_tokens -= req.prompt_tokens
        return self._record(req, self._ranks[i], i, now, "dispatch")
