"""The request stream ``<ns>:requests`` (group ``scheduler``): read new entries, take back
what was read and never acked (a dead leader's, ours before an outage, entries deferred on
purpose, a stepped-down leader's stranded ones), and turn each into a dispatch, an unplaced
request or a routed abort, acked in the same transaction as what it caused."""

from __future__ import annotations

import time
from typing import Any

from services.scheduler.inbox_writer import InboxWriter
from services.scheduler.loops import where
from services.scheduler.state import SchedulerState
from shared import keys as K
from shared import trace
from shared.bus import atomic, decode_entries, ensure_group
from shared.messages import Abort, Request
from shared.policy.base import Assignment, RequestInfo
from shared.policy.staggered import BatcherFull
from shared.settings import SchedulerSettings

RETRY_DEFERRED_S = 0.5      # take back entries left unacked on purpose (back-pressure, an error) after this
# Entries another consumer read and left pending this long are stranded: a leader that
# stalled past its lease stepped down holding them (read, or held unplaced), and no restart
# comes to take them back. Long enough that a stalled leader has noticed its loss first.
STRANDED_MIN_S = 10.0
STRANDED_LEASES = 5         # ... or this many leases, whichever is longer
STRANDED_SWEEP_S = 5.0      # how often the leader looks for them

# The group's consumers that hold nothing and have read nothing for ARGV[3] ms, other than
# the leader's own: dead or stepped-down schedulers (a standby never reads the group), one
# more name per failover otherwise, forever. Checked and deleted in one script, so one that
# reads again in between keeps its entries (DELCONSUMER drops a consumer's pending ones).
FORGET_IDLE = """
local gone = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] ~= ARGV[2] and tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    gone = gone + 1
  end
end
return gone
"""


async def forget_idle_consumers(r: Any, keys: K.Keys, me: str, min_idle_ms: int) -> int:
    """Delete the requests group's idle, empty consumers other than ``me``; how many."""
    return int(await r.eval(FORGET_IDLE, 1, keys.requests, K.SCHEDULER_GROUP, me, min_idle_ms))


