"""A standby scheduler outlives a Redis restart while it campaigns for the lease (found by
`lockstep chaos`: the standby exited with code 1 at every Redis restart)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.scheduler.service import SchedulerService
from shared.bus import connect
from shared.redis_server import EmbeddedRedis
from shared.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(60)


class _Log:
    """Records events; ``seen(name)`` is an event to await instead of a sleep."""

    def __init__(self) -> None:
        self.events: dict[str, asyncio.Event] = {}

    def seen(self, name: str) -> asyncio.Event:
        return self.events.setdefault(name, asyncio.Event())

    def _note(self, event: str, **_: Any) -> None:
        self.seen(event).set()

    info = warning = error = debug = _note


def test_standby_campaigns_through_a_redis_restart(namespace):
    server = EmbeddedRedis().start()   # a private server: this test stops it

    async def go() -> None:
        svc = SchedulerService(SchedulerSettings(redis_url=server.url, namespace=namespace, lease_ms=300, ranks=1))
        svc.log = log = _Log()
        svc.attach(connect(server.url))
        try:
            await svc.r.set(svc.keys.leader, "other-leader", px=60_000)   # someone else leads
            campaign = asyncio.create_task(svc.leadership.become_leader())
            await asyncio.sleep(0)
            server.stop()                                                 # Redis goes away...
            await asyncio.wait_for(log.seen("redis_unavailable").wait(), 10)
            assert not campaign.done(), campaign.exception()              # ...and the standby stays
            server.start()                                                # back, empty: the lease is free
            assert await asyncio.wait_for(campaign, 20) is True
            assert await svc.r.get(svc.keys.leader) == svc.id.encode()
            assert svc.dispatcher_id.startswith("scheduler.")
        finally:
            await svc.r.aclose()

    try:
        asyncio.run(go())
    finally:
        server.stop()
