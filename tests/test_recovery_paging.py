"""Acked only when durable, and paged until empty (issue #14.5), against the real Redis:

* the scheduler's ``recover_orphans`` resumes *every* entry a dead engine incarnation
  left pending (more than one page, more than the old 10,000 cap), and writes each resume
  notice in the same transaction as the ack: a crash in between loses nothing;
* an engine re-reading its own pending entries after a lost reply pages through all of
  them, not just the first ``count``."""

from __future__ import annotations

import time

import pytest
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError

from services.engine_worker.inbox_reader import InboxReader
from services.engine_worker.worker import EngineWorker
from services.scheduler.housekeeping import recover_orphans
from shared import keys as K
from shared.bus import connect, decode_entries, ensure_group
from shared.messages import FIELD, Request, SamplingParams, dumps
from shared.settings import EngineSettings

pytestmark = pytest.mark.timeout(120)


def _doc(i: int, api: str = "apiR") -> bytes:
    return dumps(Request(f"q{i}", api, list(b"hey"), SamplingParams(max_tokens=2), time.time(), rank=0).to_dict())


async def _strand(r, keys: K.Keys, n: int, consumer: str = "rank0-dead") -> None:
    """n inbox entries delivered to (pending under) a dead incarnation's consumer."""
    inbox = keys.inbox(0)
    await ensure_group(r, inbox, K.ENGINE_GROUP, "0")
    for start in range(0, n, 2000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 2000)):
            pipe.xadd(inbox, {FIELD: _doc(i)})
        await pipe.execute()
    got = await r.xreadgroup(K.ENGINE_GROUP, consumer, {inbox: ">"}, count=n + 10)
    assert sum(len(b) for _, b in got) == n
    # The rank lives on under a new incarnation (a spare took it over).
    await r.hset(keys.rank_info(0), mapping={"consumer": "rank0-new"})


async def _resumed_ids(r, keys: K.Keys, api: str = "apiR") -> list[str]:
    return [rid for _, _, doc in decode_entries([(b"x", await r.xrange(keys.out(api)))])
            if doc.get("k") == "resume" for rid in doc["ids"]]


async def test_every_stranded_entry_is_resumed_beyond_one_page(redis_url, namespace):
    r = connect(redis_url)
    keys = K.Keys(namespace)
    n = 10_050                                   # above the old 10,000 claim cap
    try:
        await _strand(r, keys, n)
        by_api = await recover_orphans(r, keys, [0], {0}, {0})
        assert len(by_api["apiR"]) == n
        resumed = await _resumed_ids(r, keys)
        assert len(resumed) == n and len(set(resumed)) == n
        assert (await r.xpending(keys.inbox(0), K.ENGINE_GROUP))["pending"] == 0
    finally:
        await r.aclose()


async def test_a_crash_before_the_notices_loses_nothing(redis_url, namespace, monkeypatch):
    r = connect(redis_url)
    keys = K.Keys(namespace)
    try:
        await _strand(r, keys, 30)
        real = Pipeline.execute
        crashed = {"n": 0}

        async def execute(self, *a, **kw):
            if not crashed["n"] and any(args and args[0] == "XADD" for args, _ in self.command_stack):
                crashed["n"] += 1
                await self.reset()
                raise RedisConnectionError("connection lost (test)")
            return await real(self, *a, **kw)

        monkeypatch.setattr(Pipeline, "execute", execute)
        with pytest.raises(RedisConnectionError):
            await recover_orphans(r, keys, [0], {0}, {0})
        assert crashed["n"] == 1
        assert await _resumed_ids(r, keys) == []
        # Not acked without its notice: still pending (now under recovery).
        assert (await r.xpending(keys.inbox(0), K.ENGINE_GROUP))["pending"] == 30
        # The next scan resumes them, each exactly once.
        by_api = await recover_orphans(r, keys, [0], {0}, {0})
        assert sorted(by_api["apiR"]) == sorted(f"q{i}" for i in range(30))
        resumed = await _resumed_ids(r, keys)
        assert sorted(resumed) == sorted(f"q{i}" for i in range(30))
        assert (await r.xpending(keys.inbox(0), K.ENGINE_GROUP))["pending"] == 0
        consumers = {c["name"] for c in await r.xinfo_consumers(keys.inbox(0), K.ENGINE_GROUP)}
        assert b"rank0-dead" not in consumers and "rank0-dead" not in consumers
    finally:
        await r.aclose()


async def test_engine_rereads_all_its_pending_entries_after_a_lost_reply(redis_url, namespace):
    r = connect(redis_url)
    keys = K.Keys(namespace)
    w = EngineWorker(EngineSettings(redis_url=redis_url, namespace=namespace, rank=0, ranks=1))
    reader = InboxReader(r, keys, w.state, "rank0-me", w.log)
    inbox = keys.inbox(0)
    try:
        await ensure_group(r, inbox, K.ENGINE_GROUP, "0")
        for i in range(7):
            await r.xadd(inbox, {FIELD: _doc(i)})
        # The server delivered all 7 to us, but the reply was lost.
        await r.xreadgroup(K.ENGINE_GROUP, reader.consumer, {inbox: ">"}, count=100)
        await reader.on_redis_retry()
        for _ in range(8):                       # pages of 2 (count = room), then one empty page
            resp = await r.xreadgroup(K.ENGINE_GROUP, reader.consumer, {inbox: reader.read_from()}, count=2)
            reader.take(resp)
        assert sorted(doc["id"] for _, doc in reader.fetched) == sorted(f"q{i}" for i in range(7))
        assert reader.read_from() == ">"             # done: back to new entries
    finally:
        await r.aclose()


async def test_a_dead_schedulers_consumer_is_forgotten_once_it_holds_nothing(redis_url, namespace):
    # Each failover left the dead leader's name in the requests group for good.
    from services.scheduler.intake import forget_idle_consumers

    r = connect(redis_url)
    keys = K.Keys(namespace)
    try:
        await ensure_group(r, keys.requests, K.SCHEDULER_GROUP, "0")
        for i in range(3):
            await r.xadd(keys.requests, {FIELD: b"{}"})
        await r.xreadgroup(K.SCHEDULER_GROUP, "sched-dead", {keys.requests: ">"}, count=1)
        got = await r.xreadgroup(K.SCHEDULER_GROUP, "sched-stepped-down", {keys.requests: ">"}, count=1)
        await r.xack(keys.requests, K.SCHEDULER_GROUP, got[0][1][0][0])
        await r.xreadgroup(K.SCHEDULER_GROUP, "sched-me", {keys.requests: ">"}, count=1)
        await r.xack(keys.requests, K.SCHEDULER_GROUP, *[e[0] for e in (await r.xrange(keys.requests))[2:]])
        # nothing is idle for an hour yet: nothing goes
        assert await forget_idle_consumers(r, keys, "sched-me", 3_600_000) == 0
        assert await forget_idle_consumers(r, keys, "sched-me", 0) == 1
        names = {c["name"] for c in await r.xinfo_consumers(keys.requests, K.SCHEDULER_GROUP)}
        # the one holding an entry stays (its entry is reclaimed first), and the leader
        assert {n.decode() if isinstance(n, bytes) else n for n in names} == {"sched-dead", "sched-me"}
    finally:
        await r.aclose()
