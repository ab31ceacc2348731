"""`lockstep up` says it is up only once the scheduler's leader counts every rank live. It
learns them from their heartbeats a few hundred ms after the engine group forms; requests
sent in between all went to the ranks it knew, and stayed there (a CI run of
tests/test_rank_leave_live.py saw all 12 of its requests on rank 0)."""

from __future__ import annotations

import json

import pytest
import redis

from shared.keys import Keys
from tests.conftest import start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("dispatch", ["scheduler", "client"])
def test_up_is_ready_when_the_leader_counts_every_rank(tmp_path, dispatch):
    args = ["--ranks", "3", "--api-servers", "1", "--backend", "sim", "--spares", "0", "--dispatch", dispatch]
    if dispatch == "client":
        args += ["--policy", "least_score"]
    cluster = start_cluster(tmp_path, *args)
    try:
        r = redis.Redis.from_url(cluster.redis_url)
        live = r.hget(Keys(cluster.namespace).scheduler, "live")   # read the moment `up` said it is up
        r.close()
        assert live is not None and sorted(json.loads(live)) == [0, 1, 2], live
    finally:
        cluster.stop()
