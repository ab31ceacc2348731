"""The scheduler service driven directly (no cluster) against the real embedded Redis:
unplaced requests that are aborted, back-pressure, loops that survive errors, failover ids.

Each test runs a ``SchedulerService`` in the test's event loop, writes request-stream
entries the way an api-server does, and reads what reached the rank inboxes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

import pytest

from services.scheduler.service import SchedulerService
from shared import keys as K
from shared.bus import connect, decode_entries
from shared.messages import FIELD, Abort, Request, SamplingParams, dumps
from shared.policy.staggered import BatcherFull, StaggeredBatcher
from shared.settings import SchedulerSettings
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)


def _settings(redis_url: str, namespace: str, **kw: Any) -> SchedulerSettings:
    base = dict(redis_url=redis_url, namespace=namespace, ranks=2, policy="staggered", max_wait_ms=300.0,
                lease_ms=1000)
    base.update(kw)
    return SchedulerSettings(**base)


def _req(rid: str, api: str = "apiT", epoch: int = 0, rank: int | None = None) -> bytes:
    return dumps(Request(rid, api, list(b"hello"), SamplingParams(max_tokens=4), time.time(), rank=rank,
                         epoch=epoch).to_dict())


@contextlib.asynccontextmanager
async def running(svc: SchedulerService) -> AsyncIterator[asyncio.Task]:
    task = asyncio.create_task(svc.run())
    r = connect(svc.s.redis_url)
    try:
        await wait_until(lambda: _leads(r, svc), timeout=10)
        yield task
    finally:
        svc.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await r.aclose()


async def _leads(r: Any, svc: SchedulerService) -> bool:
    return await r.get(svc.keys.leader) == svc.id.encode()


async def _inbox_docs(r: Any, keys: K.Keys, ranks: int = 2) -> dict[str, dict]:
    out = {}
    for rank in range(ranks):
        for _, _, doc in decode_entries([(b"x", await r.xrange(keys.inbox(rank)))]):
            if doc.get("k") == "req":
                out[doc["id"]] = doc
    return out


async def test_aborting_an_unplaced_request_loses_no_other_request(redis_url, namespace):
    """Issue #14.2: an abort of an unplaced request drops it from the batcher too; the next
    batch goes out whole and nothing is acked that was not emitted."""
    svc = SchedulerService(_settings(redis_url, namespace))
    keys = svc.keys
    r = connect(redis_url)
    try:
        async with running(svc) as task:
            await r.xadd(keys.requests, {FIELD: _req("A")})
            await wait_until(lambda: _unplaced(svc, "A"), timeout=5)
            await r.xadd(keys.requests, {FIELD: dumps(Abort("A").to_dict())})
            # The client of A gets its abort straight from the scheduler (A never reached a rank).
            await wait_until(lambda: _out_has_abort(r, keys, "apiT", "A"), timeout=5)
            for rid in ("B", "C"):
                await r.xadd(keys.requests, {FIELD: _req(rid)})
            docs = await wait_until(lambda: _have(r, keys, {"B", "C"}), timeout=5)
            assert "A" not in docs
            assert not task.done(), "the scheduler stopped"
            assert docs["B"]["b"] == docs["C"]["b"], "B and C go out as one batch"
            assert sum(docs["B"]["bc"]) == 2, "the batch counts do not include the aborted request"
            # Everything was either emitted or answered: nothing left pending or unplaced.
            await wait_until(lambda: _nothing_pending(r, keys), timeout=5)
            assert not svc.unplaced
    finally:
        await r.aclose()


async def test_an_abort_after_a_failover_reaches_the_rank_an_earlier_leader_placed_on(redis_url, namespace):
    """The leader that placed a request died; its client goes away under the next one. The
    abort (the api-server sends no rank) must reach the rank that runs it: the new leader
    did not place it, and used to drop the abort, so the rank ran the request to its end
    for nobody. The new leader reads the rank from the request's record."""
    r = connect(redis_url)
    first = SchedulerService(_settings(redis_url, namespace, policy="least_score"))
    keys = first.keys
    try:
        async with running(first):
            await r.xadd(keys.requests, {FIELD: _req("P")})
            docs = await wait_until(lambda: _have(r, keys, {"P"}), timeout=5)
        rank = docs["P"]["r"]
        second = SchedulerService(_settings(redis_url, namespace, policy="least_score"))
        async with running(second):
            assert "P" not in second.state.assigned
            await r.xadd(keys.requests, {FIELD: dumps(Abort("P").to_dict())})
            await wait_until(lambda: _inbox_has_abort(r, keys, rank, "P"), timeout=5)
            # One that finished is not aborted again (its record says so).
            await r.hset(keys.req("Q"), mapping={"rank": 1 - rank, "state": "finished"})
            await r.xadd(keys.requests, {FIELD: dumps(Abort("Q").to_dict())})
            await wait_until(lambda: _nothing_pending(r, keys), timeout=5)
            assert not await _inbox_has_abort(r, keys, 1 - rank, "Q")
    finally:
        await r.aclose()


