"""shared/bus.py's retry loop (redis-py's Retry with no limit) against a real server that
stops and comes back: the recorded pipeline is replayed, a lost consumer group is recreated
by ``on_retry``, ``stop`` ends the wait, and an error that will not go away is raised at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ResponseError

from shared.bus import Recorder, connect, ensure_group, execute_recorded, is_transient, retrying
from shared.redis_server import EmbeddedRedis

pytestmark = pytest.mark.timeout(60)


class _Log:
    def __init__(self) -> None:
        self.events: dict[str, asyncio.Event] = {}
        self.fields: dict[str, dict[str, Any]] = {}

    def seen(self, name: str) -> asyncio.Event:
        return self.events.setdefault(name, asyncio.Event())

    def _note(self, event: str, **kw: Any) -> None:
        self.fields[event] = kw
        self.seen(event).set()

    info = warning = error = debug = _note


def test_recorded_pipeline_outlasts_a_restart_and_recreates_the_group(namespace):
    server = EmbeddedRedis().start()
    stream, group = f"{namespace}:s", "g"

    async def go() -> None:
        r = connect(server.url)
        log = _Log()
        recreated = 0

        async def on_retry() -> None:
            nonlocal recreated
            await ensure_group(r, stream, group)
            recreated += 1
        try:
            await ensure_group(r, stream, group)
            server.stop()
            rec = Recorder()
            rec.xadd(stream, {"d": b"1"})
            rec.xreadgroup(group, "c", {stream: ">"}, count=10)
            run = asyncio.create_task(execute_recorded(r, rec, log=log, on_retry=on_retry))
            await asyncio.wait_for(log.seen("redis_unavailable").wait(), 20)
            assert not run.done()
            server.start()                                   # back, empty: no stream, no group
            _, read = await asyncio.wait_for(run, 30)
            assert recreated >= 1 and read and len(read[0][1]) == 1
            assert log.fields["redis_reconnected"]["attempts"] >= 1
        finally:
            await r.aclose()
    try:
        asyncio.run(go())
    finally:
        server.stop()


def test_stop_ends_the_wait_and_a_lasting_error_is_raised_at_once(redis_url, namespace):
    async def go() -> None:
        calls = 0

        async def wrong_type() -> Any:
            nonlocal calls
            calls += 1
            r = connect(redis_url)
            try:
                await r.set(f"{namespace}:k", "v")
                return await r.xlen(f"{namespace}:k")        # WRONGTYPE: retrying cannot help
            finally:
                await r.aclose()
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await retrying(wrong_type)
        assert calls == 1

        stop = asyncio.Event()
        log = _Log()

        async def down() -> None:
            raise ConnectionError("refused")
        waiting = asyncio.create_task(retrying(down, log=log, stop=stop))
        await asyncio.wait_for(log.seen("redis_unavailable").wait(), 10)
        stop.set()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(waiting, 10)

        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(retrying(down, give_up_s=0.3), 10)
        assert asyncio.get_running_loop().time() - started >= 0.3
    asyncio.run(go())


@pytest.mark.parametrize("error, transient", [
    # refused until the server recovers: waited out, as an outage is (a rank raised and died)
    ("OOM command not allowed when used memory > 'maxmemory'.", True),
    ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", True),
    ("NOREPLICAS Not enough good replicas to write.", True),
    ("UNBLOCKED force unblock from blocking operation", True),
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", True),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", True),
    # a bug or a misconfiguration does not go away by waiting: raised at once
    ("WRONGTYPE Operation against a key holding the wrong kind of value", False),
    ("ERR unknown command 'FOO'", False),
    ("BUSYGROUP Consumer Group name already exists", False),
])
def test_which_refusals_are_waited_out(error, transient):
    from redis._parsers.base import BaseParser
    assert is_transient(BaseParser.parse_error(error)) is transient
    # as a pipeline's command gets it, redis-py rewrites the message: MISCONF and BUSY in a
    # rank's step pipeline were raised, and every rank of the group died
    piped = BaseParser.parse_error(error)
    piped.args = (f"Command # 1 (XADD ls:out:api-a * d x) of pipeline caused error: {piped.args[0]}",)
    assert is_transient(piped) is transient


def test_a_pipeline_outlasts_a_busy_script(redis_url, namespace):
    """A Lua script past busy-reply-threshold makes Redis answer BUSY to every command: the
    recorded pipeline waits it out and then runs (a rank raised and died on it)."""
    import threading

    import redis as sync_redis

    admin = sync_redis.Redis.from_url(redis_url)
    old = admin.config_get("busy-reply-threshold").get("busy-reply-threshold", "5000")
    admin.config_set("busy-reply-threshold", "20")
    busy_loop = ("local t = redis.call('TIME') local s = t[1] * 1e6 + t[2] "
                 "while true do local n = redis.call('TIME') if n[1] * 1e6 + n[2] - s > 1500000 then break end end "
                 "return 1")
    runner, probe = sync_redis.Redis.from_url(redis_url), sync_redis.Redis.from_url(redis_url)
    script = threading.Thread(target=lambda: runner.eval(busy_loop, 0))

    async def go() -> None:
        r, log = connect(redis_url), _Log()
        try:
            script.start()
            for _ in range(200):                      # until Redis answers BUSY
                try:
                    probe.ping()
                except sync_redis.ResponseError as exc:
                    assert str(exc).startswith("BUSY")
                    break
                await asyncio.sleep(0.01)
            rec = Recorder()
            rec.xadd(f"{namespace}:s", {"d": b"1"})
            rec.xlen(f"{namespace}:s")
            _, n = await asyncio.wait_for(execute_recorded(r, rec, log=log), 30)
            assert n == 1 and log.fields["redis_reconnected"]["attempts"] >= 1
        finally:
            await r.aclose()
    try:
        asyncio.run(go())
    finally:
        script.join(30)
        admin.config_set("busy-reply-threshold", old)
        for c in (admin, runner, probe):
            c.close()
