"""A rank that stalls past its heartbeat and comes back (SIGSTOP/SIGCONT: a long GC, a
swapped-out host, a Redis failover that outlasts the alive key's TTL) while its requests
stream: the scheduler takes it for dead and resumes its requests, the api-server
resubmits them, and with one rank they are placed back on the same rank, which still
runs the old copies. Every stream must still complete with exactly its tokens, and the
old copies must not run on beside the new ones."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.conftest import start_cluster
from tests.helpers import poll_until
from tests.redis_topology import check_streams, stream_through

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_rank_back_from_a_stall_longer_than_its_heartbeat_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_HEARTBEAT_MS", "200")   # the alive key lapses 0.6 s into a stall
    cluster = start_cluster(tmp_path, "--ranks", "1", "--spares", "0", "--api-servers", "1", "--backend", "sim",
                            namespace="lstall")
    stopped = None
    try:
        def status() -> dict:
            res = cluster.cli("status", "--json")
            assert res.returncode == 0, res.stderr
            return json.loads(res.stdout)

        pid = status()["ranks"][0]["pid"]
        n, tokens = 8, 300

        def stall() -> None:
            nonlocal stopped
            os.kill(pid, signal.SIGSTOP)
            stopped = pid
            poll_until(lambda: status()["scheduler"]["counters"].get("resumed", 0) >= 1, timeout=60,
                       what="the scheduler resumes the stalled rank's requests", interval=0.2)
            os.kill(pid, signal.SIGCONT)
            stopped = None

        results = stream_through(cluster.api_url, n, tokens, "st", stall, join_s=150)
        check_streams(results, n, tokens, "st")
        # The stale copies did not run on beside the resumed ones: retired (their api-server
        # told the rank), or replaced by the resumed copy where the retire went to the
        # scheduler's recovery instead (it reads a dead rank's undelivered entries, the
        # retire among them, while the rank is still taken for dead).
        log = (tmp_path / "state" / "lstall" / "logs" / "engine-0.log").read_text()
        assert "stale_copy_retired" in log or "request_superseded" in log
        # The same process serves on: it never lost its slot to anyone.
        assert status()["ranks"][0]["pid"] == pid
        assert cluster.proc.poll() is None
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        cluster.stop()
