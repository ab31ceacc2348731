"""Replacing a dead rank keeps the group usable (issue #14 item 1): a real
`lockstep up --ranks 2 --spares 1 --backend sim` cluster; SIGKILL one rank, a hot spare
takes its slot, the group re-forms and pauses; then requests pinned to EVERY rank must
complete within a bound, the group's (wave, step) counters agree again, and another
pause/wake cycle still works. Rank 0 is the hard case: its replacement starts with fresh
counters while the survivor's wave has moved on."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from tests.helpers import poll_until
import redis

from shared.keys import Keys
from tests.conftest import start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "lockstep-moe"
RANKS = 2


def _poll(pred, timeout: float, what: str):
    return poll_until(pred, timeout, what, interval=0.05)


async def _pinned_round(url: str, tag: str, bound_s: float, ranks: list[int]) -> None:
    """Two requests pinned to each of ``ranks``; all must finish within ``bound_s``."""
    async with httpx.AsyncClient(timeout=bound_s) as http:
        async def one(rank: int, i: int) -> int:
            resp = await http.post(url + "/completions", json={
                "model": MODEL, "prompt": f"{tag} {rank} {i}", "max_tokens": 4, "ignore_eos": True,
                "data_parallel_rank": rank})
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]["completion_tokens"]
        done = await asyncio.wait_for(asyncio.gather(*(one(r, i) for r in ranks for i in range(2))), bound_s)
    assert done == [4] * (2 * len(ranks))


def _paused(r: redis.Redis, k: Keys) -> bool:
    return r.exists(k.paused) == 1


def _start(tmp_path, spares: int, namespace: str):
    """The cluster, its engines with a 5 s collective timeout (a dead peer is noticed soon)."""
    saved = os.environ.get("LOCKSTEP_COLLECTIVE_TIMEOUT_S")
    os.environ["LOCKSTEP_COLLECTIVE_TIMEOUT_S"] = "5"
    try:
        return start_cluster(tmp_path, "--ranks", str(RANKS), "--api-servers", "1", "--backend", "sim",
                             "--spares", str(spares), namespace=namespace)
    finally:
        if saved is None:
            os.environ.pop("LOCKSTEP_COLLECTIVE_TIMEOUT_S", None)
        else:
            os.environ["LOCKSTEP_COLLECTIVE_TIMEOUT_S"] = saved


@pytest.mark.parametrize("victim", [0, 1])
def test_replaced_rank_group_serves_every_rank(tmp_path, victim):
    cluster = _start(tmp_path, 1, f"rep{victim}{os.getpid()}")
    r = redis.Redis.from_url(cluster.redis_url)
    k = Keys(cluster.namespace)
    try:
        # Let the group run a few waves first, so the survivor's counters are ahead of a
        # fresh process's.
        for w in range(3):
            asyncio.run(_pinned_round(cluster.api_url, f"warm{w}", 20, list(range(RANKS))))
            _poll(lambda: _paused(r, k), 20, "group paused")
        old_pid = int(r.hget(k.rank_info(victim), "pid"))
        gen = int(r.hget(k.dist, "gen"))
        r.hset(k.rank_info(victim), "idle_forwards", 999_999)   # the predecessor's count, made unmistakable
        os.kill(old_pid, signal.SIGKILL)

        def replaced():
            pid = int(r.hget(k.rank_info(victim), "pid") or 0)
            d = r.hgetall(k.dist)
            return (pid not in (0, old_pid) and r.hexists(k.rank_info(victim), "ready")
                    and int(d.get(b"gen", 0)) > gen and d.get(b"formed") == b"1")
        _poll(replaced, 60, "a spare took the rank and the group re-formed")
        _poll(lambda: _paused(r, k), 30, "re-formed group paused")
        # the replacement shows its own idle forwards, not its predecessor's (status, watch)
        assert int(r.hget(k.rank_info(victim), "idle_forwards")) != 999_999

        # Work for one rank alone wakes the whole group (the others must join its steps),
        # then for every rank at once; pause after pause.
        for w, ranks in enumerate([[0], [1], [0, 1], [1], [0]]):
            asyncio.run(_pinned_round(cluster.api_url, f"after{w}", 15, ranks))
            _poll(lambda: _paused(r, k), 20, "group paused again")
        # The group's counters agree: both ranks report the same (wave, step).
        def aligned():
            infos = [r.hmget(k.rank_info(i), ["wave", "step"]) for i in range(RANKS)]
            return len({tuple(x) for x in infos}) == 1
        _poll(aligned, 10, "ranks report the same (wave, step)")
    finally:
        r.close()
        assert cluster.stop() == 0


def test_a_group_whose_every_rank_died_keeps_the_schedulers_view_fresh(tmp_path):
    # Every rank SIGKILLed at once: no survivor carries the group's (wave, step), and the new
    # group restarted them at (0, 0). The scheduler took each of its reports as older than
    # that rank's last one and dropped it: its snapshot froze (seen 112 s old under load) and
    # waterfill placed by it, at half the throughput. The new group now continues from what
    # Redis recorded. (Where that is gone too, the scheduler begins its step sequence again:
    # tests/test_aggregator.py, the new-incarnation tests.)
    cluster = _start(tmp_path, 2, f"all{os.getpid()}")
    r = redis.Redis.from_url(cluster.redis_url)
    k = Keys(cluster.namespace)

    def snapshot_key() -> tuple[int, int]:
        w, st = r.hmget(k.snapshot, ["wave", "step"])
        return (int(w), int(st)) if w is not None else (-1, -1)
    try:
        for w in range(5):    # waves ahead of what a new group runs below (each wake is one)
            asyncio.run(_pinned_round(cluster.api_url, f"warm{w}", 20, list(range(RANKS))))
            _poll(lambda: _paused(r, k), 20, "group paused")
        before = snapshot_key()
        assert before >= (4, 0), before
        pids = [int(r.hget(k.rank_info(i), "pid")) for i in range(RANKS)]
        gen = int(r.hget(k.dist, "gen"))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

        def replaced():
            d = r.hgetall(k.dist)
            return (all(int(r.hget(k.rank_info(i), "pid") or 0) not in (0, *pids) for i in range(RANKS))
                    and int(d.get(b"gen", 0)) > gen and d.get(b"formed") == b"1")
        _poll(replaced, 90, "both ranks replaced and the group re-formed")
        seq0 = int(r.hget(k.snapshot, "seq") or 0)
        # one round: a new group of its own could count past the old waves in a few
        asyncio.run(_pinned_round(cluster.api_url, "after", 30, list(range(RANKS))))
        _poll(lambda: int(r.hget(k.snapshot, "seq") or 0) > seq0 and snapshot_key() > before, 20,
              f"a snapshot of the new group's steps, newer than {before}")
    finally:
        r.close()
        assert cluster.stop() == 0
