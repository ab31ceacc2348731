"""The host calibration `scripts/bench-path` prints beside its figures, on a real Redis."""

from __future__ import annotations

import asyncio

from services.admin.path_bench import calibrate


def test_calibration_measures_a_round_trip_and_a_wake_up(redis_url):
    host = asyncio.run(calibrate(redis_url, samples=20))
    assert host["redis_ping_us"] > 0
    assert host["xadd_to_xread_wake_us"] is not None and host["xadd_to_xread_wake_us"] > 0


def test_a_read_whose_block_ran_out_is_no_sample_not_a_crash(redis_url):
    """On a loaded host the blocked XREAD can time out before the XADD lands; the
    calibration used to index the empty reply (IndexError, and bench-path died)."""
    # the block always runs out first (Redis ends blocks within 1/hz = 100 ms): the add comes 0.5 s later
    host = asyncio.run(calibrate(redis_url, samples=6, block_ms=1, idle_s=0.5))
    assert host["redis_ping_us"] > 0
    assert host["xadd_to_xread_wake_us"] is None
