"""Writing the policy's decisions into a pipeline: the request on its rank's inbox and its
record ``<ns>:req:<id>``, staggered batches' records, aborts routed to the rank that holds
the request (or answered at once when it never left the scheduler), and the wake-up of a
paused group with the first inbox write (shared/wake.py)."""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import ResponseError

from services.scheduler.state import SchedulerState
from shared import cancels
from shared import keys as K
from shared.messages import FIELD, Abort, Delta, Request, Retire, dumps, encode, encode_deltas
from shared.policy.base import Assignment
from shared.settings import SchedulerSettings
from shared.wake import wake_if_paused

ASSIGNED_MEMORY = 200_000   # request id -> rank, for routing aborts (LRU, bounded)


class InboxWriter:
    """Writes ``state.assigned``, ``state.unplaced`` (pops released entries) and the counters."""

    def __init__(self, keys: K.Keys, settings: SchedulerSettings, state: SchedulerState, log: Any) -> None:
        self.keys, self.s, self.state, self.log = keys, settings, state, log
        self.metrics: Any = None        # set once leading (services/scheduler/metrics.py)
        self._dispatching = False       # the pipeline being built writes work to an inbox
        # its placements: (request, assignment, rank before, when), counted once it commits
        self._noted: list[tuple[Request, Assignment, int | None, float]] = []

    def post_wake(self, pipe: Any) -> None:
        """With the inbox writes: wake the group if it sleeps (shared/wake.py)."""
        if self._dispatching:
            wake_if_paused(pipe, self.keys)
        self._dispatching = False

    def emit(self, pipe: Any, req: Request, a: Assignment, now: float) -> None:
        st = self.state
        req.rank = a.rank
        req.batch = a.batch
        req.batch_counts = list(a.batch_counts) if a.batch_counts else None
        req.dispatcher = a.dispatcher or st.dispatcher_id
        req.dispatch_seq = a.seq
        self._dispatching = True
        was = st.assigned.get(req.id)
        if req.epoch > 0 and was is not None and was != a.rank:
            # A resumed request moving rank: the copy this leader placed may still run there
            # (its api-server resumed it without knowing the rank: no token had reached it,
            # or Redis lost the streams), its deltas ignored, holding KV to its end.
            cancels.send(pipe, self.keys, was, encode(Retire(req.id, was, req.epoch - 1)), FIELD)
        pipe.xadd(self.keys.inbox(a.rank), {FIELD: encode(req)})
        rec = {"state": "dispatched", "rank": a.rank, "api": req.api, "t_arrival": req.arrival,
               "t_dispatched": now, "prompt_tokens": req.prompt_tokens, "max_tokens": req.params.max_tokens,
               "reason": a.reason}
        if a.batch:
            rec["batch"] = a.batch
        if req.epoch:    # a resumed copy: its api-server's lost watch tells it from the copy before
            rec["epoch"] = req.epoch
        pipe.hset(self.keys.req(req.id), mapping=rec)
        pipe.expire(self.keys.req(req.id), self.s.request_record_ttl_s)
        self._noted.append((req, a, was, now))
        st.assigned[req.id] = a.rank
        if len(st.assigned) > ASSIGNED_MEMORY:
            st.assigned.popitem(last=False)

    async def commit(self, pipe: Any) -> Any:
        """Execute the dispatch pipeline built since the last commit (its emits and this
        call run with no await between them). Where Redis refuses it (a full Redis: the
        transaction's record, inbox writes and acks land all or none), the placements noted
        for it are forgotten, so its entries, still pending, are placed when taken back.
        Noted, they were taken for second copies of placed requests, acked and dropped:
        nothing ran them, and each client waited out request_timeout_s. (A lost connection
        leaves the outcome unknown: the placements stand, and a copy is dropped as before.)
        The placements are counted (``dispatched``, the Prometheus placement metrics) only
        as they stand: counted as built, a refused one was counted again when placed."""
        noted, self._noted = self._noted, []
        try:
            res = await pipe.execute()
        except ResponseError:
            assigned = self.state.assigned
            for req, _, was, _ in reversed(noted):
                if was is None:
                    assigned.pop(req.id, None)
                else:
                    assigned[req.id] = was
            raise
        except BaseException:
            self._count(noted)
            raise
        self._count(noted)
        return res

    def _count(self, noted: list[tuple[Request, Assignment, int | None, float]]) -> None:
        counters = self.state.counters
        for req, a, _, now in noted:
            counters["dispatched"] += 1
            counters["dispatched_tokens"] += req.prompt_tokens
            if self.metrics is not None:
                self.metrics.on_dispatch(a, req, now)

    def release(self, pipe: Any, a: Assignment, now: float) -> bytes | None:
        """Emit an unplaced request the policy released; its stream entry id (to ack), or None."""
        kept = self.state.unplaced.pop(a.request_id, None)
        if kept is None:
            # The batcher released a request this service no longer holds (it cannot when
            # aborts drop it from the batcher too): skip it rather than lose the batch.
            self.log.error("released_request_unknown", request_id=a.request_id, batch=a.batch)
            return None
        eid, req = kept
        self.emit(pipe, req, a, now)
        return eid

    def route_abort(self, pipe: Any, ab: Abort) -> None:
        st = self.state
        kept = st.unplaced.pop(ab.id, None)
        if kept is not None:
            # Never reached a rank: answer the api-server directly.
            eid, req = kept
            drop = getattr(st.policy, "drop", None)
            if drop is not None:
                drop(ab.id)
            pipe.xadd(self.keys.out(req.api), {FIELD: encode_deltas([Delta(ab.id, 0, [], "abort")])},
                      maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
            pipe.xack(self.keys.requests, K.SCHEDULER_GROUP, eid)
            return
        rank = st.assigned.get(ab.id, ab.rank)
        if rank is None:
            return   # unknown: finished long ago, or never placed
        ab.rank = rank
        cancels.send(pipe, self.keys, rank, encode(ab), FIELD)   # (ahead of the rank's inbox backlog)
        st.counters["aborts_routed"] += 1

    def record_batches(self, pipe: Any, released: list[Assignment]) -> None:
        seen: set[str] = set()
        for a in released:
            if a.batch and a.batch not in seen:
                seen.add(a.batch)
                pipe.hset(self.keys.batch(a.batch), mapping={
                    "counts": dumps(list(a.batch_counts or ())), "reason": a.reason, "t": time.time()})
                pipe.expire(self.keys.batch(a.batch), K.BATCH_HASH_TTL_S)
