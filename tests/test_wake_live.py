"""Live proofs of the one-hop wake of a paused engine group (shared/wake.py), on real
`lockstep up` sim clusters, with scheduler and with client dispatch:

1. The dispatch that ends a pause writes the wake notice itself (``r`` = -1) in the
   transaction that writes the inbox; the rank that got the work sends none of its own.
2. Without the ``paused`` record (a dispatcher that does not run the wake script), the
   rank that finds the work wakes the group itself: slower, still correct.
3. Work admitted straight from the wake-up read is claimed afterwards: one-step requests,
   one at a time and in bursts, leave nothing pending in any inbox.
4. The wake script itself, against the real server: one notice per pause, none otherwise.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.messages import FIELD
from shared.tokenizer import encode
from tests.conftest import Cluster, start_cluster
from tests.helpers import sim_expected_text, wait_until

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"


@pytest.fixture(scope="module", params=["scheduler", "client"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp(f"wake-{request.param}")
    c = start_cluster(tmp, "--ranks", "2", "--api-servers", "1", "--backend", "sim", "--time-scale", "0",
                      "--dispatch", request.param, "--log-level", "warning",
                      namespace=f"wake{request.param[0]}{os.getpid() % 100000}")
    yield c
    c.stop()


async def _complete(http: httpx.AsyncClient, c: Cluster, prompt: str, max_tokens: int) -> None:
    resp = await http.post(c.api_url + "/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == max_tokens
    assert body["choices"][0]["text"] == sim_expected_text(encode(prompt), max_tokens)


async def _paused_wave(r: aioredis.Redis, keys: Keys) -> int:
    """Wait until the group sleeps and rank 0 recorded which wave wakes it."""
    async def paused() -> Any:
        v = await r.get(keys.paused)
        return v is not None and int(v)
    return await wait_until(paused, timeout=20)


async def _notices_after(r: aioredis.Redis, keys: Keys, after: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(f[FIELD]) for eid, f in await r.xrange(keys.wave, min=after, max="+") if eid != after]


async def _last_id(r: aioredis.Redis, key: str) -> bytes:
    last = await r.xrevrange(key, count=1)
    return last[0][0] if last else b"0-0"


async def test_the_dispatch_that_ends_a_pause_wakes_every_rank(cluster: Cluster):
    keys = Keys(cluster.namespace)
    r = aioredis.Redis.from_url(cluster.redis_url)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            await _complete(http, cluster, "warm up", 2)
            for i in range(4):
                wave = await _paused_wave(r, keys)
                mark = await _last_id(r, keys.wave)
                await asyncio.wait_for(_complete(http, cluster, f"after pause {i}", 3), 30)
                notices = [n for n in await _notices_after(r, keys, mark) if n.get("w") == wave]
                # Exactly one notice woke this wave, and it came from the dispatcher.
                assert notices == [{"w": wave, "r": -1}], notices
    finally:
        await r.aclose()


async def test_a_rank_wakes_the_group_itself_when_no_dispatcher_did(cluster: Cluster):
    keys = Keys(cluster.namespace)
    r = aioredis.Redis.from_url(cluster.redis_url)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            wave = await _paused_wave(r, keys)
            await r.delete(keys.paused)   # as if the dispatcher did not know the group sleeps
            mark = await _last_id(r, keys.wave)
            await asyncio.wait_for(_complete(http, cluster, "no notice from the dispatcher", 3), 30)
            notices = [n for n in await _notices_after(r, keys, mark) if n.get("w") == wave]
            assert len(notices) == 1 and notices[0]["r"] in (0, 1), notices
    finally:
        await r.aclose()


async def test_work_admitted_at_wake_up_is_claimed_and_acked(cluster: Cluster):
    keys = Keys(cluster.namespace)
    r = aioredis.Redis.from_url(cluster.redis_url)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            for i in range(6):   # one at a time: each wakes a paused group and ends in its first step
                await _paused_wave(r, keys)
                await asyncio.wait_for(_complete(http, cluster, f"one step {i}", 1), 30)
            await asyncio.wait_for(asyncio.gather(*(_complete(http, cluster, f"burst {i}", 1 + i % 3)
                                                    for i in range(40))), 60)

        async def nothing_pending() -> bool:
            for rank in range(2):
                info = await r.xpending(keys.inbox(rank), "engine")
                if info["pending"]:
                    return False
            return True
        assert await wait_until(nothing_pending, timeout=20)
    finally:
        await r.aclose()


async def test_wake_script_writes_one_notice_only_while_the_group_sleeps(redis_url: str, namespace: str):
    """WAKE_IF_PAUSED against the real server: a notice for the recorded wave, in the same
    transaction as the inbox write, then nothing until the group pauses again."""
    from shared.wake import wake_if_paused
    keys = Keys(namespace)
    r = aioredis.Redis.from_url(redis_url)
    try:
        async def dispatch() -> None:
            pipe = r.pipeline(transaction=True)
            pipe.xadd(keys.inbox(0), {FIELD: b"{}"})
            wake_if_paused(pipe, keys)
            await pipe.execute()

        await dispatch()                       # the group runs: no notice
        assert await r.xlen(keys.wave) == 0
        await r.set(keys.paused, 7)            # rank 0: paused, wave 7 is next
        await dispatch()
        await dispatch()                       # already woken: no second notice
        notices = [orjson.loads(f[FIELD]) for _, f in await r.xrange(keys.wave)]
        assert notices == [{"w": 7, "r": -1}]
        assert await r.get(keys.paused) is None
    finally:
        await r.aclose()
