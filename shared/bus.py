"""The thin Redis layer: connections, consumer groups and stream reads.

Everything that crosses services goes through here. Connections use the hiredis parser
when installed (redis-py picks it up by itself) and retry with backoff and jitter.
"""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

from shared.messages import FIELD, loads

T = TypeVar("T")

TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


class RedisUnreachable(RuntimeError):
    pass


def redact_url(url: str) -> str:
    """The URL without its password, for logs and status output."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password:
        user = parts.username or ""
        netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def connect(url: str, *, timeout_s: float | None = None) -> aioredis.Redis:
    """A pooled asyncio client. ``timeout_s`` bounds socket reads (None: block reads need it open)."""
    return aioredis.Redis.from_url(
        url, decode_responses=False, socket_connect_timeout=5.0, socket_timeout=timeout_s,
        health_check_interval=0, max_connections=256, socket_keepalive=True)


async def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """Raise RedisUnreachable with a one-line message naming the (redacted) URL."""
    client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        await asyncio.wait_for(client.ping(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure means the same to the user
        raise RedisUnreachable(
            f"cannot reach Redis at {redact_url(url)}: {exc.__class__.__name__}: {exc}. "
            "Start one, fix --redis-url / LOCKSTEP_REDIS_URL, or omit it to let `lockstep up` start its own.") from None
    finally:
        await client.aclose()


async def open_service_connection(url: str, log: Any, stop: asyncio.Event) -> aioredis.Redis | None:
    """Start-up of a service: check Redis is reachable (one clear log line if not: None),
    connect, and let SIGTERM/SIGINT set ``stop`` for a clean shutdown."""
    try:
        await check_reachable(url)
    except RedisUnreachable as exc:
        log.error("redis_unreachable", error=str(exc))
        return None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return connect(url)


async def ensure_group(r: aioredis.Redis, stream: str, group: str, start: str = "0") -> None:
    """Create a consumer group (and the stream) if missing; idempotent."""
    try:
        await r.xgroup_create(stream, group, id=start, mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def decode_entries(resp: Any) -> list[tuple[bytes, bytes, dict[str, Any]]]:
    """Flatten an XREAD/XREADGROUP reply to (stream, id, document) triples."""
    out: list[tuple[bytes, bytes, dict[str, Any]]] = []
    if not resp:
        return out
    items = resp.items() if isinstance(resp, dict) else resp
    for stream, entries in items:
        if entries and isinstance(entries[0], list) and entries and not isinstance(entries[0][0], bytes):
            entries = entries[0]
        for entry_id, fields in entries:
            if fields is None:  # entry deleted while pending
                continue
            raw = fields.get(FIELD)
            if raw is None:
                continue
            try:
                out.append((stream, entry_id, loads(raw)))
            except Exception:  # noqa: BLE001 - a corrupt entry must not stop the reader
                out.append((stream, entry_id, {"k": "corrupt"}))
    return out


def entry_id_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id ('ms-seq') as a sortable tuple."""
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


class Backoff:
    """Exponential backoff with full jitter, for reconnect loops."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0) -> None:
        self.base_s, self.cap_s, self.attempt = base_s, cap_s, 0

    def next_delay(self) -> float:
        self.attempt += 1
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** self.attempt))

    def reset(self) -> None:
        self.attempt = 0


async def retrying(op: Callable[[], Awaitable[T]], *, log: Any = None, what: str = "redis",
                   stop: asyncio.Event | None = None, give_up_s: float | None = None,
                   on_retry: Callable[[], Awaitable[None]] | None = None) -> T:
    """Run ``op`` until it succeeds, backing off on transient connection errors (and on a
    consumer group lost with a restarted server, after ``on_retry`` recreated it)."""
    backoff = Backoff()
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        try:
            result = await op()
            if backoff.attempt and log is not None:
                log.info("redis_reconnected", what=what, attempts=backoff.attempt)
            return result
        except (ResponseError, *TRANSIENT) as exc:
            if isinstance(exc, ResponseError) and "NOGROUP" not in str(exc):
                raise
            if stop is not None and stop.is_set():
                raise
            if give_up_s is not None and loop.time() - started > give_up_s:
                raise
            delay = backoff.next_delay()
            if log is not None and (backoff.attempt in (1, 2, 4, 8) or backoff.attempt % 32 == 0):
                log.warning("redis_unavailable", what=what, error=str(exc), retry_in_s=round(delay, 3),
                            attempt=backoff.attempt)
            await asyncio.sleep(delay)
            if on_retry is not None:
                try:
                    await on_retry()
                except (ResponseError, *TRANSIENT):
                    pass


class Recorder:
    """Records pipeline commands so they can be replayed on a fresh pipeline after a
    connection error (redis-py clears a pipeline's stack when execute() fails)."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.ops.append((name, args, kwargs))
        return record

    def __len__(self) -> int:
        return len(self.ops)


async def execute_recorded(r: aioredis.Redis, rec: Recorder, *, log: Any = None, what: str = "pipeline",
                           on_retry: Callable[[], Awaitable[None]] | None = None,
                           give_up_s: float | None = None) -> list[Any]:
    """Run the recorded commands in one pipelined round trip; on a connection error back
    off and replay them on a fresh pipeline (the commands are written to be safe to repeat:
    readers dedupe by request id and token position). ``on_retry`` runs before each replay
    (e.g. to recreate consumer groups lost with a restarted server)."""
    async def once() -> list[Any]:
        pipe = r.pipeline(transaction=False)
        for name, args, kwargs in rec.ops:
            getattr(pipe, name)(*args, **kwargs)
        return await pipe.execute()

    return await retrying(once, log=log, what=what, on_retry=on_retry, give_up_s=give_up_s)


async def server_run_id(r: aioredis.Redis) -> str:
    """Changes when the Redis server restarts (a restarted server without persistence has
    lost every stream: readers use this to fail in-flight work with a clear error)."""
    info = await r.info("server")
    return str(info.get("run_id", ""))
