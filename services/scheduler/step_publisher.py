"""The step-consistent load view: read the engines' step reports (``<ns>:stats``), let the
aggregator finalize each step, and publish every finalized snapshot (``<ns>:steps``, the
``<ns>:snapshot`` hash and its channel, with the queue's ETA: queue_eta.py) and hand it to
the policy."""

from __future__ import annotations

import time
from typing import Any

from services.scheduler.queue_eta import (QueueEta, RanksQueueEta, full_step_prefill_tps, full_step_seq_rps,
                                         queue_wait_ms)
from services.scheduler.state import SchedulerState
from shared import keys as K
from shared.bus import decode_entries
from shared.messages import FIELD, encode
from shared.stats import RankStats, Snapshot


class StepPublisher:
    """Writes ``state.last_snapshot`` and the ``snapshots`` counter."""

    def __init__(self, r: Any, keys: K.Keys, state: SchedulerState, log: Any) -> None:
        self.r, self.keys, self.state, self.log = r, keys, state, log
        self._last: bytes | str = "$"   # stats read from when this process started leading
        self._eta = QueueEta()
        self._ranks_eta = RanksQueueEta()

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
        most_tps = full_step_prefill_tps(newest)   # the fastest any backlog drains, in prompt tokens/s
        most_rps = full_step_seq_rps(newest)       # and in requests/s, as the slots free
        unplaced = int(getattr(st.policy, "unplaced", 0) or 0)
        tokens = getattr(st.policy, "unplaced_tokens", None)
        if tokens is None:   # a policy that does not count tokens: requests
            waiting, placed = unplaced, st.counters.get("dispatched", 0)
            least = (None, unplaced, most_rps)
        else:
            waiting, placed = int(tokens), st.counters.get("dispatched_tokens", 0)
            least = (most_tps, unplaced, most_rps)
        self._eta.observe(placed, waiting, now)
        head_ms = queue_wait_ms(st.policy, now)
        # a new request waits here unplaced, then in a rank's queue
        eta_ms = (self._eta.eta_ms(waiting, head_ms, now, *least)
                  + self._ranks_eta.update(snaps, now, most_tps, most_rps))
        # prefill_tps, seq_rps: what each api-server divides the prompt tokens and requests
        # admitted since by (absent, not 0, until a rank has measured them)
        rates = {k: v for k, v in (("prefill_tps", round(most_tps or 0)), ("seq_rps", round(most_rps or 0, 2))) if v}
        pipe.hset(self.keys.snapshot, mapping={"json": blob, "seq": newest.seq, "wave": newest.wave,
                                               "step": newest.step, "t": newest.t,
                                               "queue_wait_ms": head_ms, "queue_eta_ms": eta_ms, "queue_at": now,
                                               **rates})
        unknown = [k for k in ("prefill_tps", "seq_rps") if k not in rates]
        if unknown:
            pipe.hdel(self.keys.snapshot, *unknown)
        pipe.publish(self.keys.snapshot, blob)
        st.last_snapshot = newest
        st.counters["snapshots"] += len(snaps)
        if st.batching:
            st.wake_batcher.set()
        await pipe.execute()
