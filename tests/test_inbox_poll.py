"""A held group's round (no forward: a batch gate's hold, an idle group's hold) waits a
couple of milliseconds for inbox entries. Against a real server with its default ``hz``
(10), where a server-side BLOCK this short ends only at the next cron tick: the read the
round sends does not block (checked by the commands the server runs, not by a timing)."""

from __future__ import annotations

import asyncio
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
        await ensure_group(r, keys.inbox(0), K.ENGINE_GROUP, "0")
        async with r.monitor() as mon:                           # every command the server runs
            await reader.poll(HOLD_POLL_MS, 16)
            end = f"end-of-poll-{namespace}"
            await r.echo(end)                                    # the end of the poll's commands
            sent = []
            while not sent or end not in sent[-1]:
                sent.append((await asyncio.wait_for(mon.next_command(), 10))["command"])
        inbox = keys.inbox(0)   # (a server shared with other tests: their commands show too)
        reads = [c for c in sent if c.upper().startswith("XREADGROUP") and inbox in c]
        assert len(reads) == 1 and " BLOCK " not in f" {reads[0].upper()} ", sent
        assert reader.take_all() == []
        doc = Request("q1", "apiR", list(b"hey"), SamplingParams(max_tokens=2), time.time(), rank=0).to_dict()
        await r.xadd(keys.inbox(0), {FIELD: dumps(doc)})
        await reader.poll(HOLD_POLL_MS, 16)                      # what landed meanwhile is taken
        assert [d["id"] for _, d in reader.take_all()] == ["q1"]
    finally:
        await r.aclose()
