"""redis-py's Sentinel clients, made to leave a demoted primary at once.

redis-py asks the sentinels for the primary only when it opens a connection. After a
failover the old primary goes on accepting writes on the connections already open until
Sentinel turns it into a replica (its next look at it: up to 10 s), and everything
written there in between is lost when it resyncs: with lockstep, heartbeats that seem to
lapse and stream entries that vanish. Even ``+switch-master`` comes late: Sentinel
announces it only after the replica it chose was promoted, and what reached the old
primary between the promotion and the switch is lost too (seen: a token missing from a
stream). So the asyncio client follows the sentinels' announcements: at
``+selected-slave`` (before Sentinel promotes it) it drops every connection of the pool
and heads for the chosen replica, whose READONLY answers every service retries until the
promotion; ``+switch-master`` or a ``-failover-abort-*`` end that. The synchronous one (the
engines' liveness thread) asks the sentinels at most once a second whether the primary
moved (a lost heartbeat is written again a second later).
shared/bus.py's ``connect``/``connect_sync`` build these for ``redis+sentinel://`` URLs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool

from shared.replies import as_str

SWITCH_CHANNEL = "+switch-master"
SELECTED_CHANNEL = "+selected-slave"
ABORT_PATTERN = "-failover-abort-*"
CHECK_EVERY_S = 1.0
HEADING_BOUND_S = 30.0      # a failover that neither ends nor aborts by then: ask the sentinels again


class FollowingPool(SentinelConnectionPool):
    """Connects to the replica a failover is promoting, once the watcher says so."""

    heading_to: tuple[str, int] | None = None
    heading_until = 0.0

    async def get_master_address(self) -> Any:
        if self.heading_to is not None and time.monotonic() < self.heading_until:
            if self.master_address != self.heading_to:
                self.master_address = self.heading_to
                await self.disconnect(inuse_connections=False)
            return self.heading_to
        self.heading_to = None
        return await super().get_master_address()


def announcement(channel: str, data: str, service: str) -> tuple[str, tuple[str, int] | None] | None:
    """What a sentinel's message means for ``service``: ("head", address) when a failover
    chose its new primary, ("done", None) when it switched or aborted; None otherwise."""
    parts = data.split()
    if channel == SELECTED_CHANNEL and "@" in parts:
        at = parts.index("@")
        if parts[0] == "slave" and len(parts) > at + 1 and parts[at + 1] == service:
            return "head", (parts[2], int(parts[3]))
    elif channel == SWITCH_CHANNEL and parts and parts[0] == service:
        return "done", None
    elif channel.startswith("-failover-abort") and len(parts) > 1 and parts[1] == service:
        return "done", None
    return None


class AsyncSentinelRedis(aioredis.Redis):
    """``master_for(..., redis_class=AsyncSentinelRedis)``, then ``follow(sentinel, service)``."""

    def follow(self, sentinel: Any, service: str) -> "AsyncSentinelRedis":
        self._sentinel, self._service, self._watcher = sentinel, service, None
        return self

    def _watch(self) -> None:
        if getattr(self, "_watcher", 0) is None:
            try:
                self._watcher = asyncio.get_running_loop().create_task(self._follow_switches())
            except RuntimeError:   # no loop yet: the first command inside one starts it
                pass

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self._watch()
        return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        self._watch()
        return super().pipeline(transaction, shard_hint)

    async def _follow_switches(self) -> None:
        delay = 0.1
        while True:
            for node in self._sentinel.sentinels:
                # Its own connection with no read timeout: announcements come rarely.
                kw = node.connection_pool.connection_kwargs
                listener = aioredis.Redis(host=kw.get("host", "localhost"), port=kw.get("port", 26379),
                                          socket_connect_timeout=5.0, socket_keepalive=True)
                pubsub = listener.pubsub()
                try:
                    await pubsub.subscribe(SWITCH_CHANNEL, SELECTED_CHANNEL)
                    await pubsub.psubscribe(ABORT_PATTERN)
                    delay = 0.1
                    async for msg in pubsub.listen():
                        if msg.get("type") not in ("message", "pmessage"):
                            continue
                        channel, data = as_str(msg.get("channel")), as_str(msg.get("data"))
                        said = announcement(channel, data, self._service)
                        if said is None:
                            continue
                        pool = self.connection_pool
                        if isinstance(pool, FollowingPool):
                            pool.heading_to = said[1]
                            pool.heading_until = time.monotonic() + HEADING_BOUND_S
                        await pool.disconnect(inuse_connections=True)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - that sentinel is gone: the next one
                    pass
                finally:
                    try:
                        await pubsub.aclose()
                        await listener.aclose()
                    except Exception:  # noqa: BLE001
                        pass
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        watcher, self._watcher = getattr(self, "_watcher", None), 0
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await super().aclose(close_connection_pool)


class SyncSentinelRedis(redis.Redis):
    """``master_for(..., redis_class=SyncSentinelRedis)``, then ``follow(sentinel, service)``."""

    def follow(self, sentinel: Any, service: str) -> "SyncSentinelRedis":
        self._sentinel, self._service = sentinel, service
        self._primary, self._checked = None, 0.0
        return self

    def _check(self) -> None:
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        try:
            primary = self._sentinel.discover_master(self._service)
        except redis.RedisError:
            return
        if self._primary is not None and primary != self._primary:
            self.connection_pool.disconnect()
        self._primary = primary

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self._check()
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        self._check()
        return super().pipeline(transaction, shard_hint)
