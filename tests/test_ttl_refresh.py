"""services/engine_worker/ttl_refresh.py: an output stream's TTL is refreshed once a second,
not every step."""

from __future__ import annotations

from services.engine_worker.ttl_refresh import TtlRefresh


def test_a_key_is_refreshed_at_first_then_once_per_interval():
    t = TtlRefresh(every_s=1.0)
    steps = [i * 0.25 for i in range(13)]           # 3 s of 250 ms steps (exact in binary)
    assert [now for now in steps if t.due("ls:out:api0", now)] == [0.0, 1.0, 2.0, 3.0]


def test_keys_are_independent():
    t = TtlRefresh(every_s=1.0)
    assert t.due("a", 0.0) and t.due("b", 0.5)
    assert not t.due("a", 0.9) and t.due("a", 1.0) and not t.due("b", 1.4) and t.due("b", 1.5)


def test_the_table_stays_bounded_as_api_servers_come_and_go():
    t = TtlRefresh(every_s=1.0, max_keys=8)
    for i in range(1000):
        assert t.due(f"ls:out:api{i}", float(i))    # a new replica every second
    assert len(t._last) <= 8
