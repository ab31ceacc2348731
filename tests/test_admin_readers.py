"""What the operator commands read from Redis, against the real embedded Redis:
`lockstep bench`'s reader of the step stats ends at its stop, whatever else keeps the
engines stepping (it read until a poll came back empty, which never happened on a cluster
with other traffic, so a bench there never ended); `lockstep status` names the lease's
holder as the leader."""

from __future__ import annotations

import asyncio

import pytest

from services.admin.stats_follower import StatsFollower
from shared.bus import connect

pytestmark = pytest.mark.timeout(60)


async def _flow(url: str, namespace: str) -> None:
    r = connect(url)
    stream = f"{namespace}:stats"
    follower = StatsFollower(r, stream)
    await follower.start_id()
    writing = True

    async def other_traffic() -> None:
        i = 0
        while writing:
            await r.xadd(stream, {b"d": b'{"step": %d}' % i})
            i += 1
            await asyncio.sleep(0.02)

    writer = asyncio.create_task(other_traffic())
    reader = asyncio.create_task(follower.run())
    try:
        await asyncio.sleep(0.5)
        follower.stop()
        await asyncio.wait_for(reader, 5)          # ends though entries keep coming
        assert len(follower.rows) >= 10
    finally:
        writing = False
        await writer
        reader.cancel()
        await r.aclose()


def test_the_reader_ends_at_its_stop_while_other_traffic_goes_on(redis_url, namespace):
    asyncio.run(_flow(redis_url, namespace))


def test_status_names_the_lease_holder_not_a_dead_leaders_record(redis_url, namespace):
    """The scheduler's hash keeps the last leader's id after it died; status showed it as
    the leader, in text and JSON, with no lease held."""
    import redis as redis_sync

    from services.admin.status import collect
    from shared import keys as K

    keys = K.Keys(namespace)
    r = redis_sync.Redis.from_url(redis_url)
    r.hset(keys.cluster, mapping={"ranks": 1})
    r.hset(keys.scheduler, mapping={"leader": "sched-dead", "pid": 1})
    assert asyncio.run(collect(redis_url, namespace))["scheduler"]["leader"] is None
    r.set(keys.leader, "sched-live")
    assert asyncio.run(collect(redis_url, namespace))["scheduler"]["leader"] == "sched-live"
