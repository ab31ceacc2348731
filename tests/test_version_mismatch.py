"""One version per group: the ranks exchange fixed-width step rows, so a rank whose rank 0
runs another step protocol refuses to join with a clear error (exit code 7) instead of
breaking the collective, and rank 0 names the ranks whose record shows another version
when a formation fails."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid

import pytest
import redis

from services.engine_worker.membership import GroupMembership, VersionMismatch
from services.engine_worker.step_view import FIELDS, STEP_PROTOCOL
from shared import keys as K
from shared.bus import connect
from shared.logging import configure
from shared.settings import EngineSettings
from tests.helpers import poll_until
from tests.test_spare_live import _engine

pytestmark = [pytest.mark.timeout(90)]


def test_protocol_names_the_row_layout():
    # A change to the step row's columns must bump STEP_PROTOCOL too (step_view.py).
    assert (STEP_PROTOCOL, FIELDS) == (1, 16)


def _member(redis_url: str, namespace: str, rank: int, r) -> GroupMembership:
    m = GroupMembership(EngineSettings(redis_url=redis_url, namespace=namespace, ranks=2, rank=rank,
                                       collective_timeout_s=2, reform_timeout_s=5),
                        r, K.Keys(namespace), configure("engine-worker", "error"), asyncio.Event(),
                        uuid.uuid4().hex, counters=lambda: (0, 0), adopt=lambda w, s: None)
    m.rank = rank
    return m


def test_a_rank_joins_only_a_rank_0_of_its_own_protocol(redis_url, namespace):
    async def main() -> None:
        r = connect(redis_url)
        keys = K.Keys(namespace)
        try:
            rank0, rank1 = _member(redis_url, namespace, 0, r), _member(redis_url, namespace, 1, r)
            await r.set(keys.rank_alive(0), rank0.token)
            _, port = await asyncio.wait_for(rank0._rendezvous(), 10)
            assert (await r.hget(keys.dist, "protocol")) == str(STEP_PROTOCOL).encode()
            assert (await asyncio.wait_for(rank1._rendezvous(), 10))[1] == port

            # Rank 0 replaced by another version (a newer protocol, then one from before it).
            for published, said in (("99", "rank 0 runs step protocol 99"),
                                     (None, "rank 0 runs a lockstep version without a step protocol")):
                mapping = {"gen": rank1.gen + 1, "formed": 0}
                await r.hset(keys.dist, mapping=mapping)
                if published is None:
                    await r.hdel(keys.dist, "protocol")
                else:
                    await r.hset(keys.dist, "protocol", published)
                with pytest.raises(VersionMismatch) as err:
                    await asyncio.wait_for(rank1._rendezvous(), 10)
                assert said in str(err.value) and "same lockstep version" in str(err.value)
                # A re-formation does not retry it (it cannot succeed): retried, it would end
                # in GroupLost after reform_timeout_s instead.
                with pytest.raises(VersionMismatch):
                    await asyncio.wait_for(rank1.reform("test"), 10)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_rank_0_names_the_live_ranks_of_another_version(redis_url, namespace):
    async def main() -> None:
        r = connect(redis_url)
        keys = K.Keys(namespace)
        try:
            rank0 = _member(redis_url, namespace, 0, r)
            assert await rank0._other_versions() == ""               # nobody there yet
            await r.set(keys.rank_alive(1), "someone")
            await r.hset(keys.rank_info(1), mapping={"pid": 1})      # a rank from before the protocol
            assert await rank0._other_versions() == f"rank 1 runs step protocol none (this rank {STEP_PROTOCOL})"
            await r.hset(keys.rank_info(1), "protocol", STEP_PROTOCOL)
            assert await rank0._other_versions() == ""
        finally:
            await r.aclose()

    asyncio.run(main())


def test_engine_of_another_version_exits_7_with_the_reason(redis_url, namespace, tmp_path):
    r, k = redis.Redis.from_url(redis_url), K.Keys(namespace)
    proc: subprocess.Popen | None = None
    try:
        # A live rank 0 of a version from before the step protocol published its rendezvous.
        r.set(k.rank_alive(0), "old-rank-0", px=60_000)
        r.hset(k.dist, mapping={"addr": "127.0.0.1", "port": 1, "world": 2, "token": "old-rank-0",
                                "gen": 1, "formed": 0, "t": time.time()})
        log = tmp_path / "rank1.log"
        proc = _engine(redis_url, namespace, log, LOCKSTEP_RANK="1", LOCKSTEP_REFORM_TIMEOUT_S="60")
        poll_until(lambda: proc.poll() is not None, 60, "rank 1 refused the group")
        text = log.read_text()
        assert proc.returncode == 7, text[-2000:]
        assert "engine_version_mismatch" in text and "same lockstep version" in text, text[-2000:]
        assert r.get(k.rank_alive(1)) is None          # the slot is given back
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        r.close()
