"""Hot-spare engine processes against a real Redis, without `lockstep up` (the compose
path): a spare never takes the slot of a rank still starting, and takes a dead rank's
slot once its heartbeat lapses; the group re-forms with it under a new generation."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import redis

from shared.keys import Keys
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


def _engine(redis_url: str, namespace: str, log: Path, **extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    env.update({"LOCKSTEP_REDIS_URL": redis_url, "LOCKSTEP_NAMESPACE": namespace, "LOCKSTEP_RANKS": "2",
                "LOCKSTEP_BACKEND": "sim", "LOCKSTEP_HEARTBEAT_MS": "300", "LOCKSTEP_COLLECTIVE_TIMEOUT_S": "5",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "services.admin.cli", "engine-worker"], env=env, cwd=ROOT,
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _spare_waiting(r: redis.Redis, k: Keys) -> bool:
    return any(True for _ in r.scan_iter(match=k.spare("*")))


def test_spare_takes_a_dead_ranks_slot_without_a_supervisor(redis_url, namespace, tmp_path):
    r = redis.Redis.from_url(redis_url)
    k = Keys(namespace)
    # The spare starts first: it must wait for the group to form, not take a starting rank's slot.
    spare = _engine(redis_url, namespace, tmp_path / "spare.log", LOCKSTEP_SPARE="1")
    procs = [spare]
    try:
        async def spare_waiting():
            return _spare_waiting(r, k)
        asyncio.run(wait_until(spare_waiting, timeout=60))
        assert r.get(k.rank_alive(0)) is None and r.get(k.rank_alive(1)) is None
        ranks = [_engine(redis_url, namespace, tmp_path / f"rank{i}.log", LOCKSTEP_RANK=str(i)) for i in range(2)]
        procs += ranks

        async def formed():
            info = [r.hgetall(k.rank_info(i)) for i in range(2)]
            return all(b"ready" in x for x in info) and info
        info = asyncio.run(wait_until(formed, timeout=90))
        assert [int(x[b"pid"]) for x in info] == [p.pid for p in ranks]   # each rank kept its own slot
        gen = int(r.hget(k.dist, "gen"))

        os.kill(ranks[1].pid, signal.SIGKILL)

        async def taken_over():
            d = r.hgetall(k.dist)
            return (int(r.hget(k.rank_info(1), "pid") or 0) == spare.pid and r.exists(k.rank_alive(1))
                    and int(d.get(b"gen", 0)) > gen and d.get(b"formed") == b"1")
        asyncio.run(wait_until(taken_over, timeout=60))
        assert spare.poll() is None and ranks[0].poll() is None
        assert not _spare_waiting(r, k)   # no longer a spare
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        r.close()


def test_healthcheck_passes_for_a_waiting_spare(redis_url, namespace, tmp_path):
    spare = _engine(redis_url, namespace, tmp_path / "spare.log", LOCKSTEP_SPARE="1")
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    try:
        async def waiting():
            return _spare_waiting(r, k)
        asyncio.run(wait_until(waiting, timeout=60))
        env = {**os.environ, "LOCKSTEP_REDIS_URL": redis_url, "LOCKSTEP_NAMESPACE": namespace, "LOCKSTEP_RANKS": "2"}
        res = subprocess.run([sys.executable, "-m", "services.admin.healthcheck", "engine"],
                             capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
        assert res.returncode == 0, res.stderr
    finally:
        spare.send_signal(signal.SIGTERM)
        assert spare.wait(15) == 0   # a waiting spare stops cleanly
        assert not _spare_waiting(r, k)
        r.close()
