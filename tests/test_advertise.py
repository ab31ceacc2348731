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
