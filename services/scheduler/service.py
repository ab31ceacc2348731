"""The scheduler service: dispatch and the step-consistent load view (imperative shell).

Three loops share one policy object and one aggregator (both pure):
- requests: XREADGROUP the request stream -> policy -> one pipeline that writes the
  rank inboxes, the request records and the acks;
- stats: XREAD the engines' step reports -> StepAggregator -> publish each finalized
  snapshot (hash + pub/sub) and hand it to the policy;
- membership: heartbeats and drained ranks -> which ranks may get work.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
import uuid
from collections import OrderedDict
from typing import Any

from shared import keys as K
from shared import lease
from services.scheduler.housekeeping import recover_orphans, trim_acked
from shared.bus import atomic, decode_entries, ensure_group, open_service_connection, retrying
from shared.logging import configure
from shared.messages import FIELD, Abort, Delta, Request, dumps, encode_deltas
from shared.policy.aggregator import StepAggregator
from shared.policy.base import Assignment, RequestInfo
from shared.policy.registry import make_policy
from shared.policy.staggered import BatcherFull
from shared.settings import SchedulerSettings
from shared.stats import RankStats, Snapshot
from shared.wake import wake_if_paused
from shared import trace

ASSIGNED_MEMORY = 200_000   # request id -> rank, for routing aborts (LRU, bounded)
ORPHAN_SCAN_S = 2.0         # look for work left behind by dead ranks (and trim) this often, and at once on changes
RETRY_DEFERRED_S = 0.5      # take back entries left unacked on purpose (back-pressure, an error) after this


class SchedulerService:
    def __init__(self, settings: SchedulerSettings) -> None:
        self.s = settings
        self.keys = K.Keys(settings.namespace)
        self.id = f"sched-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.log = configure("scheduler", settings.log_level, scheduler=self.id)
        self.ranks = list(range(settings.ranks))
        # The dispatcher id carries this leadership's incarnation (``scheduler.<n>``, set
        # when it becomes leader): engines echo what they received per incarnation, and a new
        # leader's batch numbers sort after the old one's (batch_gate.batch_number).
        self.dispatcher_id = "scheduler"
        self.policy = self._make_policy()
        self.batching = hasattr(self.policy, "submit")
        self.agg = StepAggregator(self.ranks, grace_s=settings.grace_ms / 1000,
                                  min_interval_s=settings.snapshot_min_interval_ms / 1000)
        self.assigned: OrderedDict[str, int] = OrderedDict()
        self.held: dict[str, tuple[bytes, Request]] = {}   # staggered: request id -> (entry, request)
        self.wake_batcher = asyncio.Event()
        self.stop = asyncio.Event()
        self.counters = {"dispatched": 0, "explicit": 0, "aborts_routed": 0, "snapshots": 0, "bad_entries": 0}
        self.live: list[int] = list(self.ranks)
        self.drained: set[int] = set()
        self.last_snapshot: Snapshot | None = None
        self._redis_trouble = False
        self._next_orphan_scan = 0.0
        self.ever_alive: set[int] = set()   # ranks seen alive: only those can have died
        self.consumers: dict[int, bytes | None] = {}   # rank -> consumer name of its current incarnation
        self._dispatching = False             # the pipeline being built writes work to an inbox
        self._retry_at = 0.0                  # monotonic time to take back deferred entries (0: none)

    def _make_policy(self) -> Any:
        s = self.s
        extra = ({"max_wait_ms": s.max_wait_ms} if s.policy == "staggered" else
                 {"level_tokens": s.level_tokens} if s.policy == "waterfill" else {})
        return make_policy(s.policy, dispatcher_id=self.dispatcher_id, num_api_servers=s.num_api_servers,
                           ranks=self.ranks, **extra)

    async def run(self) -> int:
        r = await open_service_connection(self.s.redis_url, self.log, self.stop)
        if r is None:
            return 2
        self.r = r
        await ensure_group(self.r, self.keys.requests, K.SCHEDULER_GROUP, "0")
        if not await self._become_leader():
            return 0
        self.log.info("scheduler_leading", policy=self.s.policy, ranks=self.s.ranks, dispatcher=self.dispatcher_id)
        from services.scheduler.metrics import start_metrics
        self.metrics = start_metrics(self, self.s.metrics_port)
        tasks = [asyncio.create_task(c) for c in (
            self._request_loop(), self._stats_loop(), self._membership_loop(), self._lease_loop())]
        if self.batching:
            tasks.append(asyncio.create_task(self._batch_loop()))
        stopper = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            if t is not stopper and t.exception():
                self.log.error("scheduler_failed", error=repr(t.exception()))
        try:
            await lease.release(self.r, self.keys.leader, self.id)   # only if still ours
        finally:
            await self.r.aclose()
        return 0

    async def _resilient(self, what: str, iteration: Any) -> None:
        """Run one loop's iterations forever; ride out Redis outages with backoff (and
        remember the outage: the request loop then re-takes what it read but did not ack).
        Any other error is logged and the loop goes on after a short backoff: a loop that
        ended would leave the leader holding the lease while doing nothing (or exit it)."""
        async def note_trouble() -> None:
            self._redis_trouble = True

        failures = 0
        while True:
            try:
                await retrying(iteration, log=self.log, what=what, on_retry=note_trouble)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug in one iteration must not stop the service
                failures += 1
                self._redis_trouble = True   # re-take what was read and not acked
                if failures in (1, 2, 4, 8) or failures % 64 == 0:
                    self.log.error("loop_iteration_failed", loop=what, error=repr(exc), failures=failures,
                                   where=_where(exc))
                await asyncio.sleep(min(2.0, 0.05 * 2 ** min(failures, 6)))

    # ------------------------------------------------------------------ leadership
    async def _become_leader(self) -> bool:
        """Campaign until the lease is ours (True) or we stop (False). Redis going away
        meanwhile is waited out with backoff like everywhere else: a standby that exited
        on it (as one did at every Redis restart of the chaos run) is no standby."""
        while not self.stop.is_set():
            try:
                if await retrying(self._campaign, log=self.log, what="leader_campaign", stop=self.stop):
                    return True
            except Exception:  # noqa: BLE001 - only raised once stopping (retrying gives up then)
                if self.stop.is_set():
                    return False
                raise
            try:
                await asyncio.wait_for(self.stop.wait(), self.s.lease_ms / 3000)
            except TimeoutError:
                pass
        return False

    async def _campaign(self) -> bool:
        # Ours already: a previous try took the lease and lost the connection after it.
        won = (await self.r.set(self.keys.leader, self.id, nx=True, px=self.s.lease_ms)
               or await self.r.get(self.keys.leader) == self.id.encode())
        if won:
            self.dispatcher_id = f"scheduler.{await self.r.incr(self.keys.incarnation)}"
            self.policy = self._make_policy()   # nothing placed yet: a fresh view, under the new id
            await self._announce()
        return bool(won)

    async def _announce(self) -> None:
        """Record who leads and the cluster settings this scheduler knows (again after a
        restarted server lost them)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys.scheduler, mapping={"leader": self.id, "pid": os.getpid(), "policy": self.s.policy,
                                                "dispatcher": self.dispatcher_id, "since": time.time()})
        pipe.hset(self.keys.cluster, mapping={"ranks": self.s.ranks, "policy": self.s.policy,
                                              "dispatch": self.s.dispatch, "api_servers": self.s.num_api_servers})
        await pipe.execute()

    async def _lease_loop(self) -> None:
        await self._resilient("lease", self._renew_lease)

    async def _renew_lease(self) -> None:
        await asyncio.sleep(self.s.lease_ms / 3000)
        # Fenced (shared/lease.py): extended only while it is ours, taken back only if free
        # (a restarted server, a long outage); another leader's lease is never overwritten.
        before = await self.r.get(self.keys.leader)
        holder = await lease.renew(self.r, self.keys.leader, self.id, self.s.lease_ms)
        if before is None and lease.is_holder(holder, self.id):
            self.log.warning("lease_reacquired")
            await self._announce()
        if not lease.is_holder(holder, self.id):
            self.log.error("leadership_lost", holder=holder)
            self.stop.set()
            return
        await self.r.hset(self.keys.scheduler, mapping={
            "counters": dumps({**self.counters, **self._agg_counters()}), "t": time.time(), "leader": self.id,
            "policy": self.s.policy, "live": dumps(self.live), "drained": dumps(sorted(self.drained))})

    def _agg_counters(self) -> dict[str, int]:
        out = {f"agg_{k}": v for k, v in self.agg.counters().items()}
        policy_counters = getattr(self.policy, "counters", None) or getattr(self.policy, "stats")
        out.update({f"policy_{k}": v for k, v in policy_counters().items()})
        return out

    # ------------------------------------------------------------------ requests
    async def _request_loop(self) -> None:
        # First what this consumer (or a dead predecessor) read but never acked.
        self._redis_trouble = True
        await self._resilient("requests", self._request_iteration)

    async def _request_iteration(self) -> None:
        if self._redis_trouble:
            # After start-up or an outage: the group may be gone (restarted server) and
            # entries may have been read but not acked: take them again, idempotently.
            await ensure_group(self.r, self.keys.requests, K.SCHEDULER_GROUP, "0")
            self._retry_at = 0.0
            await self._reclaim_pending()
            self._redis_trouble = False
        elif self._retry_at and time.monotonic() >= self._retry_at:
            # Entries deliberately left unacked (back-pressure, a failed hand-off): again.
            self._retry_at = 0.0
            await self._reclaim_pending()
        block = 1000 if not self._retry_at else max(1, min(1000, int((self._retry_at - time.monotonic()) * 1000)))
        resp = await self.r.xreadgroup(K.SCHEDULER_GROUP, self.id, {self.keys.requests: ">"},
                                       count=self.s.read_count, block=block)
        entries = decode_entries(resp)
        if entries:
            if trace.ENABLED:
                trace.mark("sched_read")
            await self._handle(entries)

    async def _reclaim_pending(self) -> None:
        """Take over entries read but never acked (by a dead leader, or by us before an
        outage). A request that already has a rank in its record goes to that same rank
        again (the engine ignores a second copy), so each is dispatched exactly once."""
        start = "0-0"
        while True:
            nxt, claimed, *_ = await self.r.xautoclaim(self.keys.requests, K.SCHEDULER_GROUP, self.id,
                                                        min_idle_time=0, start_id=start, count=1000)
            entries = [e for e in (decode_entries([(self.keys.requests.encode(), claimed)]) if claimed else [])
                       if not (e[2].get("k") == "req" and e[2].get("id") in self.held)]
            if entries:
                self.log.info("reclaimed_requests", n=len(entries))
                pipe = self.r.pipeline(transaction=False)
                for _, _, doc in entries:
                    pipe.hget(self.keys.req(str(doc.get("id", ""))), "rank")
                placed = await pipe.execute()
                await self._handle(entries, placed)
            if nxt in (b"0-0", "0-0"):
                return
            start = nxt

    async def _handle(self, entries: list[tuple[bytes, bytes, dict[str, Any]]],
                      placed: list[Any] | None = None) -> None:
        """Dispatch, hold or route each entry; ack only what was emitted (in the same
        transaction) or is malformed for good. A held entry stays pending in the group (a
        successor reclaims it); one the policy could not take (``BatcherFull``, an error)
        stays pending too and is taken back after ``RETRY_DEFERRED_S``."""
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
                self.counters["bad_entries"] += 1
                self.log.warning("bad_request_entry", entry=eid.decode(), error=str(exc))
                acks.append(eid)
                continue
            try:
                if kind == "req":
                    if placed is not None and placed[i] is not None:
                        # Dispatched before (reclaimed after a crash or outage): same rank again.
                        req.rank = int(placed[i])
                        self._emit(pipe, req, Assignment(req.id, req.rank, reason="redispatch"), now)
                        acks.append(eid)
                    elif req.rank is not None:
                        self.counters["explicit"] += 1
                        self._emit(pipe, req, self.policy.note_explicit(info, req.rank, now), now)
                        acks.append(eid)
                    elif self.batching:
                        self.held[req.id] = (eid, req)
                        try:
                            released = self.policy.submit(info, now)
                        except BaseException:
                            self.held.pop(req.id, None)
                            raise
                        acks.extend(e for e in (self._release(pipe, a, now) for a in released) if e is not None)
                        self._record_batches(pipe, released)
                        self.wake_batcher.set()
                    else:
                        self._emit(pipe, req, self.policy.choose(info, now), now)
                        acks.append(eid)
                else:
                    self._route_abort(pipe, ab)
                    acks.append(eid)
            except BatcherFull as exc:
                # Back-pressure: leave it on the stream (pending, unacked) and try again later.
                self.counters["deferred"] = self.counters.get("deferred", 0) + 1
                self.log.warning("batcher_full", entry=eid.decode(), error=str(exc))
                self._defer()
            except Exception as exc:  # noqa: BLE001 - one entry must not stop dispatch; it is not lost
                self.counters["deferred"] = self.counters.get("deferred", 0) + 1
                self.log.error("request_entry_failed", entry=eid.decode(), error=repr(exc), where=_where(exc))
                self._defer()
        if acks:
            pipe.xack(self.keys.requests, K.SCHEDULER_GROUP, *acks)
        self._post_wake(pipe)
        if trace.ENABLED:
            trace.mark("sched_sent")
        await pipe.execute()

    def _defer(self) -> None:
        if not self._retry_at:
            self._retry_at = time.monotonic() + RETRY_DEFERRED_S

    def _post_wake(self, pipe: Any) -> None:
        """With the inbox writes: wake the group if it sleeps (shared/wake.py)."""
        if self._dispatching:
            wake_if_paused(pipe, self.keys)
        self._dispatching = False

    def _emit(self, pipe: Any, req: Request, a: Assignment, now: float) -> None:
        req.rank = a.rank
        req.batch = a.batch
        req.batch_counts = list(a.batch_counts) if a.batch_counts else None
        req.dispatcher = a.dispatcher or self.dispatcher_id
        req.dispatch_seq = a.seq
        self._dispatching = True
        if getattr(self, "metrics", None) is not None:
            self.metrics.on_dispatch(a, req, now)
        pipe.xadd(self.keys.inbox(a.rank), {FIELD: dumps(req.to_dict())})
        rec = {"state": "dispatched", "rank": a.rank, "api": req.api, "t_arrival": req.arrival,
               "t_dispatched": now, "prompt_tokens": req.prompt_tokens, "max_tokens": req.params.max_tokens,
               "reason": a.reason}
        if a.batch:
            rec["batch"] = a.batch
        pipe.hset(self.keys.req(req.id), mapping=rec)
        pipe.expire(self.keys.req(req.id), self.s.request_record_ttl_s)
        self.assigned[req.id] = a.rank
        if len(self.assigned) > ASSIGNED_MEMORY:
            self.assigned.popitem(last=False)
        self.counters["dispatched"] += 1

    def _release(self, pipe: Any, a: Assignment, now: float) -> bytes | None:
        held = self.held.pop(a.request_id, None)
        if held is None:
            # The batcher released a request this service no longer holds (it cannot when
            # aborts drop it from the batcher too): skip it rather than lose the batch.
            self.log.error("released_request_not_held", request_id=a.request_id, batch=a.batch)
            return None
        eid, req = held
        self._emit(pipe, req, a, now)
        return eid

    def _route_abort(self, pipe: Any, ab: Abort) -> None:
        held = self.held.pop(ab.id, None)
        if held is not None:
            # Never reached a rank: answer the api-server directly.
            eid, req = held
            drop = getattr(self.policy, "drop", None)
            if drop is not None:
                drop(ab.id)
            pipe.xadd(self.keys.out(req.api), {FIELD: encode_deltas([Delta(ab.id, 0, [], "abort")])},
                      maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
            pipe.xack(self.keys.requests, K.SCHEDULER_GROUP, eid)
            return
        rank = self.assigned.get(ab.id, ab.rank)
        if rank is None:
            return   # unknown: finished long ago, or never placed
        ab.rank = rank
        pipe.xadd(self.keys.inbox(rank), {FIELD: dumps(ab.to_dict())})
        self.counters["aborts_routed"] += 1

    async def _batch_loop(self) -> None:
        await self._resilient("batches", self._batch_iteration)

    async def _batch_iteration(self) -> None:
        deadline = self.policy.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.time())
        self.wake_batcher.clear()
        try:
            await asyncio.wait_for(self.wake_batcher.wait(), timeout)
        except TimeoutError:
            pass
        released = self.policy.poll(time.time())
        if released:
            now = time.time()
            pipe = atomic(self.r, self.keys.requests)   # with the wake-up (shared/wake.py)
            acks = [e for e in (self._release(pipe, a, now) for a in released) if e is not None]
            self._record_batches(pipe, released)
            if acks:
                pipe.xack(self.keys.requests, K.SCHEDULER_GROUP, *acks)
            self._post_wake(pipe)
            await pipe.execute()

    def _record_batches(self, pipe: Any, released: list[Assignment]) -> None:
        seen: set[str] = set()
        for a in released:
            if a.batch and a.batch not in seen:
                seen.add(a.batch)
                pipe.hset(self.keys.batch(a.batch), mapping={
                    "counts": dumps(list(a.batch_counts or ())), "reason": a.reason, "t": time.time()})
                pipe.expire(self.keys.batch(a.batch), K.BATCH_HASH_TTL_S)

    # ------------------------------------------------------------------ step stats
    async def _stats_loop(self) -> None:
        self._stats_last: bytes | str = "$"
        await self._resilient("stats", self._stats_iteration)

    async def _stats_iteration(self) -> None:
        last = self._stats_last
        deadline = self.agg.next_deadline()
        block_ms = 1000 if deadline is None else max(1, int((deadline - time.time()) * 1000))
        resp = await self.r.xread({self.keys.stats: last}, block=block_ms, count=4096)
        now = time.time()
        snaps: list[Snapshot] = []
        for _, eid, doc in decode_entries(resp):
            last = self._stats_last = eid
            try:
                snap = self.agg.report(RankStats.from_dict(doc), now)
            except Exception as exc:  # noqa: BLE001
                self.log.warning("bad_stats_entry", error=str(exc))
                continue
            if snap is not None:
                snaps.append(snap)
        snap = self.agg.tick(now)
        if snap is not None:
            snaps.append(snap)
        if snaps:
            await self._publish(snaps)

    async def _publish(self, snaps: list[Snapshot]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for snap in snaps:
            self.policy.on_snapshot(snap)
            blob = dumps(snap.to_dict())
            pipe.xadd(self.keys.steps, {FIELD: blob}, maxlen=K.STATS_STREAM_MAXLEN, approximate=True)
        newest = snaps[-1]
        blob = dumps(newest.to_dict())
        pipe.hset(self.keys.snapshot, mapping={"json": blob, "seq": newest.seq, "wave": newest.wave,
                                               "step": newest.step, "t": newest.t})
        pipe.publish(self.keys.snapshot, blob)
        self.last_snapshot = newest
        self.counters["snapshots"] += len(snaps)
        if self.batching:
            self.wake_batcher.set()
        await pipe.execute()

    # ------------------------------------------------------------------ membership
    async def _membership_loop(self) -> None:
        await self._resilient("membership", self._membership_iteration)

    async def _membership_iteration(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        for r in self.ranks:
            pipe.exists(self.keys.rank_alive(r))
            pipe.hget(self.keys.rank_info(r), "consumer")
        pipe.smembers(self.keys.drained)
        res = await pipe.execute()
        live = [r for r, alive in zip(self.ranks, res[:-1:2]) if alive]
        self.ever_alive.update(live)
        drained = {int(x) for x in res[-1]}
        # A new incarnation of a rank (a hot spare took the slot of a dead process before
        # this loop saw it empty): what the old one held is resumed now, not at the next scan.
        consumers = dict(zip(self.ranks, res[1:-1:2]))
        if any(self.consumers.get(r) not in (None, c) for r, c in consumers.items()):
            self._next_orphan_scan = 0.0
        self.consumers = consumers
        if live != self.live or drained != self.drained:
            self.log.info("ranks_changed", live=live, drained=sorted(drained))
            self.live, self.drained = live, drained
            self.agg.set_live(live)
            eligible = [r for r in live if r not in drained] or [r for r in self.ranks if r not in drained]
            self.policy.set_ranks(eligible or self.ranks)
            if self.batching:
                self.wake_batcher.set()   # fewer ranks can make a held batch full
            self._next_orphan_scan = 0.0
        if time.monotonic() >= self._next_orphan_scan:
            self._next_orphan_scan = time.monotonic() + ORPHAN_SCAN_S
            await self._recover_orphans()
            await trim_acked(self.r, self.keys, self.ranks)
        await asyncio.sleep(0.25)

    async def _recover_orphans(self) -> None:
        by_api = await recover_orphans(self.r, self.keys, self.ranks, set(self.live), self.ever_alive)
        if by_api:
            for ids in by_api.values():
                for rid in ids:
                    self.assigned.pop(rid, None)
            n = sum(len(v) for v in by_api.values())
            self.counters["resumed"] = self.counters.get("resumed", 0) + n
            self.log.warning("resuming_requests_of_dead_ranks", n=n)


def _where(exc: BaseException) -> str:
    """The innermost frames of an error, for one log line (the JSON logs carry no tracebacks)."""
    return " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(exc.__traceback__)[-4:]))


def main(settings: SchedulerSettings) -> int:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(SchedulerService(settings).run())