async def test_a_scheduler_stopped_while_redis_is_gone_exits_cleanly(tmp_path):
    """Its last write, the lease's release, found no server: it raised out of ``run`` (a
    traceback on every stop of a cluster whose Redis went first). Now it logs that the lease
    will lapse and returns 0."""
    from shared.redis_server import EmbeddedRedis

    srv = EmbeddedRedis().start()
    try:
        svc = SchedulerService(_settings(srv.url, "gone", policy="least_score"))
        task = asyncio.create_task(svc.run())
        r = connect(srv.url)
        try:
            await wait_until(lambda: _leads(r, svc), timeout=10)
        finally:
            await r.aclose()
        srv.stop()
        svc.stop.set()
        assert await asyncio.wait_for(task, 30) == 0
    finally:
        srv.stop()


async def _inbox_entries(r: Any, keys: K.Keys, ranks: Any, rid: str | None = None) -> list[dict]:
    """Every entry in these ranks' inboxes (of request ``rid`` only, if given), in order."""
    return [doc for rank in ranks for _, _, doc in decode_entries([(b"x", await r.xrange(keys.inbox(rank)))])
            if rid is None or doc.get("id") == rid]


async def _inbox_has_abort(r: Any, keys: K.Keys, rank: int, rid: str) -> bool:
    return any(doc.get("k") == "abort" and doc.get("id") == rid
               for _, _, doc in decode_entries([(b"x", await r.xrange(keys.inbox(rank)))]))


async def test_a_request_resubmitted_while_held_takes_the_held_ones_place(redis_url, namespace):
    """An api-server resumes every request in flight when Redis restarted empty, the ones
    the scheduler still holds unplaced too. The newer copy takes the held one's place: one
    request placed once, at the new epoch. Before, both went to the batcher: two copies
    reached the ranks (or a release found none to emit)."""
    svc = SchedulerService(_settings(redis_url, namespace, max_wait_ms=400.0))
    keys = svc.keys
    r = connect(redis_url)
    try:
        async with running(svc):
            await r.xadd(keys.requests, {FIELD: _req("H")})
            await wait_until(lambda: _unplaced(svc, "H"), timeout=5)
            await r.xadd(keys.requests, {FIELD: _req("H", epoch=1)})
            await wait_until(lambda: _have(r, keys, {"H"}), timeout=5)
            await wait_until(lambda: _nothing_pending(r, keys), timeout=5)
            copies = await _inbox_entries(r, keys, range(2), "H")
            assert len(copies) == 1 and copies[0].get("ep") == 1, copies
            assert not svc.unplaced
    finally:
        await r.aclose()


async def test_a_second_copy_of_a_placed_submission_is_dropped(redis_url, namespace):
    """An api-server writes a submission again when its connection dropped mid-write, and
    the first write may have landed: the copy of a request placed already is acked and
    dropped (two copies would run, their tokens interleaved in one stream)."""
    svc = SchedulerService(_settings(redis_url, namespace, policy="least_score"))
    keys = svc.keys
    r = connect(redis_url)
    try:
        async with running(svc):
            await r.xadd(keys.requests, {FIELD: _req("D")})
            await wait_until(lambda: _have(r, keys, {"D"}), timeout=5)
            await r.xadd(keys.requests, {FIELD: _req("D")})
            await wait_until(lambda: _nothing_pending(r, keys), timeout=5)
            copies = await _inbox_entries(r, keys, range(2), "D")
            assert len(copies) == 1 and svc.state.counters.get("duplicates") == 1, copies
    finally:
        await r.aclose()


