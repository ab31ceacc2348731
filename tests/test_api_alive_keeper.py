"""An api-server whose event loop stalls keeps its heartbeat key: the engines abort the
requests of a replica whose key has been gone for 5 s, and a burst of 10,000 requests at
once on a 2-core host stalled a live replica's loop that long (127 admitted requests ended
with a 503). A wedged loop still loses the key. Against a real Redis."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from services.api_server.alive_keeper import AliveKeeper
from services.api_server.gateway import Gateway
from shared import keys as K
from shared.bus import connect
from tests.helpers import wait_until

pytestmark = [pytest.mark.timeout(60)]


def _watch(r: redis.Redis, key: str, for_s: float, seen: list[bool]) -> threading.Thread:
    def run() -> None:
        end = time.monotonic() + for_s
        while time.monotonic() < end:
            seen.append(bool(r.exists(key)))
            time.sleep(0.1)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_replica_whose_loop_stalls_keeps_its_heartbeat(redis_url, namespace):
    keys = K.Keys(namespace)
    key = keys.api_alive("apistall")
    sync = redis.Redis.from_url(redis_url)

    async def flow() -> list[bool]:
        r = connect(redis_url)
        gw = Gateway(r, keys, "apistall", redis_url=redis_url)
        await gw.start()
        try:
            await wait_until(lambda: r.exists(key), 10)
            seen: list[bool] = []
            watcher = _watch(sync, key, 4.5, seen)
            time.sleep(5.0)   # the fault: the event loop blocked for 5 s (its own beat cannot run)
            watcher.join()
            return seen
        finally:
            await gw.stop()
            await r.aclose()

    try:
        seen = asyncio.run(flow())
        assert seen and all(seen), f"the key lapsed during the stall: {seen}"
        assert not sync.exists(key)          # a replica that stops deletes it, and the thread writes it no more
    finally:
        sync.close()


def test_a_wedged_loop_lets_the_key_lapse(redis_url, namespace):
    key = K.Keys(namespace).api_alive("apiwedged")
    sync = redis.Redis.from_url(redis_url)

    events: list[str] = []

    class Log:
        def error(self, event: str, **_: object) -> None:
            events.append(event)

    keeper = AliveKeeper(redis_url, key, Log(), stall_bound_s=1.0)
    stop = keeper.start()
    try:
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:   # the loop goes round: the thread writes the key
            keeper.mark_progress()
            time.sleep(0.1)
        assert sync.exists(key)
        end = time.monotonic() + 8           # it stops going round: bound (1 s) + the key's life (3 s)
        while sync.exists(key) and time.monotonic() < end:
            time.sleep(0.1)
        assert not sync.exists(key) and "api_server_stalled" in events
    finally:
        stop()
        sync.close()
