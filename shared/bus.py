"""The thin Redis layer: connections, consumer groups and stream reads.

Everything that crosses services goes through here. Connections use the hiredis parser
when installed (redis-py picks it up by itself) and retry with backoff and jitter.
``connect`` (``connect_sync`` for threads) is the one factory of clients: a plain
``redis://`` server, a ``redis+cluster://`` Redis Cluster or a ``redis+sentinel://``
group (shared/redis_url.py), the same calls for all three.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import signal
import uuid
from typing import Any, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import FullJitterBackoff
from redis.exceptions import ClusterDownError, OutOfMemoryError, ReadOnlyError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

from shared import redis_url
from shared.messages import FIELD, loads
from shared.replies import as_str

T = TypeVar("T")


# ResponseError codes that refuse only for now (is_transient). "BUSY " with its space:
# BUSYGROUP (a consumer group that exists) is an answer, not a refusal.
_REFUSED_FOR_NOW = ("UNBLOCKED", "MISCONF", "NOREPLICAS", "BUSY ", "MASTERDOWN")
# redis-py rewrites a pipelined command's error as "Command # 1 (XADD ...) of pipeline
# caused error: MISCONF ...": the code is after this
_PIPELINE_ERROR = " of pipeline caused error: "


def is_transient(exc: BaseException) -> bool:
    """A Redis error that goes away by itself: connection trouble, or a failover in progress
    (a blocked read ends with UNBLOCKED when its server becomes a replica; MASTERDOWN: a
    replica that lost its primary), or writes refused until the server recovers (below, and
    MISCONF: a failed RDB save, e.g. a full disk under ``lockstep up --persist``;
    NOREPLICAS: too few replicas for min-replicas-to-write; BUSY: a Lua script past
    busy-reply-threshold), whether a lone command or a pipeline's got it."""
    if isinstance(exc, TRANSIENT):
        return True
    if not isinstance(exc, ResponseError):
        return False
    msg = str(exc)
    at = msg.find(_PIPELINE_ERROR)
    return (msg[at + len(_PIPELINE_ERROR):] if at >= 0 else msg).startswith(_REFUSED_FOR_NOW)


# Connection trouble, and what a failover looks like from a client: a cluster slot with no
# primary for a moment (CLUSTERDOWN, TRYAGAIN, uncovered slot), a demoted primary (READONLY);
# and a full Redis (OOM: maxmemory reached), which takes writes again once memory frees
# (record TTLs, trims, an operator's maxmemory): a rank that raised on it died, and a
# second-long spell of it took every rank of the group down with it.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError,
             ClusterDownError, TryAgainError, SlotNotCoveredError, ReadOnlyError, OutOfMemoryError)


class RedisUnreachable(RuntimeError):
    pass


class BadRedisUrlError(RedisUnreachable):
    """A URL that does not parse: waiting will not fix it."""


def worth_logging(attempt: int) -> bool:
    """Log the 1st, 2nd, 4th and 8th failure of a retry loop, then every 32nd."""
    return attempt in (1, 2, 4, 8) or attempt % 32 == 0


def redact_url(url: str) -> str:
    """The URL without its password, for logs and status output."""
    if not url:
        return url
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if sep and at and ":" in userinfo:
        return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hostpart}"
    return url


def client_name(argv: list[str] | None = None, pid: int | None = None) -> str:
    """``lockstep-<command>-<pid>``: who holds each connection in ``CLIENT LIST`` (and so
    which service sends what: scripts/redis-load counts commands and bytes per service)."""
    args = sys.argv[1:] if argv is None else argv
    role = next((a for a in args if not a.startswith("-")), "client")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"lockstep-{role}-{os.getpid() if pid is None else pid}")


# The nodes of each redis+cluster:// URL that a client of this process learned from the
# cluster (check_reachable records them at start-up): later clients start from them too,
# so one created after the URL's only node died still finds the cluster.
_CLUSTER_NODES: dict[str, tuple[tuple[str, int], ...]] = {}


def _startup_nodes(target: redis_url.RedisTarget) -> list[tuple[str, int]]:
    return list(dict.fromkeys([*target.nodes, *_CLUSTER_NODES.get(target.url, ())]))


