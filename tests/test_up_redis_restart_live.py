"""`lockstep up`'s embedded Redis dies (SIGKILL: an OOM kill, a crash). `up` starts it
again on the same port: with --persist from its last snapshot, without it empty. Either
way the cluster serves again, on every rank, and `up` keeps running; before, nothing
restarted it and every service retried against nothing for ever."""

from __future__ import annotations

import signal

import psutil
import pytest
import redis

from tests.conftest import start_cluster
from tests.helpers import poll_until
from tests.redis_topology import check_streams, stream_many

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _redis_of(up_pid: int) -> psutil.Process:
    return next(p for p in psutil.Process(up_pid).children()
                if "redis" in p.name() or "valkey" in p.name())


@pytest.mark.parametrize("persist", [False, True], ids=["empty", "persist"])
def test_up_restarts_its_redis_and_serves_again(tmp_path, persist):
    args = ["--ranks", "2", "--api-servers", "1", "--backend", "sim"]
    if persist:
        args += ["--persist", str(tmp_path / "rdb")]
    cluster = start_cluster(tmp_path, *args, namespace="lsr")
    try:
        check_streams(stream_many(cluster.api_url, 4, 8, "before"), 4, 8, "before")
        from shared.keys import Keys

        k = Keys("lsr")
        r = redis.Redis.from_url(cluster.redis_url)
        ranks_before = [int(r.hget(k.rank_info(i), "pid")) for i in range(2)]
        if persist:                       # a snapshot to come back from (else: saved each 60 s)
            r.save()
        r.close()
        server = _redis_of(cluster.proc.pid)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        out = tmp_path / "up.out"

        def restarted() -> bool:
            assert cluster.proc.poll() is None, out.read_text()
            return "started it again on port" in out.read_text()
        poll_until(restarted, 30, "up started its Redis again", interval=0.1)
        assert ("last snapshot" in out.read_text()) == persist, out.read_text()
        assert _redis_of(cluster.proc.pid).pid != server.pid

        def serves() -> bool:
            results = stream_many(cluster.api_url, 4, 8, "after")
            return all(r.acked and r.error is None for r in results) and results
        results = poll_until(serves, 120, "the cluster serves again", interval=1.0)
        check_streams(results, 4, 8, "after")
        # No spare took a live rank's slot: they were all free until the ranks' next beat
        # (from a snapshot, with ran=1 and every alive key expired, the spare took one at once)
        r = redis.Redis.from_url(cluster.redis_url)
        pids = poll_until(lambda: all(p := [int(r.hget(k.rank_info(i), "pid") or 0) for i in range(2)]) and p,
                          30, "the ranks wrote their identity again (each heartbeat does)", interval=0.1)
        assert pids == ranks_before, out.read_text()
        r.close()
        assert "serves rank" not in out.read_text(), out.read_text()
        res = cluster.cli("status", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        assert cluster.proc.poll() is None
    finally:
        assert cluster.stop() == 0


@pytest.mark.timeout(240)
def test_a_rank_replaced_in_a_paused_group_after_an_empty_restart_serves(tmp_path):
    """The group is paused (idle) when `up`'s Redis dies and comes back empty; then rank 0
    dies and a hot spare takes its slot. The survivors must hear of the replacement and
    re-form: requests on both ranks complete. Before, the group's generation was gone with
    the data, the replacement sent no notice, the paused survivor slept on, and the
    replacement's requests waited for ever (fault probe: a 100 s client timeout)."""
    import asyncio
    import os

    import openai

    from shared.keys import Keys

    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim", namespace="lsp")
    k = Keys("lsp")
    try:
        check_streams(stream_many(cluster.api_url, 2, 4, "idle"), 2, 4, "idle")
        r = redis.Redis.from_url(cluster.redis_url)
        poll_until(lambda: r.get(k.paused) is not None, 30, "the group paused", interval=0.1)
        old0 = int(r.hget(k.rank_info(0), "pid"))
        r.close()
        server = _redis_of(cluster.proc.pid)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        poll_until(lambda: "started it again on port" in (tmp_path / "up.out").read_text(), 30, "Redis back",
                   interval=0.1)
        r = redis.Redis.from_url(cluster.redis_url)

        def beating() -> bool:   # both ranks hold their slots again, rank 0 marked the group as run
            return all(r.exists(k.rank_alive(i)) for i in range(2)) and r.hget(k.dist, "ran") == b"1"
        poll_until(beating, 30, "the ranks' heartbeats are back", interval=0.1)
        os.kill(old0, signal.SIGKILL)
        poll_until(lambda: int(r.hget(k.rank_info(0), "pid") or 0) not in (0, old0), 60,
                   "a spare took rank 0", interval=0.1)
        r.close()

        async def pinned() -> list[int]:
            client = openai.AsyncOpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=60)
            got = []
            try:   # rank 0's first and alone: one for rank 1 would wake the survivor itself
                for rank in (0, 1):
                    res = await client.completions.create(
                        model="lockstep-moe", prompt=f"after {rank}", max_tokens=6,
                        extra_body={"ignore_eos": True, "data_parallel_rank": rank})
                    got.append(res.usage.completion_tokens)
            finally:
                await client.close()
            return got
        assert asyncio.run(asyncio.wait_for(pinned(), 90)) == [6, 6]
        assert cluster.proc.poll() is None
    finally:
        cluster.stop()
