"""A rank that stalls past its heartbeat and comes back (SIGSTOP/SIGCONT: a long GC, a
swapped-out host, a Redis failover that outlasts the alive key's TTL) while its requests
stream. Every stream must still complete with exactly its tokens, and no stale copy may
run on beside a resumed one.

* The only rank stalls: with no live rank the scheduler resumes nothing (resumed work
  could only go back to a dead inbox; before, it cycled there, epochs 0 -> 7 within one
  scan), and the rank goes on with its own work when it is back.
* One of two ranks stalls: its requests are resumed on the other, their api-server sends
  it a retire for each, and a scan that runs while it is still dead puts the retires back
  for it instead of draining them: back, it drops its stale copies."""

from __future__ import annotations

import json
import os
import signal

import orjson
import pytest
import redis

from shared import keys as K
from shared.messages import FIELD
from tests.conftest import start_cluster
from tests.helpers import poll_until
from tests.redis_topology import check_streams, stream_through

pytestmark = pytest.mark.slow


def _status(cluster) -> dict:
    res = cluster.cli("status", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.timeout(180)
def test_the_only_rank_back_from_a_stall_goes_on_with_its_own_work(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_HEARTBEAT_MS", "200")   # the alive key lapses 0.6 s into a stall
    cluster = start_cluster(tmp_path, "--ranks", "1", "--spares", "0", "--api-servers", "1", "--backend", "sim",
                            namespace="lstall")
    stopped = None
    try:
        pid = _status(cluster)["ranks"][0]["pid"]
        n, tokens = 8, 300

        def stall() -> None:
            nonlocal stopped
            os.kill(pid, signal.SIGSTOP)
            stopped = pid
            # The scheduler takes it for dead (its membership change runs a scan at once).
            poll_until(lambda: _status(cluster)["scheduler"].get("live", [0]) == [], timeout=60,
                       what="the scheduler takes the stalled rank for dead", interval=0.2)
            os.kill(pid, signal.SIGCONT)
            stopped = None

        results = stream_through(cluster.api_url, n, tokens, "st", stall, join_s=150)
        check_streams(results, n, tokens, "st")
        st = _status(cluster)
        assert st["scheduler"]["counters"].get("resumed", 0) == 0
        log = (tmp_path / "state" / "lstall" / "logs" / "engine-0.log").read_text()
        assert "request_superseded" not in log and "stale_copy_retired" not in log
        # The same process serves on: it never lost its slot to anyone.
        assert st["ranks"][0]["pid"] == pid
        assert cluster.proc.poll() is None
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        cluster.stop()


@pytest.mark.timeout(180)
def test_a_stalled_rank_among_live_ones_drops_its_stale_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_HEARTBEAT_MS", "200")
    # Rank 0 waits in the step collective for the stalled rank 1, heartbeat kept, instead
    # of taking it for gone and re-forming the group.
    monkeypatch.setenv("LOCKSTEP_COLLECTIVE_TIMEOUT_S", "60")
    cluster = start_cluster(tmp_path, "--ranks", "2", "--spares", "0", "--api-servers", "1", "--backend", "sim",
                            namespace="lstall2")
    r = redis.Redis.from_url(cluster.redis_url, socket_timeout=5)
    inbox = K.Keys("lstall2").inbox(1)
    stopped = None
    try:
        pid = _status(cluster)["ranks"][1]["pid"]
        n, tokens = 8, 300

        def retires_put_back() -> bool:
            # A scan ran while rank 1 was dead and put its retires back (``t`` marks that).
            docs = [orjson.loads(f[FIELD]) for _, f in r.xrange(inbox)]
            return any(d.get("k") == "retire" and "t" in d for d in docs)

        def stall() -> None:
            nonlocal stopped
            os.kill(pid, signal.SIGSTOP)
            stopped = pid
            poll_until(lambda: _status(cluster)["scheduler"]["counters"].get("resumed", 0) >= 1, timeout=60,
                       what="the scheduler resumes the stalled rank's requests", interval=0.2)
            poll_until(retires_put_back, timeout=30, what="a scan puts the retires back", interval=0.1)
            os.kill(pid, signal.SIGCONT)
            stopped = None

        results = stream_through(cluster.api_url, n, tokens, "st", stall, join_s=150)
        check_streams(results, n, tokens, "st")
        log = (tmp_path / "state" / "lstall2" / "logs" / "engine-1.log").read_text()
        assert "stale_copy_retired" in log
        assert _status(cluster)["ranks"][1]["pid"] == pid
        assert cluster.proc.poll() is None
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        r.close()
        cluster.stop()
