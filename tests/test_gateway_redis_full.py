"""A full Redis (maxmemory reached, noeviction): the api-server's submit fails at once with a
503 message that says Redis is out of memory, not that it is down, and the next request
after memory is freed goes through. Against a private real Redis (the test changes its
maxmemory)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.api_server.gateway import Gateway
from shared import keys as K
from shared.bus import connect, decode_entries
from shared.messages import Request, SamplingParams
from shared.redis_server import EmbeddedRedis
from tests.helpers import wait_until

pytestmark = [pytest.mark.timeout(60)]


async def _flow(url: str) -> None:
    keys = K.Keys("full")
    r, admin = connect(url), connect(url)
    gw = Gateway(r, keys, "apifull")
    await gw.start()
    try:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "1")
        ch = gw.submit(Request("q1", "apifull", [1, 2, 3], SamplingParams(max_tokens=4), time.time()))
        await asyncio.wait_for(ch.event.wait(), 10)
        assert ch.finish == "error" and "out of memory" in ch.error and "maxmemory" in ch.error, ch.error
        await admin.config_set("maxmemory", "0")
        gw.submit(Request("q2", "apifull", [4, 5], SamplingParams(max_tokens=4), time.time()))
        await wait_until(lambda: admin.xlen(keys.requests), 10)   # it reached the stream
    finally:
        await gw.stop()
        await r.aclose()
        await admin.aclose()


def test_a_full_redis_is_named_in_the_503_and_the_next_request_goes_through():
    with EmbeddedRedis() as server:
        asyncio.run(_flow(server.url))


def test_each_request_of_a_submit_is_judged_by_its_own_write():
    """A Redis at its maxmemory takes the first writes of a submit pipeline and refuses the
    rest (outside a transaction each lands or not on its own). Every request of the batch
    got the 503, those that landed too: they ran for nobody, and a client's retry ran them
    twice. Now a request is failed only where its own write was refused."""
    async def flow(url: str, trial: int) -> tuple[int, int]:
        keys = K.Keys(f"part{trial}")
        r, admin = connect(url), connect(url)
        gw = Gateway(r, keys, "apipart")
        await gw.start()
        try:
            await admin.config_set("maxmemory-policy", "noeviction")
            used = (await admin.info("memory"))["used_memory"]
            await admin.config_set("maxmemory", str(used + 2048))   # room for a write or two
            chs = [gw.submit(Request(f"q{i}", "apipart", list(range(200)), SamplingParams(max_tokens=4),
                                     time.time())) for i in range(40)]
            await asyncio.wait_for(asyncio.gather(*(c.sent.wait() for c in chs)), 10)
            await admin.config_set("maxmemory", "0")
            queued = {c.id for c in chs if c.entry is not None}
            landed = {doc["id"] for _, _, doc in decode_entries([(b"x", await admin.xrange(keys.requests))])}
            assert queued == landed, (sorted(queued), sorted(landed))
            assert all(c.finish == "error" and "out of memory" in c.error for c in chs if c.id not in queued)
            return len(landed), len(chs)
        finally:
            await admin.config_set("maxmemory", "0")
            await gw.stop()
            await r.aclose()
            await admin.aclose()

    with EmbeddedRedis() as server:
        outcomes = [asyncio.run(flow(server.url, trial)) for trial in range(4)]
    assert any(0 < landed < n for landed, n in outcomes), outcomes   # the partial case was met


def test_a_submission_rides_out_a_short_outage():
    """A Redis restart of a second: a request submitted meanwhile waits for it and is
    queued (each failed at once with a 503 before)."""
    from shared.redis_server import free_port

    async def flow(port: int) -> None:
        server = EmbeddedRedis(port=port).start()
        keys = K.Keys("short")
        r = connect(server.url)
        gw = Gateway(r, keys, "apishort")
        await gw.start()
        try:
            server.stop()
            ch = gw.submit(Request("s1", "apishort", [1, 2], SamplingParams(max_tokens=4), time.time()))
            await asyncio.sleep(0.5)
            server = EmbeddedRedis(port=port).start()
            await asyncio.wait_for(ch.sent.wait(), 10)
            assert ch.finish is None and ch.entry is not None, ch.error
            admin = connect(server.url)
            assert await admin.xlen(keys.requests) == 1
            await admin.aclose()
        finally:
            await gw.stop()
            await r.aclose()
            server.stop()

    asyncio.run(flow(free_port()))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stream_redis_did_not_take_is_a_503_before_any_event(tmp_path):
    """A streamed request whose submission Redis refused got a 200 and then an error event,
    which the openai client raises without a status and never retries (its retries stop at
    a 200); a request that was never queued is now refused before the stream starts."""
    import openai
    import redis as redis_sync

    from tests.conftest import start_cluster

    with EmbeddedRedis() as server:
        cluster = start_cluster(tmp_path, "--ranks", "1", "--api-servers", "1", "--backend", "sim",
                                "--redis-url", server.url)
        admin = redis_sync.Redis.from_url(server.url)
        client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=30)
        try:
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", "1")
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(model="lockstep-moe", stream=True, max_tokens=4,
                                               messages=[{"role": "user", "content": "hi"}])
            assert err.value.status_code == 503 and "out of memory" in err.value.message, err.value.message
            admin.config_set("maxmemory", "0")
            chunks = list(client.chat.completions.create(model="lockstep-moe", stream=True, max_tokens=4,
                                                         messages=[{"role": "user", "content": "hi"}]))
            assert chunks[-1].choices[0].finish_reason == "length"
        finally:
            admin.config_set("maxmemory", "0")
            client.close()
            cluster.stop()


def test_a_connection_lost_while_reading_the_replies_is_tried_again():
    """A Redis Cluster pipeline whose primary is killed as it reads the replies returns a
    ConnectionError as each reply (``raise_on_error=False``) instead of raising: the submit
    took them for refusals, and 12 requests failed with a 503 in one of three failovers
    (tests/test_redis_cluster.py::test_killed_primary_mid_run_loses_nothing). Now such a
    reply is tried again like a raised one; a refusal (out of memory) is not."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import OutOfMemoryError

    class Pipe:
        def __init__(self, replies: list) -> None:
            self.replies = replies

        async def execute(self, raise_on_error: bool = True) -> list:
            return self.replies

    async def flow() -> tuple[list, int, list, int]:
        gw = Gateway(None, K.Keys("retry"), "apiretry")
        lost = [[RedisConnectionError("Error while reading: Connection reset by peer")] * 2, [b"1-0", b"1-1"]]
        built = []

        def build() -> Pipe:
            built.append(1)
            return Pipe(lost[len(built) - 1])
        replies = await asyncio.wait_for(gw._execute_submit(build, raise_on_error=False), 10)
        full = [OutOfMemoryError("OOM command not allowed"), b"2-0"]
        tries = []

        def build_full() -> Pipe:
            tries.append(1)
            return Pipe(full)
        refused = await asyncio.wait_for(gw._execute_submit(build_full, raise_on_error=False), 10)
        return replies, len(built), refused, len(tries)

    replies, built, refused, tries = asyncio.run(flow())
    assert replies == [b"1-0", b"1-1"] and built == 2
    assert isinstance(refused[0], Exception) and tries == 1
