"""waterfill's level follows the engines' step size, and it learns their sequence slots,
against the real embedded Redis.

The level is two steps of prefill per rank. It was a fixed 4,096 tokens: right for the
default 2,048-token steps, but with engines run at max_num_batched_tokens 8,192 it was half
a step, and ranks went dry between dispatches (docs/benchmarks.md, "How the default
decides", item 1). Now each rank reports its step size in its info hash and the scheduler
follows it, unless an operator set ``level_tokens``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import redis.asyncio as aioredis

from services.engine_worker.membership import GroupMembership
from services.scheduler.membership import Membership
from services.scheduler.recovery import Recovery
from services.scheduler.state import SchedulerState
from shared import keys as K
from shared.logging import configure
from shared.policy.aggregator import StepAggregator
from shared.policy.waterfill import DEFAULT_STEP_TOKENS, WaterFill, level_for
from shared.settings import EngineSettings, SchedulerSettings

pytestmark = [pytest.mark.timeout(30)]


def test_level_for_takes_two_steps_of_the_largest_engine_and_the_default_engine_without_a_report():
    assert level_for([4608, b"4608"]) == 9216
    assert level_for([2048, 8192, None]) == 16384
    assert level_for([]) == level_for(None) == level_for([None, b""]) == 4096
    # the fallback is the engines' own default step, so an unset level matches them
    assert DEFAULT_STEP_TOKENS == EngineSettings.model_fields["max_num_batched_tokens"].default
    assert SchedulerSettings.model_fields["level_tokens"].default == 0   # 0: follow the engines


async def _poll_once(redis_url: str, namespace: str, follow: bool, reports: dict[int, int | None],
                     live: set[int], slots: dict[int, int] | None = None) -> WaterFill:
    """One membership poll of a scheduler whose ranks report ``reports`` (rank -> step
    tokens) and of which ``live`` hold their slot; returns its policy."""
    r = aioredis.Redis.from_url(redis_url)
    keys = K.Keys(namespace)
    ranks = sorted(reports)
    policy = WaterFill(ranks=ranks, level_tokens=level_for(None))
    st = SchedulerState(ranks, policy, StepAggregator(ranks), live=[])
    log = configure("scheduler", "error")
    try:
        for rank, step in reports.items():
            if step is not None:
                await r.hset(keys.rank_info(rank), mapping={"consumer": f"rank{rank}", "step_tokens": step})
            if slots and rank in slots:
                await r.hset(keys.rank_info(rank), "max_seqs", slots[rank])
            if rank in live:
                await r.set(keys.rank_alive(rank), "token", px=10_000)
        await Membership(r, keys, st, Recovery(r, keys, st, log), log, follow_step_tokens=follow).iteration()
        assert st.live == sorted(live)
        return st.policy
    finally:
        await r.aclose()


def test_the_scheduler_follows_the_live_ranks_step_size(redis_url, namespace):
    policy = asyncio.run(_poll_once(redis_url, namespace, True, {0: 4608, 1: 4608, 2: 16384}, live={0, 1}))
    assert policy.level == 9216   # two 4,608-token steps; the dead rank's report does not count


def test_an_operators_level_is_kept(redis_url, namespace):
    policy = asyncio.run(_poll_once(redis_url, namespace, False, {0: 8192, 1: 8192}, live={0, 1}))
    assert policy.level == 4096


def test_ranks_that_report_nothing_leave_the_default_level(redis_url, namespace):
    policy = asyncio.run(_poll_once(redis_url, namespace, True, {0: None, 1: None}, live={0, 1}))
    assert policy.level == 4096


def test_the_scheduler_learns_each_live_ranks_slots(redis_url, namespace):
    policy = asyncio.run(_poll_once(redis_url, namespace, True, {0: 2048, 1: 2048, 2: 2048}, live={0, 1},
                                    slots={0: 64, 1: 128, 2: 256}))
    assert policy._max_seqs == {0: 64, 1: 128}   # the dead rank's does not count


def test_a_rank_reports_its_step_size_and_slots_in_its_info(redis_url, namespace):
    keys = K.Keys(namespace)
    settings = EngineSettings(redis_url=redis_url, namespace=namespace, ranks=1, heartbeat_ms=100,
                              max_num_batched_tokens=4608, max_num_seqs=96)

    async def main() -> list[bytes | None]:
        r = aioredis.Redis.from_url(redis_url)
        try:
            m = GroupMembership(settings, r, keys, configure("engine-worker", "error"), asyncio.Event(),
                                uuid.uuid4().hex, counters=lambda: (0, 0), adopt=lambda w, s: None,
                                on_slot_lost=lambda holder: threading.Event().set())
            m.rank = 0
            await m.prepare_streams("rank0-test")
            return await r.hmget(keys.rank_info(0), ["step_tokens", "max_seqs"])
        finally:
            await r.aclose()

    assert asyncio.run(main()) == [b"4608", b"96"]