async def test_a_resumed_request_placed_on_another_rank_retires_the_copy_left_on_the_first(redis_url, namespace):
    """A resumed request (new epoch) that the scheduler places on another rank than the
    copy it placed before: that rank is told to retire the old copy, which its api-server
    could not (no token had told it the rank), so it does not run on for nobody."""
    svc = SchedulerService(_settings(redis_url, namespace, policy="least_score"))
    keys = svc.keys
    r = connect(redis_url)
    try:
        async with running(svc):
            await r.xadd(keys.requests, {FIELD: _req("M")})
            first = (await wait_until(lambda: _have(r, keys, {"M"}), timeout=5))["M"]["r"]
            await r.xadd(keys.requests, {FIELD: _req("M", epoch=1, rank=1 - first)})
            await wait_until(lambda: _nothing_pending(r, keys), timeout=5)
            retires = [doc for doc in await _inbox_entries(r, keys, [first]) if doc.get("k") == "retire"]
            assert retires == [{"k": "retire", "id": "M", "r": first, "ep": 0}], retires
            again = await _inbox_entries(r, keys, [1 - first], "M")
            assert [d.get("ep") for d in again] == [1] and not any(d.get("k") == "retire" for d in again)
    finally:
        await r.aclose()


async def test_batcher_full_leaves_the_entry_on_the_stream(redis_url, namespace, monkeypatch):
    """Issue #14.2: ``BatcherFull`` is back-pressure: the entry is not acked, and it is
    dispatched once the batcher takes it."""
    svc = SchedulerService(_settings(redis_url, namespace, max_wait_ms=20.0))
    real_submit = StaggeredBatcher.submit
    calls = {"n": 0}

    def submit(self, info, now):
        calls["n"] += 1
        if calls["n"] == 1:
            raise BatcherFull("full (test)")
        return real_submit(self, info, now)

    # (On the class: the leader builds its policy when it takes the lease.)
    monkeypatch.setattr(StaggeredBatcher, "submit", submit)
    r = connect(redis_url)
    try:
        async with running(svc) as task:
            await r.xadd(svc.keys.requests, {FIELD: _req("X")})
            await wait_until(lambda: _have(r, svc.keys, {"X"}), timeout=10)
            assert calls["n"] >= 2
            assert not task.done()
            assert svc.counters["bad_entries"] == 0
    finally:
        await r.aclose()


async def test_a_failing_loop_goes_on(redis_url, namespace, monkeypatch):
    """Issue #14.2: a non-Redis error in a loop is logged and the loop goes on; the
    scheduler never exits on it."""
    svc = SchedulerService(_settings(redis_url, namespace, max_wait_ms=20.0))
    real_poll = StaggeredBatcher.poll
    calls = {"n": 0}

    def poll(self, now):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("a bug (test)")
        return real_poll(self, now)

    monkeypatch.setattr(StaggeredBatcher, "poll", poll)
    r = connect(redis_url)
    try:
        async with running(svc) as task:
            await wait_until(lambda: _true(calls["n"] >= 1), timeout=5)
            await r.xadd(svc.keys.requests, {FIELD: _req("Y")})
            await wait_until(lambda: _have(r, svc.keys, {"Y"}), timeout=10)
            assert not task.done(), "the scheduler exited on a loop error"
    finally:
        await r.aclose()


async def _true(v: bool) -> bool:
    return v


async def _unplaced(svc: SchedulerService, rid: str) -> bool:
    return rid in svc.unplaced


async def _have(r: Any, keys: K.Keys, ids: set[str]) -> dict[str, dict] | None:
    docs = await _inbox_docs(r, keys)
    return docs if ids <= set(docs) else None


async def _out_has_abort(r: Any, keys: K.Keys, api: str, rid: str) -> bool:
    for _, _, doc in decode_entries([(b"x", await r.xrange(keys.out(api)))]):
        if any(d.get("id") == rid and d.get("f") == "abort" for d in doc.get("ds", ())):
            return True
    return False


async def _nothing_pending(r: Any, keys: K.Keys) -> bool:
    info = await r.xpending(keys.requests, K.SCHEDULER_GROUP)
    return not info.get("pending")


