"""The api-server's snapshot follower survives a lost connection (issue #14 item 7):
against the real embedded Redis, kill the follower's pub/sub connection (CLIENT KILL)
and assert it subscribes again and observes the snapshots published afterwards. Without
it, a client-dispatch replica's local view only grows (no snapshot ever clears it)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import keys as K
from shared.bus import connect
from shared.stats import RankStats, Snapshot
from services.api_server.gateway import Gateway

pytestmark = [pytest.mark.timeout(60)]


class RecordingPolicy:
    """Stands in for a client-dispatch policy: records the snapshots it is fed."""

    name = "recording"

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.fed = asyncio.Event()

    def set_ranks(self, ranks: list[int]) -> None:
        pass

    def choose(self, *args, **kwargs) -> int:   # noqa: ARG002 - client dispatch needs it
        return 0

    def on_snapshot(self, snap: Snapshot) -> None:
        self.seqs.append(snap.seq)
        self.fed.set()


def _blob(seq: int) -> bytes:
    import orjson
    stats = RankStats(rank=0, wave=1, step=seq, waiting=0, running=0, scheduled=0, prefill=0, decode=0,
                      kv_used=0, kv_total=1, outstanding=0, idle=False, dur_ms=1.0, t=time.time())
    return orjson.dumps(Snapshot(wave=1, step=seq, t=time.time(), ranks={0: stats}, seq=seq).to_dict())


async def _publish_until_seen(r, keys: K.Keys, policy: RecordingPolicy, seq: int, bound_s: float) -> None:
    """Publish snapshot ``seq`` (as the scheduler does) until the follower has it: a
    publish with no subscriber is lost, so repeat while it reaches nobody."""
    deadline = time.monotonic() + bound_s
    while seq not in policy.seqs:
        assert time.monotonic() < deadline, f"the follower never saw snapshot {seq} (saw {policy.seqs})"
        policy.fed.clear()
        pipe = r.pipeline(transaction=True)
        pipe.hset(keys.snapshot, mapping={"json": _blob(seq), "seq": seq})
        pipe.publish(keys.snapshot, _blob(seq))
        await pipe.execute()
        try:
            await asyncio.wait_for(policy.fed.wait(), 0.2)
        except asyncio.TimeoutError:
            pass


async def _killed_follower(redis_url: str, namespace: str) -> None:
    keys = K.Keys(namespace)
    admin = connect(redis_url)
    r = connect(redis_url)
    policy = RecordingPolicy()
    gw = Gateway(r, keys, "apitest", dispatch="client", policy=policy)
    await gw.start()
    try:
        await _publish_until_seen(admin, keys, policy, 1, 10)
        # Cut every pub/sub connection of this namespace's follower (the only subscriber
        # on the test server's channel).
        killed = await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        assert int(killed) >= 1
        await _publish_until_seen(admin, keys, policy, 2, 15)
        await _publish_until_seen(admin, keys, policy, 3, 5)
    finally:
        await gw.stop()
        await r.aclose()
        await admin.aclose()


def test_snapshot_follower_reconnects_after_its_connection_is_killed(redis_url, namespace):
    asyncio.run(_killed_follower(redis_url, namespace))
