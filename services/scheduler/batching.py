"""Staggered batches (policy ``staggered``): wait for the batcher's next deadline or a
nudge (a new request, a snapshot, fewer ranks), then emit what it releases, acked in the
same transaction as the inbox writes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.scheduler.inbox_writer import InboxWriter
from services.scheduler.state import SchedulerState
from shared import keys as K
from shared.bus import atomic


class BatchReleaser:
    def __init__(self, r: Any, keys: K.Keys, state: SchedulerState, writer: InboxWriter) -> None:
        self.r, self.keys, self.state, self.writer = r, keys, state, writer

    async def iteration(self) -> None:
        st, w = self.state, self.writer
        deadline = st.policy.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.time())
        st.wake_batcher.clear()
        try:
            await asyncio.wait_for(st.wake_batcher.wait(), timeout)
        except TimeoutError:
            pass
        released = st.policy.poll(time.time())
        if released:
            now = time.time()
            pipe = atomic(self.r, self.keys.requests)   # with the wake-up (shared/wake.py)
            acks = [e for e in (w.release(pipe, a, now) for a in released) if e is not None]
            w.record_batches(pipe, released)
            if acks:
                pipe.xack(self.keys.requests, K.SCHEDULER_GROUP, *acks)
            w.post_wake(pipe)
            await w.commit(pipe)
