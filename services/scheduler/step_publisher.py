"""The step-consistent load view: read the engines' step reports (``<ns>:stats``), let the
aggregator finalize each step, and publish every finalized snapshot (``<ns>:steps``, the
``<ns>:snapshot`` hash and its channel) and hand it to the policy."""

from __future__ import annotations

import time
from typing import Any

from services.scheduler.state import SchedulerState
from shared import keys as K
from shared.bus import decode_entries
from shared.messages import FIELD, encode
from shared.rate_meter import RateMeter
from shared.stats import RankStats, Snapshot


def queue_wait_ms(policy: Any, now: float) -> int:
    """How long the longest-waiting unplaced request has waited here (0 when none): the
    api-servers answer 429 while it is above their ``max_queue_wait_s``."""
    oldest = getattr(policy, "oldest_unplaced", None)
    t = oldest() if oldest is not None else None
    return 0 if t is None else max(0, int((now - t) * 1000))


PLACEMENT_WINDOW_S = 5.0   # the placement rate behind the queue's ETA: steadier than a step, quicker than a trend


def queue_eta_ms(unplaced: int, placed_per_s: float, head_wait_ms: int) -> int:
    """How long a request arriving now would wait unplaced: what is ahead of it over the
    rate the ranks take it (measured; :class:`QueueEta` gives both in prompt tokens). This
    is the figure the api-servers' ``max_queue_wait_s`` bounds. The head's own wait (how long the oldest
    has waited) looks back: above capacity it passes the bound only after the queue holds
    more than the bound's worth, and falls back under it only once refusing every request
    has emptied the queue, so admission swung between all and nothing with TTFT at about
    twice the bound (the load probe, 2026-12-05). With under one unit placed in the
    measuring window (the ranks took nothing lately, or the rate is what is left of one
    from long ago) there is no rate to divide by: the head's wait is the figure, as before."""
    if unplaced <= 0:
        return 0
    if placed_per_s * PLACEMENT_WINDOW_S < 1.0:
        return head_wait_ms
    return int(unplaced / placed_per_s * 1000)


class QueueEta:
    """The queue's ETA: the prompt tokens waiting over the prompt tokens/s the ranks took
    *while requests waited*. Two ways a plain placements/s misled (live, 8 sim ranks at 1.2x
    capacity, a burst of 300 requests: an ETA of 57-80 s published for a queue that was gone
    in 16 s, and up to 9 of 600 requests refused with a 429, 2026-12-06):
    - with headroom the ranks take requests as they arrive, so placements are the arrival
      rate, whatever the ranks could take; a burst after a quiet spell met the quiet rate.
      So the meter starts when a backlog does and ends with it, and until the backlog has
      lasted a whole ``window_s`` the figure is the head's wait (a backlog that young is
      under ``window_s`` old: no bound above that refuses);
    - a burst is placed longest prompt first, so its first seconds place a few long prompts
      and read few requests/s. What a rank takes is prefill work, so the ETA counts prompt
      tokens, ahead and per second.
    Units are the caller's (requests where a policy does not count tokens). Pure: time
    passed in."""

    __slots__ = ("window_s", "_since", "_meter", "_seen")

    def __init__(self, window_s: float = PLACEMENT_WINDOW_S) -> None:
        self.window_s = window_s
        self._since: float | None = None    # when the current backlog began
        self._meter: RateMeter | None = None
        self._seen: int | None = None       # the placed counter at the last observation

    def observe(self, placed_total: int, waiting: int, now: float) -> None:
        """Record what was placed so far (a running total) and what waits, at ``now``."""
        new = 0 if self._seen is None else max(0, placed_total - self._seen)
        self._seen = placed_total
        if waiting <= 0:
            self._since = self._meter = None
            return
        if self._meter is None:   # a backlog begins: what was placed before it says nothing of the ranks
            self._since, self._meter = now, RateMeter(self.window_s)
            self._meter.add(0, now)
            return
        self._meter.add(new, now)

    def eta_ms(self, waiting: int, head_wait_ms: int, now: float) -> int:
        if waiting <= 0:
            return 0
        if self._since is None or self._meter is None or now - self._since < self.window_s:
            return head_wait_ms
        return queue_eta_ms(waiting, self._meter.rate(now), head_wait_ms)


class StepPublisher:
    """Writes ``state.last_snapshot`` and the ``snapshots`` counter."""

    def __init__(self, r: Any, keys: K.Keys, state: SchedulerState, log: Any) -> None:
        self.r, self.keys, self.state, self.log = r, keys, state, log
        self._last: bytes | str = "$"   # stats read from when this process started leading
        self._eta = QueueEta()

    async def iteration(self) -> None:
        agg = self.state.agg
        last = self._last
        deadline = agg.next_deadline()
        block_ms = 1000 if deadline is None else max(1, int((deadline - time.time()) * 1000))
        resp = await self.r.xread({self.keys.stats: last}, block=block_ms, count=4096)
        now = time.time()
        snaps: list[Snapshot] = []
        for _, eid, doc in decode_entries(resp):
            last = self._last = eid
            try:
                snap = agg.report(RankStats.from_dict(doc), now)
            except Exception as exc:  # noqa: BLE001
                self.log.warning("bad_stats_entry", error=str(exc))
                continue
            if snap is not None:
                snaps.append(snap)
        snap = agg.tick(now)
        if snap is not None:
            snaps.append(snap)
        if snaps:
            await self._publish(snaps)

    async def _publish(self, snaps: list[Snapshot]) -> None:
        st = self.state
        pipe = self.r.pipeline(transaction=False)
        for snap in snaps:
            st.policy.on_snapshot(snap)
            blob = encode(snap)
            pipe.xadd(self.keys.steps, {FIELD: blob}, maxlen=K.STATS_STREAM_MAXLEN, approximate=True)
        newest = snaps[-1]
        blob = encode(newest)
        now = time.time()
        tokens = getattr(st.policy, "unplaced_tokens", None)
        if tokens is None:   # a policy that does not count tokens: requests
            waiting, placed = int(getattr(st.policy, "unplaced", 0) or 0), st.counters.get("dispatched", 0)
        else:
            waiting, placed = int(tokens), st.counters.get("dispatched_tokens", 0)
        self._eta.observe(placed, waiting, now)
        head_ms = queue_wait_ms(st.policy, now)
        eta_ms = self._eta.eta_ms(waiting, head_ms, now)
        pipe.hset(self.keys.snapshot, mapping={"json": blob, "seq": newest.seq, "wave": newest.wave,
                                               "step": newest.step, "t": newest.t,
                                               "queue_wait_ms": head_ms, "queue_eta_ms": eta_ms, "queue_at": now})
        pipe.publish(self.keys.snapshot, blob)
        st.last_snapshot = newest
        st.counters["snapshots"] += len(snaps)
        if st.batching:
            st.wake_batcher.set()
        await pipe.execute()