async def test_a_request_a_stepped_down_leader_still_holds_is_taken_back(redis_url, namespace, monkeypatch):
    """A leader that stalls past its lease steps down, not dies: an entry it read just
    before (or held unplaced) stays pending under its consumer after the successor's one
    reclaim at take-over. It was stranded for good: its client waited out the request
    timeout and the stream's trim stopped at it. The leader now takes such entries back
    once they have been pending long enough (STRANDED_*)."""
    from services.scheduler import intake
    monkeypatch.setattr(intake, "STRANDED_MIN_S", 0.3, raising=False)
    monkeypatch.setattr(intake, "STRANDED_LEASES", 0, raising=False)
    monkeypatch.setattr(intake, "STRANDED_SWEEP_S", 0.2, raising=False)
    svc = SchedulerService(_settings(redis_url, namespace, policy="least_score"))
    keys = svc.keys
    r = connect(redis_url)
    try:
        async with running(svc):
            await r.xadd(keys.requests, {FIELD: _req("warm")})
            await wait_until(lambda: _have(r, keys, {"warm"}), timeout=5)   # its take-over reclaim is past
            # the old leader's last read: in one transaction, so the live leader's blocked
            # read cannot get the entry first
            pipe = r.pipeline(transaction=True)
            pipe.xadd(keys.requests, {FIELD: _req("S")})
            pipe.xreadgroup(K.SCHEDULER_GROUP, "sched-old", {keys.requests: ">"}, count=1)
            _, got = await pipe.execute()
            assert got, "the old consumer read the entry"
            docs = await wait_until(lambda: _have(r, keys, {"S"}), timeout=10)
            assert docs["S"]["r"] in (0, 1)
            await wait_until(lambda: _nothing_pending(r, keys), timeout=5)
    finally:
        await r.aclose()


async def test_a_dispatch_redis_refused_is_placed_when_taken_back(redis_url, namespace):
    """A full Redis refuses the scheduler's dispatch transaction (its record, inbox write
    and ack) after the scheduler noted the placement in memory. Taken back after the
    refusal, the entry was taken for a second copy of a placed request, acked and dropped:
    nothing had it, and its client waited out request_timeout_s. The refused placement is
    forgotten (and not counted: it was counted twice), and the entry is placed when taken
    back."""
    import orjson

    from shared.bus import atomic
    from shared.policy.base import Assignment

    svc = SchedulerService(_settings(redis_url, namespace, policy="least_score"))
    keys = svc.keys
    r, admin = connect(redis_url), connect(redis_url)
    try:
        async with running(svc):
            # read by the leader and not acked (one transaction: the leader's blocked read misses it)
            pipe = r.pipeline(transaction=True)
            pipe.xadd(keys.requests, {FIELD: _req("L")})
            pipe.xreadgroup(K.SCHEDULER_GROUP, svc.id, {keys.requests: ">"}, count=10)
            await pipe.execute()
            # its dispatch, as the intake builds it, refused by a full Redis
            req = Request.from_dict(orjson.loads(_req("L")))
            counted = svc.state.counters["dispatched"]
            dispatch = atomic(svc.r, keys.requests)
            svc.writer.emit(dispatch, req, Assignment("L", 0, reason="test"), time.time())
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", "1")
            try:
                with pytest.raises(Exception, match="maxmemory"):
                    await svc.writer.commit(dispatch)
            finally:
                await admin.config_set("maxmemory", "0")
            assert "L" not in svc.state.assigned
            assert svc.state.counters["dispatched"] == counted      # (nor counted: it is placed later)
            svc.state.redis_trouble = True      # (as the retry of a refused pipeline sets it)
            await r.xadd(keys.requests, {FIELD: _req("wake")})   # the intake's blocked read returns
            await wait_until(lambda: _have(r, keys, {"L", "wake"}), timeout=10)
            assert svc.state.counters.get("duplicates", 0) == 0
            await wait_until(lambda: _nothing_pending(r, keys), timeout=5)
            assert svc.state.counters["dispatched"] == counted + 2   # L and wake, once each
    finally:
        await admin.config_set("maxmemory", "0")
        await r.aclose()
        await admin.aclose()
