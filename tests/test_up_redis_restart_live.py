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
        if persist:                       # a snapshot to come back from (else: saved each 60 s)
            r = redis.Redis.from_url(cluster.redis_url)
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
        res = cluster.cli("status", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        assert cluster.proc.poll() is None
    finally:
        assert cluster.stop() == 0
