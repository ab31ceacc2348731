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
    # a bug or a misconfiguration does not go away by waiting: raised at once
    ("WRONGTYPE Operation against a key holding the wrong kind of value", False),
    ("ERR unknown command 'FOO'", False),
])
def test_which_refusals_are_waited_out(error, transient):
    from redis._parsers.base import BaseParser
    assert is_transient(BaseParser.parse_error(error)) is transient
