"""A recovery scan reads a dead rank's undelivered entries only up to the inbox's tail when
it began, and does nothing while no rank is live (services/scheduler/housekeeping.py),
against the real Redis.

Before: when work resumed off a dead rank was placed back on a dead rank's inbox (the
scheduler's fallback when no rank is live), the scan's ``while True`` read picked it up
again and resumed it again, round after round within one scan (epochs 0 -> 7 in 25 ms,
tests/test_stalled_rank.py's log)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.scheduler import housekeeping
from services.scheduler.housekeeping import recover_orphans
from shared import keys as K
from shared.bus import connect, decode_entries, ensure_group
from shared.messages import FIELD, Request, Retire, SamplingParams, encode
from shared.replies import as_str

pytestmark = pytest.mark.timeout(60)

API = "apiB"


def _req(rid: str, epoch: int = 0) -> bytes:
    return encode(Request(rid, API, [1, 2, 3], SamplingParams(max_tokens=4), time.time(), epoch=epoch))


async def _dead_rank_with(r, keys: K.Keys, undelivered: list[bytes],
                          pending: list[bytes] | None = None) -> None:
    """Rank 0's incarnation ``rank0-a`` read ``pending`` (it ran them) and died; then
    ``undelivered`` were placed on it."""
    inbox = keys.inbox(0)
    await ensure_group(r, inbox, K.ENGINE_GROUP, "0")
    for doc in pending or []:
        await r.xadd(inbox, {FIELD: doc})
    await r.xreadgroup(K.ENGINE_GROUP, "rank0-a", {inbox: ">"}, count=1000)   # (creates the consumer)
    await r.hset(keys.rank_info(0), mapping={"consumer": "rank0-a"})
    for doc in undelivered:
        await r.xadd(inbox, {FIELD: doc})


async def test_work_resumed_onto_a_dead_inbox_waits_for_the_next_scan(redis_url, namespace, monkeypatch):
    """Rank 0 is dead, rank 1 live; what recovery resumes is placed straight back on rank
    0 (a policy whose only ranks are dead: the no-live-rank fallback, or every live rank
    drained) while the scan still runs. Each request is resumed once per scan."""
    monkeypatch.setattr(housekeeping, "PAGE", 1)   # one entry a round trip: the scan lasts
    r, echo_r = connect(redis_url), connect(redis_url)
    keys = K.Keys(namespace)
    n = 20
    inbox, out = keys.inbox(0), keys.out(API)
    placed_back = asyncio.Event()
    echoed = 0
    task = None

    async def place_back() -> None:
        """The api-server and the scheduler in one: each resumed request back on rank 0,
        one epoch up (bounded, so that the cycle ends without the fix too)."""
        nonlocal echoed
        last, epoch = b"0-0", {}
        while True:
            resp = await echo_r.xread({out: last}, block=200)
            for _, eid, doc in decode_entries(resp):
                last = eid
                for rid in doc["ids"]:
                    epoch[rid] = epoch.get(rid, 0) + 1
                    if epoch[rid] <= 5:
                        await echo_r.xadd(inbox, {FIELD: _req(rid, epoch[rid])})
                        echoed += 1
                        if echoed >= n:
                            placed_back.set()

    try:
        await _dead_rank_with(r, keys, [_req(f"q{i}") for i in range(n)])
        task = asyncio.create_task(place_back())
        by_api = await asyncio.wait_for(recover_orphans(r, keys, [0, 1], {1}, {0, 1}), 30)
        ids = by_api.get(API, [])
        assert sorted(ids) == sorted(f"q{i}" for i in range(n)), f"resumed {len(ids)} times in one scan"
        await asyncio.wait_for(placed_back.wait(), 10)
        assert echoed == n
        # What was placed back waits, undelivered, for the next scan (or the rank).
        groups = {as_str(g["name"]): g for g in await r.xinfo_groups(inbox)}
        assert groups[K.ENGINE_GROUP]["lag"] == n
        assert (await r.xpending(inbox, K.ENGINE_GROUP))["pending"] == 0
        # The next scan resumes those, once each again.
        by_api = await asyncio.wait_for(recover_orphans(r, keys, [0, 1], {1}, {0, 1}), 30)
        assert sorted(by_api.get(API, [])) == sorted(f"q{i}" for i in range(n))
    finally:
        if task is not None:
            task.cancel()
        await r.aclose()
        await echo_r.aclose()


async def test_with_no_live_rank_recovery_waits(redis_url, namespace):
    """Every rank taken for dead (a stall of the whole group, a Redis failover that
    outlasted every heartbeat): nothing is resumed, claimed or acked; the rank that comes
    back finds its work and its retires where they were."""
    r = connect(redis_url)
    keys = K.Keys(namespace)
    inbox = keys.inbox(0)
    try:
        retire = encode(Retire("q0", 0, 0))
        await _dead_rank_with(r, keys, [_req("q1"), retire], pending=[_req("q0")])
        for _ in range(2):
            assert await recover_orphans(r, keys, [0], set(), {0}) == {}
        assert await r.xrange(keys.out(API)) == []
        pending = await r.xpending_range(inbox, K.ENGINE_GROUP, min="-", max="+", count=10)
        assert [as_str(p["consumer"]) for p in pending] == ["rank0-a"]
        back = await r.xreadgroup(K.ENGINE_GROUP, "rank0-a", {inbox: ">"}, count=10)
        assert [(d["k"], d["id"]) for _, _, d in decode_entries(back)] == [("req", "q1"), ("retire", "q0")]
    finally:
        await r.aclose()
