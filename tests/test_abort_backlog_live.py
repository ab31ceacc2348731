"""Clients that give up on requests still queued in a rank's inbox: their aborts must
reach the rank ahead of that backlog (shared/cancels.py). A rank reads its inbox only
while its waiting queue has room, and the aborts were inbox entries behind the requests:
in a 6,000-request burst abandoned after 4 s (staggered batches, or api-servers placing
directly), half ran to completion for nobody and the next burst's p50 went from 4 s to
56-78 s. Live: one sim rank of two sequences, requests placed by the api-server
(``--dispatch client``) or in staggered batches, streams closed by the client."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis

from shared import keys as K
from tests.conftest import start_cluster
from tests.helpers import poll_until

pytestmark = pytest.mark.slow
N = 24


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", [("--dispatch", "client"), ("--policy", "staggered")], ids=["client", "staggered"])
def test_abandoned_requests_behind_a_full_rank_stop_at_once(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("LOCKSTEP_MAX_NUM_SEQS", "2")     # room to read: 2 x 2 - waiting
    cluster = start_cluster(tmp_path, "--ranks", "1", "--api-servers", "1", "--backend", "sim",
                            "--time-scale", "4", *mode)
    r = redis.Redis.from_url(cluster.redis_url)
    keys = K.Keys(cluster.namespace)

    def stats() -> dict:
        raw = r.hget(keys.rank_info(0), "stats")
        return json.loads(raw) if raw else {}

    def unread() -> int:
        groups = {g["name"]: g for g in r.xinfo_groups(keys.inbox(0))}
        g = groups.get(K.ENGINE_GROUP.encode())
        return int(g["lag"] or 0) if g else 0

    async def abandon() -> None:
        body = {"model": "lockstep-moe", "prompt": "gone", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=cluster.api_url, timeout=60) as c:
            async def one() -> None:
                async with c.stream("POST", "/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
            tasks = [asyncio.create_task(one()) for _ in range(6)]
            # the rank full (2 running, 4 waiting), then the rest unread in its inbox (sent
            # while it runs: a paused rank's wake-up read takes a whole batch at once)
            await asyncio.to_thread(poll_until, lambda: stats().get("running") == 2 and stats().get("waiting", 0) >= 4,
                                    60, "a full rank")
            tasks += [asyncio.create_task(one()) for _ in range(N - 6)]
            await asyncio.to_thread(poll_until, lambda: unread() > 0, 60, "a backlog in its inbox")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(abandon())
        # every request ends on the rank within seconds: none runs its 1,500 tokens for nobody
        poll_until(lambda: (s := stats()) and s.get("running") == 0 and s.get("waiting") == 0 and unread() == 0,
                   30, "the rank free of the abandoned requests")
        with httpx.Client(base_url=cluster.api_url, timeout=60) as c:   # and serves at once
            done = c.post("/completions", json={"model": "lockstep-moe", "prompt": "next", "max_tokens": 4}).json()
        assert done["choices"][0]["finish_reason"] == "length", done
    finally:
        cluster.stop()
