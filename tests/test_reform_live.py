"""Re-forming the engine group is bounded and stoppable (issue #14 item 1), with real
engine processes and a real gloo group, no supervisor: a rank whose peer never comes
back exits non-zero (to be replaced) instead of retrying forever, and a rank asked to
stop while it waits for the group to re-form exits cleanly (0)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest
import redis

from shared.keys import Keys
from shared.messages import FIELD, dumps
from tests.helpers import wait_until
from tests.test_spare_live import _engine

pytestmark = [pytest.mark.timeout(180)]


def _two_ranks(redis_url: str, namespace: str, tmp_path, **extra: str) -> list[subprocess.Popen]:
    ranks = [_engine(redis_url, namespace, tmp_path / f"rank{i}.log", LOCKSTEP_RANK=str(i), **extra)
             for i in range(2)]
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    try:
        async def formed():
            return all(r.hexists(k.rank_info(i), "ready") for i in range(2))
        asyncio.run(wait_until(formed, timeout=90))
    finally:
        r.close()
    return ranks


def _lose_rank1(r: redis.Redis, k: Keys, ranks: list[subprocess.Popen]) -> int:
    """Kill rank 1 of the (idle, paused) group, then tell rank 0 to re-form, as a
    replacement's notice would: it publishes the next generation and waits there for a
    peer that never comes. Returns the generation it left."""
    gen = int(r.hget(k.dist, "gen"))
    os.kill(ranks[1].pid, signal.SIGKILL)
    ranks[1].wait(10)
    r.xadd(k.wave, {FIELD: dumps({"w": -1, "r": 1, "reform": gen})})
    return gen


def _cleanup(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_rank_that_cannot_reform_exits_nonzero(redis_url, namespace, tmp_path):
    ranks = _two_ranks(redis_url, namespace, tmp_path, LOCKSTEP_REFORM_TIMEOUT_S="3")
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    try:
        _lose_rank1(r, k, ranks)
        try:
            code = ranks[0].wait(60)
        except subprocess.TimeoutExpired:
            code = None
        log = (tmp_path / "rank0.log").read_text()
        assert code == 4, log[-2000:]
        assert "engine_group_lost" in log
    finally:
        r.close()
        _cleanup(ranks)


def test_stop_while_reforming_is_clean(redis_url, namespace, tmp_path):
    ranks = _two_ranks(redis_url, namespace, tmp_path)
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    try:
        gen = _lose_rank1(r, k, ranks)

        async def reforming():
            return int(r.hget(k.dist, "gen") or 0) > gen
        asyncio.run(wait_until(reforming, timeout=30))
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(30) == 0, (tmp_path / "rank0.log").read_text()[-2000:]
        assert r.get(k.rank_alive(0)) is None     # its slot was given back
    finally:
        r.close()
        _cleanup(ranks)
