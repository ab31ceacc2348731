"""A held group's round (no forward: a batch gate's hold, an idle group's hold) waits a
couple of milliseconds for inbox entries. Against a real server with its default ``hz``
(10), where a server-side BLOCK this short ends only at the next cron tick."""

from __future__ import annotations

import statistics
import time

import pytest

from services.engine_worker.inbox_reader import InboxReader
from services.engine_worker.worker import HOLD_POLL_MS, EngineWorker
from shared import keys as K
from shared.bus import connect, ensure_group
from shared.messages import FIELD, Request, SamplingParams, dumps
from shared.settings import EngineSettings

pytestmark = pytest.mark.timeout(60)


async def test_a_hold_round_waits_its_poll_not_the_servers_cron_tick(redis_url, namespace):
    """Each round took 100 ms with nothing arriving (BLOCK 2 against hz 10): a lone request
    on an idle 4-rank CPU cluster held for the idle group's 5 ms got its first token 80 ms
    later than without the hold."""
    r = connect(redis_url)
    keys = K.Keys(namespace)
    w = EngineWorker(EngineSettings(redis_url=redis_url, namespace=namespace, rank=0, ranks=1))
    reader = InboxReader(r, keys, w.state, "rank0-me", w.log)
    try:
        assert int((await r.config_get("hz"))["hz"]) <= 10     # the default that made BLOCK 2 last 100 ms
        await ensure_group(r, keys.inbox(0), K.ENGINE_GROUP, "0")
        took = []
        for _ in range(5):
            t0 = time.perf_counter()
            await reader.poll(HOLD_POLL_MS, 16)
            took.append((time.perf_counter() - t0) * 1000)
        assert reader.take_all() == []
        assert statistics.median(took) < 50, took               # a cron tick is 100 ms
        doc = Request("q1", "apiR", list(b"hey"), SamplingParams(max_tokens=2), time.time(), rank=0).to_dict()
        await r.xadd(keys.inbox(0), {FIELD: dumps(doc)})
        await reader.poll(HOLD_POLL_MS, 16)                      # what landed meanwhile is taken
        assert [d["id"] for _, d in reader.take_all()] == ["q1"]
    finally:
        await r.aclose()
