"""shared/advertise.py: the address engine ranks advertise when told ``auto``."""

from __future__ import annotations

import pytest

from shared.advertise import AddressUnknown, redis_host, resolve


def test_an_explicit_address_is_kept():
    assert resolve("10.1.2.3", "redis://redis:6379/0") == "10.1.2.3"


def test_auto_is_the_route_to_redis():
    assert resolve("auto", "redis://127.0.0.1:6379/0") == "127.0.0.1"
    assert resolve(" AUTO ", "redis://127.0.0.1:6379/0") == "127.0.0.1"


def test_cluster_and_sentinel_urls_name_their_first_node():
    assert redis_host("redis+cluster://10.0.0.7:7000,10.0.0.8:7000") == "10.0.0.7"
    assert redis_host("redis://db.internal:6379/0") == "db.internal"


def test_auto_without_a_host_says_so():
    with pytest.raises(AddressUnknown, match="cannot tell"):
        resolve("auto", "unix:///tmp/redis.sock")


def test_an_engine_told_auto_without_a_routable_redis_stops_at_start():
    """LOCKSTEP_GROUP_HOST=auto is resolved before the rank claims anything; when it cannot
    be, the engine exits 2 (a setting to fix, not a crash to restart) and says what to set."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LOCKSTEP_REDIS_URL": "unix:///nonexistent/redis.sock", "LOCKSTEP_GROUP_HOST": "auto"}
    r = subprocess.run([sys.executable, "-m", "services.admin.cli", "engine-worker"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "set LOCKSTEP_GROUP_HOST" in r.stderr
