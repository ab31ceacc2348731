"""Starting up on a loaded machine (found by the leave and chaos runs at load 15-27 on two
cores): a rank that misses its first rendezvous retries in-process instead of exiting
(a restart re-imports torch and misses the next one too), and `lockstep up` replaces a
child that exits 0 during start-up (a scheduler whose lease lapsed steps down) instead
of aborting the whole start."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from services.admin.up import Child, LocalCluster, UpOptions
from services.engine_worker.step_view import STEP_PROTOCOL
from shared.keys import Keys
from shared.redis_server import free_port
from tests.helpers import poll_until
from tests.test_spare_live import _engine

pytestmark = [pytest.mark.timeout(120)]


def test_rank_that_misses_its_first_rendezvous_retries_in_process(redis_url, namespace, tmp_path):
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    procs: list[subprocess.Popen] = []
    try:
        # A rendezvous nobody serves: rank 0's slot held by a token that published an
        # address where no store listens (a rank 0 that gave up before rank 1 came).
        r.set(k.rank_alive(0), "stale", px=60_000)
        r.hset(k.dist, mapping={"addr": "127.0.0.1", "port": free_port(), "world": 2, "token": "stale",
                                "gen": 1, "formed": 0, "t": time.time(), "protocol": STEP_PROTOCOL})
        log1 = tmp_path / "rank1.log"
        timeouts = {"LOCKSTEP_COLLECTIVE_TIMEOUT_S": "2", "LOCKSTEP_REFORM_TIMEOUT_S": "60"}
        procs.append(_engine(redis_url, namespace, log1, LOCKSTEP_RANK="1", **timeouts))
        poll_until(lambda: "first formation failed" in log1.read_text() or procs[0].poll() is not None,
                   60, "rank 1's first formation failed")
        assert procs[0].poll() is None, log1.read_text()[-2000:]   # it stays, waiting for the next generation
        r.delete(k.rank_alive(0))
        procs.append(_engine(redis_url, namespace, tmp_path / "rank0.log", LOCKSTEP_RANK="0", **timeouts))
        poll_until(lambda: all(r.hexists(k.rank_info(i), "ready") for i in range(2)) or procs[0].poll() is not None,
                   60, "the group formed")
        assert procs[0].poll() is None, log1.read_text()[-2000:]
        assert int(r.hget(k.rank_info(1), "pid")) == procs[0].pid
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        r.close()


def test_up_replaces_a_child_that_exits_0_during_start_up(tmp_path):
    said: list[str] = []
    cluster = LocalCluster(UpOptions(log_dir=str(tmp_path)), out=said.append)
    # A child that exits 0 at once; its replacement runs `lockstep --help` (exits 0 too).
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    cluster.children = [Child("scheduler", proc, tmp_path / "scheduler.log", ["--help"], dict(os.environ))]
    cluster._check_children()          # must not raise: exit 0 is not a failed start
    assert said and "restarted it" in said[0], said
    assert cluster.children[0].proc is not proc
    cluster.children[0].proc.wait(60)


def test_a_late_rank_skips_a_rendezvous_about_to_close(redis_url, namespace):
    # A replacement that read rank 0's rendezvous near the end of its wait connected as the
    # store closed, timed out, and met the next one late the same way (four in a row, ~30 s).
    import asyncio
    import uuid

    from services.engine_worker.membership import GroupMembership
    from shared.bus import connect
    from shared.logging import configure
    from shared.settings import EngineSettings

    async def main() -> None:
        r = connect(redis_url)
        k = Keys(namespace)

        def member(rank: int) -> GroupMembership:
            m = GroupMembership(EngineSettings(redis_url=redis_url, namespace=namespace, ranks=2, rank=rank,
                                               collective_timeout_s=1.5), r, k, configure("engine-worker", "error"),
                                asyncio.Event(), uuid.uuid4().hex, counters=lambda: (0, 0), adopt=lambda w, s: None)
            m.rank = rank
            return m
        try:
            rank0, late = member(0), member(1)
            await r.set(k.rank_alive(0), rank0.token)
            _, first = await rank0._rendezvous()
            assert 0 < await r.pttl(k.dist_open) <= rank0._open_ms() == 1000
            await r.delete(k.dist_open)                      # its time to be joined is up
            joining = asyncio.create_task(late._rendezvous())
            await asyncio.sleep(0.5)
            assert not joining.done(), "joined a rendezvous about to close"
            _, second = await rank0._rendezvous()            # rank 0 meets again: that one is joined
            assert (await asyncio.wait_for(joining, 10))[1] == second != first
            # a rank 0 from before the open key (no open_ms in the hash) is joined as before
            await r.hdel(k.dist, "open_ms")
            await r.hincrby(k.dist, "gen", 1)
            await r.delete(k.dist_open)
            assert (await asyncio.wait_for(member(1)._rendezvous(), 10))[1] == second
        finally:
            await r.aclose()
    asyncio.run(main())


def test_a_rank_starting_while_redis_is_full_waits_for_its_slot(redis_url, namespace, tmp_path):
    # A full Redis (maxmemory reached, noeviction) refused the slot claim's SET: the rank
    # exited with a traceback, and `lockstep up`, still starting, stopped the whole cluster.
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    log = tmp_path / "rank0.log"
    proc = None
    try:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        proc = _engine(redis_url, namespace, log, LOCKSTEP_RANK="0", LOCKSTEP_RANKS="1")
        poll_until(lambda: "claim_rank" in log.read_text() or proc.poll() is not None, 60,
                   "the rank met the refusal")
        assert proc.poll() is None, log.read_text()[-3000:]
        r.config_set("maxmemory", 0)
        poll_until(lambda: r.exists(k.rank_alive(0)) or proc.poll() is not None, 60, "the rank took its slot")
        assert proc.poll() is None and r.exists(k.rank_alive(0)), log.read_text()[-3000:]
    finally:
        r.config_set("maxmemory", 0)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        r.close()