async def _cluster_addresses(client: Any) -> tuple[tuple[str, int], ...]:
    """Every node of the cluster, replicas too (the client's own map has the primaries
    only; a shard's replica is what outlives its primary). The client's map where CLUSTER
    NODES is not allowed (an ACL, a managed service)."""
    try:
        nodes = await client.cluster_nodes()
    except Exception:  # noqa: BLE001 - the primaries the client knows will do
        return tuple((n.host, int(n.port)) for n in client.get_nodes())
    out = []
    for address, info in nodes.items():
        host, _, port = address.partition("@")[0].rpartition(":")
        if host and port.isdigit() and int(port) and "noaddr" not in info.get("flags", ""):
            out.append((host, int(port)))
    return tuple(out)


def url_with_known_nodes(url: str) -> str:
    """``url``, naming every cluster node learned so far (a supervisor hands this to the
    processes it starts); any other URL as it is."""
    return redis_url.with_nodes(url, _CLUSTER_NODES.get(url, ()))


def connect(url: str, *, timeout_s: float | None = None, connect_timeout_s: float = 5.0,
            max_connections: int = 256) -> Any:
    """A pooled asyncio client for the deployment ``url`` names (module docstring).
    ``timeout_s`` bounds socket reads (None: block reads need it open)."""
    target = redis_url.parse(url)
    common = dict(decode_responses=False, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
                  socket_keepalive=True, health_check_interval=0, client_name=client_name())
    if target.kind == redis_url.SINGLE:
        return aioredis.Redis.from_url(url, max_connections=max_connections, **common)
    if target.kind == redis_url.CLUSTER:
        from redis.asyncio.cluster import ClusterNode

        from shared.cluster_client import AsyncCluster
        return AsyncCluster(startup_nodes=[ClusterNode(h, p) for h, p in _startup_nodes(target)], ssl=target.tls,
                            username=target.username, password=target.password,
                            max_connections=max_connections, **common)
    from redis.asyncio.sentinel import Sentinel

    from shared.sentinel_client import AsyncSentinelRedis, FollowingPool
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs={"socket_connect_timeout": connect_timeout_s,
                                                             "socket_timeout": connect_timeout_s})
    return sentinel.master_for(target.service, redis_class=AsyncSentinelRedis, connection_pool_class=FollowingPool,
                               db=target.db,
                               username=target.username, password=target.password, ssl=target.tls,
                               max_connections=max_connections, **common).follow(sentinel, target.service)


def connect_sync(url: str, *, timeout_s: float | None = None, connect_timeout_s: float = 5.0) -> Any:
    """``connect`` for a thread without an event loop (the engines' liveness beat)."""
    import redis

    target = redis_url.parse(url)
    common = dict(socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s, client_name=client_name())
    if target.kind == redis_url.SINGLE:
        return redis.Redis.from_url(url, **common)
    if target.kind == redis_url.CLUSTER:
        from redis.cluster import ClusterNode

        from shared.cluster_client import SyncCluster
        return SyncCluster(startup_nodes=[ClusterNode(h, p) for h, p in _startup_nodes(target)], ssl=target.tls,
                            username=target.username, password=target.password, **common)
    from redis.sentinel import Sentinel

    from shared.sentinel_client import SyncSentinelRedis
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs={"socket_connect_timeout": connect_timeout_s,
                                                             "socket_timeout": connect_timeout_s})
    return sentinel.master_for(target.service, redis_class=SyncSentinelRedis, db=target.db,
                               username=target.username, password=target.password, ssl=target.tls,
                               **common).follow(sentinel, target.service)


def is_cluster(r: Any) -> bool:
    return hasattr(r, "get_nodes")   # RedisCluster (asyncio or not); Redis has no nodes


async def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """Raise RedisUnreachable with a one-line message naming the (redacted) URL."""
    try:
        client = connect(url, timeout_s=timeout_s, connect_timeout_s=timeout_s)
    except redis_url.BadRedisUrl as exc:
        raise BadRedisUrlError(f"bad Redis URL {redact_url(url)}: {exc}") from None
    try:
        await asyncio.wait_for(client.ping(), timeout_s)
        if is_cluster(client):
            _CLUSTER_NODES[url] = await _cluster_addresses(client)
    except Exception as exc:  # noqa: BLE001 - any failure means the same to the user
        raise RedisUnreachable(
            f"cannot reach Redis at {redact_url(url)}: {exc.__class__.__name__}: {str(exc).rstrip('.')}. "
            "Start one, fix --redis-url / LOCKSTEP_REDIS_URL, or omit it to let `lockstep up` start its own.") from None
    finally:
        await client.aclose()