class Intake:
    """Writes ``state.unplaced`` (requests the policy keeps for now) and clears ``state.redis_trouble``."""

    def __init__(self, r: Any, keys: K.Keys, settings: SchedulerSettings, consumer: str, state: SchedulerState,
                 writer: InboxWriter, log: Any) -> None:
        self.r, self.keys, self.s, self.id = r, keys, settings, consumer
        self.state, self.writer, self.log = state, writer, log
        self._retry_at = 0.0                  # monotonic time to take back deferred entries (0: none)
        self._sweep_at = time.monotonic() + STRANDED_SWEEP_S
        self.stranded_ms = int(max(STRANDED_MIN_S * 1000, STRANDED_LEASES * settings.lease_ms))

    async def iteration(self) -> None:
        if self.state.redis_trouble:
            # After start-up or an outage: the group may be gone (restarted server) and
            # entries may have been read but not acked: take them again, idempotently.
            await ensure_group(self.r, self.keys.requests, K.SCHEDULER_GROUP, "0")
            self._retry_at = 0.0
            await self._reclaim_pending()
            self.state.redis_trouble = False
        elif self._retry_at and time.monotonic() >= self._retry_at:
            # Entries deliberately left unacked (back-pressure, a failed hand-off): again.
            self._retry_at = 0.0
            await self._reclaim_pending()
        elif time.monotonic() >= self._sweep_at:
            # Entries a predecessor that stepped down (not crashed) still holds: nobody else
            # takes them back, their clients would wait out request_timeout_s, and the
            # stream's trim stops at the oldest of them.
            self._sweep_at = time.monotonic() + STRANDED_SWEEP_S
            await self._reclaim_pending(self.stranded_ms)
            if gone := await forget_idle_consumers(self.r, self.keys, self.id, self.stranded_ms):
                self.log.info("forgot_idle_consumers", n=gone)
        block = 1000 if not self._retry_at else max(1, min(1000, int((self._retry_at - time.monotonic()) * 1000)))
        resp = await self.r.xreadgroup(K.SCHEDULER_GROUP, self.id, {self.keys.requests: ">"},
                                       count=self.s.read_count, block=block)
        entries = decode_entries(resp)
        if entries:
            if trace.ENABLED:
                trace.mark("sched_read")
            await self.handle(entries)

    async def _reclaim_pending(self, min_idle_ms: int = 0) -> None:
        """Take over entries read but never acked (by a dead leader, or by us before an
        outage; with ``min_idle_ms``, only those pending that long: stranded ones). A
        request that already has a rank in its record goes to that same rank again (the
        engine ignores a second copy), so each is dispatched exactly once. Our own
        unplaced requests stay where they are."""
        start = "0-0"
        while True:
            nxt, claimed, *_ = await self.r.xautoclaim(self.keys.requests, K.SCHEDULER_GROUP, self.id,
                                                        min_idle_time=min_idle_ms, start_id=start, count=1000)
            entries = [e for e in (decode_entries([(self.keys.requests.encode(), claimed)]) if claimed else [])
                       if not (e[2].get("k") == "req" and e[2].get("id") in self.state.unplaced)]
            if entries:
                self.log.info("reclaimed_requests", n=len(entries))
                pipe = self.r.pipeline(transaction=False)
                for _, _, doc in entries:
                    pipe.hget(self.keys.req(str(doc.get("id", ""))), "rank")
                placed = await pipe.execute()
                await self.handle(entries, placed)
            if nxt in (b"0-0", "0-0"):
                return
            start = nxt

    async def handle(self, entries: list[tuple[bytes, bytes, dict[str, Any]]],
                     placed: list[Any] | None = None) -> None:
        """Dispatch, keep unplaced or route each entry; ack only what was emitted (in the same
        transaction) or is malformed for good. An unplaced entry stays pending in the group (a
        successor reclaims it); one the policy could not take (``BatcherFull``, an error)
        stays pending too and is taken back after ``RETRY_DEFERRED_S``."""
        st, w = self.state, self.writer
        placed_by_others = await self._ranks_of_unknown_aborts(entries)
        now = time.time()
        # A transaction: the ranks' blocked reads see the inbox writes and the wake-up
        # notice together (shared/wake.py).
        pipe = atomic(self.r, self.keys.requests)   # one slot on Redis Cluster (shared/keys.py)
        acks: list[bytes] = []
        for i, (_, eid, doc) in enumerate(entries):
            kind = doc.get("k")
            try:
                if kind == "req":
                    req = Request.from_dict(doc)
                    info = RequestInfo(req.id, req.prompt_tokens, req.params.max_tokens, req.arrival)
                elif kind == "abort":
                    ab = Abort.from_dict(doc)
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except Exception as exc:  # noqa: BLE001 - malformed for good: drop it (counted), do not stop
                st.counters["bad_entries"] += 1
                self.log.warning("bad_request_entry", entry=eid.decode(), error=str(exc))
                acks.append(eid)
                continue
            try:
                if kind == "req":
                    if placed is not None and placed[i] is not None:
                        # Dispatched before (reclaimed after a crash or outage): same rank again.
                        req.rank = int(placed[i])
                        w.emit(pipe, req, Assignment(req.id, req.rank, reason="redispatch"), now)
                        acks.append(eid)
                    elif req.epoch == 0 and req.id in st.assigned:
                        # Placed already: a second copy of its submission (the api-server
                        # wrote it again through a dropped connection). Two copies would run
                        # and their tokens interleave in one stream.
                        st.count("duplicates")
                        acks.append(eid)
                    elif req.rank is not None:
                        st.counters["explicit"] += 1
                        w.emit(pipe, req, st.policy.note_explicit(info, req.rank, now), now)
                        acks.append(eid)
                    elif st.batching and req.id in st.unplaced:
                        # Resubmitted while held here (its api-server resumed it after
                        # Redis lost the streams): the newer copy takes the held one's place.
                        old_eid, held = st.unplaced[req.id]
                        keep, drop = ((eid, req), old_eid) if req.epoch >= held.epoch else ((old_eid, held), eid)
                        st.unplaced[req.id] = keep
                        acks.append(drop)
                    elif st.batching:
                        st.unplaced[req.id] = (eid, req)
                        try:
                            released = st.policy.submit(info, now)
                        except BaseException:
                            st.unplaced.pop(req.id, None)
                            raise
                        acks.extend(e for e in (w.release(pipe, a, now) for a in released) if e is not None)
                        w.record_batches(pipe, released)
                        st.wake_batcher.set()
                    else:
                        w.emit(pipe, req, st.policy.choose(info, now), now)
                        acks.append(eid)
                else:
                    if ab.rank is None:
                        ab.rank = placed_by_others.get(ab.id)
                    w.route_abort(pipe, ab)
                    acks.append(eid)
            except BatcherFull as exc:
                # Back-pressure: leave it on the stream (pending, unacked) and try again later.
                st.count("deferred")
                self.log.warning("batcher_full", entry=eid.decode(), error=str(exc))
                self._defer()
            except Exception as exc:  # noqa: BLE001 - one entry must not stop dispatch; it is not lost
                st.count("deferred")
                self.log.error("request_entry_failed", entry=eid.decode(), error=repr(exc), where=where(exc))
                self._defer()
        if acks:
            pipe.xack(self.keys.requests, K.SCHEDULER_GROUP, *acks)
        w.post_wake(pipe)
        if trace.ENABLED:
            trace.mark("sched_sent")
        await w.commit(pipe)

    async def _ranks_of_unknown_aborts(self, entries: list[tuple[bytes, bytes, dict[str, Any]]]) -> dict[str, int]:
        """The rank of each aborted request this leader neither placed nor holds: one placed
        by an earlier leader (a failover in between), as its record says. Without it the
        abort would be dropped and the rank would run the request for nobody to its end.
        One round trip, and only for such aborts (an api-server sends no rank)."""
        st = self.state
        ids = [str(doc.get("id")) for _, _, doc in entries
               if doc.get("k") == "abort" and doc.get("r") is None and isinstance(doc.get("id"), str)
               and doc["id"] not in st.assigned and doc["id"] not in st.unplaced]
        if not ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for rid in ids:
            pipe.hmget(self.keys.req(rid), "rank", "state")
        found = {}
        for rid, (rank, state) in zip(ids, await pipe.execute()):
            if rank is not None and state != b"finished":
                found[rid] = int(rank)
        return found

    def _defer(self) -> None:
        if not self._retry_at:
            self._retry_at = time.monotonic() + RETRY_DEFERRED_S
