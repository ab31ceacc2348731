"""What the Sentinel client makes of the sentinels' announcements (pure)."""

from __future__ import annotations

from shared.sentinel_client import announcement


def test_announcements_for_our_service():
    sel = "slave 127.0.0.1:6380 127.0.0.1 6380 @ lsprimary 127.0.0.1 6379"
    assert announcement("+selected-slave", sel, "lsprimary") == ("head", ("127.0.0.1", 6380))
    assert announcement("+selected-slave", sel, "other") is None
    assert announcement("+switch-master", "lsprimary 127.0.0.1 6379 127.0.0.1 6380", "lsprimary") == ("done", None)
    assert announcement("+switch-master", "other 127.0.0.1 6379 127.0.0.1 6380", "lsprimary") is None
    assert announcement("-failover-abort-no-good-slave", "master lsprimary 127.0.0.1 6379", "lsprimary") == ("done", None)
    assert announcement("+sdown", "master lsprimary 127.0.0.1 6379", "lsprimary") is None