async def wait_reachable(url: str, wait_s: float, *, stop: asyncio.Event | None = None,
                         on_wait: Callable[[str, int], Any] | None = None) -> None:
    """``check_reachable``, retried with backoff (0.5 s doubling to 5 s) for up to
    ``wait_s`` seconds (``inf``: until it is, or until ``stop`` is set): a service
    restarted during a Redis outage rides it out as the running ones do. ``on_wait(error,
    attempt)`` hears each failure that is retried. Raises RedisUnreachable with the last
    failure when the wait runs out (at once when ``wait_s`` is 0) or ``stop`` is set."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    pause, attempt = 0.5, 0
    while True:
        try:
            await check_reachable(url)
            return
        except RedisUnreachable as exc:
            attempt += 1
            if isinstance(exc, BadRedisUrlError) or (stop is not None and stop.is_set()) or loop.time() + pause > deadline:
                raise
            if on_wait is not None:
                on_wait(str(exc), attempt)
        if stop is None:
            await asyncio.sleep(pause)
        else:
            try:
                await asyncio.wait_for(stop.wait(), pause)
            except TimeoutError:
                pass
        pause = min(5.0, pause * 2)


async def open_service_connection(url: str, log: Any, stop: asyncio.Event,
                                  wait_s: float = 0.0) -> aioredis.Redis | None:
    """Start-up of a service: let SIGTERM/SIGINT set ``stop`` for a clean shutdown, wait
    up to ``wait_s`` for Redis to be reachable (one clear log line if it is not: None),
    and connect."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def waiting(error: str, attempt: int) -> None:
        if worth_logging(attempt):
            log.warning("redis_waiting", error=error, attempt=attempt, wait_s=wait_s)

    try:
        await wait_reachable(url, wait_s, stop=stop, on_wait=waiting)
    except RedisUnreachable as exc:
        if not stop.is_set():
            log.error("redis_unreachable", error=str(exc))
        return None
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
    ms, _, seq = as_str(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _retryable(exc: BaseException) -> bool:
    # NOGROUP: a restarted server lost the consumer group; ``on_retry`` recreates it.
    return is_transient(exc) or (isinstance(exc, ResponseError) and "NOGROUP" in str(exc))


# Full jitter, 50 ms doubling to a 2 s cap, with no retry limit: a service outlasts a Redis
# restart (a client's own Retry is bounded: none on a redis:// client). Stateless: one for all calls.
_RETRY = Retry(FullJitterBackoff(cap=2.0, base=0.05), retries=-1, supported_errors=(ResponseError, *TRANSIENT))


async def retrying(op: Callable[[], Awaitable[T]], *, log: Any = None, what: str = "redis",
                   stop: asyncio.Event | None = None, give_up_s: float | None = None,
                   on_retry: Callable[[], Awaitable[None]] | None = None,
                   stop_grace_s: float = 0.0) -> T:
    """Run ``op`` until it succeeds, backing off on transient connection errors (and on a
    consumer group lost with a restarted server, after ``on_retry`` recreated it); give up
    (re-raise) once ``give_up_s`` has passed, or ``stop_grace_s`` after ``stop`` is set
    (at once by default)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    failures = 0
    stop_seen: float | None = None

    async def attempt() -> T:
        if failures and on_retry is not None:
            try:   # after the backoff, so a server that came back meanwhile gets its groups first
                await on_retry()
            except (ResponseError, *TRANSIENT):
                pass
        return await op()

    async def fail(exc: Exception, n: int) -> None:
        nonlocal failures, stop_seen
        failures = n
        now = loop.time()
        if stop is not None and stop.is_set():
            stop_seen = now if stop_seen is None else stop_seen
            if now - stop_seen >= stop_grace_s:
                raise exc
        if give_up_s is not None and now - started > give_up_s:
            raise exc
        if log is not None and worth_logging(n):
            log.warning("redis_unavailable", what=what, error=str(exc), attempt=n)

    result = await _RETRY.call_with_retry(attempt, fail, is_retryable=_retryable, with_failure_count=True)
    if failures and log is not None:
        log.info("redis_reconnected", what=what, attempts=failures)
    return result


class Recorder:
    """Records pipeline commands so they can be replayed on a fresh pipeline after a
    connection error. Kept over redis-py's own pipeline replay: that one is bounded by the
    connection's retry count (0 on a redis:// client) and clears the stack when execute()
    fails, where ours outlasts a restart and runs ``on_retry`` between tries."""

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
                           give_up_s: float | None = None, stop: asyncio.Event | None = None,
                           stop_grace_s: float = 0.0) -> list[Any]:
    """Run the recorded commands in one pipelined round trip; on a connection error back
    off and replay them on a fresh pipeline (the commands are written to be safe to repeat:
    readers dedupe by request id and token position). ``on_retry`` runs before each replay
    (e.g. to recreate consumer groups lost with a restarted server)."""
    async def once() -> list[Any]:
        pipe = r.pipeline(transaction=False)
        for name, args, kwargs in rec.ops:
            getattr(pipe, name)(*args, **kwargs)
        return await pipe.execute()

    return await retrying(once, log=log, what=what, on_retry=on_retry, give_up_s=give_up_s, stop=stop,
                          stop_grace_s=stop_grace_s)


async def server_run_id(r: Any, key: str) -> str:
    """The identity of the data set: a random id that the first reader stores at ``key``
    (SET NX, no TTL) and everyone reads back. A restarted server without persistence has
    lost it with every stream (readers then fail their in-flight work with a clear
    error); a replica that took over at a failover, however many in a row, has it."""
    pipe = r.pipeline(transaction=False)
    pipe.set(key, uuid.uuid4().hex, nx=True)
    pipe.get(key)
    _, value = await pipe.execute()
    return as_str(value)


def same_data(before: str, now: str) -> bool:
    """Whether ``now`` (``server_run_id``) is the data set seen ``before`` (nothing seen: yes)."""
    return not before or before == now


def atomic(r: Any, slot_key: str) -> Any:
    """A pipeline whose commands on ``slot_key``'s hash slot run as one MULTI/EXEC.

    On one server (or a Sentinel group) it is a plain MULTI/EXEC of every command. Redis
    Cluster refuses a transaction across slots, so there the commands on other slots (the
    request records, the api-servers' output streams) go first, pipelined to their nodes,
    and the transaction only after they succeeded: what they record is durable before the
    transaction acks the work (the key schema puts what must be atomic in one slot:
    shared/keys.py). Results come back in the order the commands were queued."""
    if not is_cluster(r):
        return r.pipeline(transaction=True)
    return SlotTransaction(r, slot_key)


def command_key(name: str, args: tuple, kwargs: dict) -> Any:
    """The key a queued command works on (EVAL's first key, else the first argument)."""
    if name in ("eval", "evalsha"):
        return args[2] if len(args) > 2 and int(args[1]) > 0 else None
    return args[0] if args else kwargs.get("name")


class SlotTransaction:
    """``atomic`` on Redis Cluster (see there): records the commands, then runs them."""

    def __init__(self, r: Any, slot_key: str) -> None:
        self.r, self.slot = r, r.keyslot(slot_key)
        self.ops: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Callable[..., "SlotTransaction"]:
        def record(*args: Any, **kwargs: Any) -> "SlotTransaction":
            self.ops.append((name, args, kwargs))
            return self
        return record

    def __len__(self) -> int:
        return len(self.ops)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        inside = [self.r.keyslot(k) == self.slot if (k := command_key(*op)) is not None else True
                  for op in self.ops]
        results: list[Any] = [None] * len(self.ops)
        for in_slot, transaction in ((False, False), (True, True)):
            picked = [i for i, flag in enumerate(inside) if flag is in_slot]
            if not picked:
                continue
            pipe = self.r.pipeline(transaction=transaction)
            for i in picked:
                name, args, kwargs = self.ops[i]
                getattr(pipe, name)(*args, **kwargs)
            for i, res in zip(picked, await pipe.execute(raise_on_error=raise_on_error)):
                results[i] = res
        return results

    async def __aenter__(self) -> "SlotTransaction":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.ops.clear()
