"""The api-server's watch for requests no service holds (lost_watch.py): a submission the
scheduler read and acked with no dispatch left its client waiting out request_timeout_s
with no word. The unit tests judge fakes; the live one drives a real Gateway on a real
Redis, with the test in the scheduler's place."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.api_server import lost_watch
from services.api_server.gateway import Gateway
from shared import keys as K
from shared.bus import connect, decode_entries
from shared.messages import Request, SamplingParams
from tests.helpers import wait_until

pytestmark = [pytest.mark.timeout(60)]


def _ch(rid: str, eid: str, *, last_t: float = 0.0, quiet_t: float = 0.0, epoch: int = 0, finish=None,
        stream: str = "ns:requests") -> SimpleNamespace:
    return SimpleNamespace(id=rid, entry=(stream, eid.encode()), last_t=last_t, quiet_t=quiet_t, epoch=epoch,
                           finish=finish)


def test_only_submissions_to_the_scheduler_silent_long_enough_are_looked_up():
    chs = [_ch("old", "5-0", quiet_t=10.0), _ch("recent", "6-0", quiet_t=90.0), _ch("tokens", "7-0", last_t=95.0),
           _ch("resumed", "8-0", epoch=1, quiet_t=20.0), _ch("done", "9-0", finish="stop"),
           _ch("inbox", "10-0", stream="ns:inbox:0"), _ch("older", "4-0", quiet_t=5.0)]
    got = lost_watch.due(chs, 100.0, "ns:requests", silent_s=30.0)
    assert [c.id for c in got] == ["older", "old", "resumed"]          # the longest silent first
    assert len(lost_watch.due(chs, 100.0, "ns:requests", silent_s=30.0, limit=1)) == 1


def test_lost_means_delivered_not_pending_and_unrecorded():
    chs = [_ch("lost", "5-0"), _ch("pending", "6-0"), _ch("placed", "7-0"), _ch("unread", "12-0")]
    pending = [[], [{"message_id": b"6-0"}], [], []]
    records = [(None, None), (None, None), (b"dispatched", None), (None, None)]
    assert lost_watch.lost(chs, b"10-0", pending, records) == ["lost"]
    assert lost_watch.lost(chs, None, pending, records) == []    # no group: the scheduler read nothing


def test_a_resumed_copy_is_lost_while_only_the_copy_before_is_recorded():
    """A resumed request's record is its earlier copy's until the scheduler places the new
    one (the record then carries the new epoch): the earlier record must not hide a resumed
    copy that the scheduler dropped."""
    chs = [_ch("dropped", "5-0", epoch=1), _ch("placed", "6-0", epoch=1), _ch("later", "7-0", epoch=2),
           _ch("finished_before", "8-0", epoch=1)]
    pending = [[], [], [], []]
    records = [(b"dispatched", None), (b"dispatched", b"1"), (b"dispatched", b"3"), (b"finished", None)]
    assert lost_watch.lost(chs, b"10-0", pending, records) == ["dropped", "finished_before"]


async def _ids(docs, *want: str) -> bool:
    return sorted(d["id"] for d in await docs if d["id"] in want) == list(want)


async def _flow(url: str, namespace: str) -> None:
    keys = K.Keys(namespace)
    r, admin = connect(url), connect(url)
    await admin.xgroup_create(keys.requests, K.SCHEDULER_GROUP, id="0", mkstream=True)
    gw = Gateway(r, keys, "apilost")
    gw.silent_check_s = 0.6
    await gw.start()
    try:
        chs = {rid: gw.submit(Request(rid, "apilost", [1, 2, 3], SamplingParams(max_tokens=4), time.time()))
               for rid in ("dropped", "held", "placed")}
        await asyncio.wait_for(asyncio.gather(*(c.sent.wait() for c in chs.values())), 10)
        # the scheduler's part: reads all three; places one (its record), holds one (pending),
        # and acks the third with no dispatch
        read = await admin.xreadgroup(K.SCHEDULER_GROUP, "sched", {keys.requests: ">"}, count=10)
        eids = {doc["id"]: eid for _, eid, doc in decode_entries(read)}
        await admin.hset(keys.req("placed"), mapping={"state": "dispatched", "rank": 0})
        await admin.xack(keys.requests, K.SCHEDULER_GROUP, eids["placed"], eids["dropped"])
        unread = gw.submit(Request("unread", "apilost", [4], SamplingParams(max_tokens=4), time.time()))
        await asyncio.wait_for(unread.sent.wait(), 10)

        async def resubmitted() -> list[dict]:
            docs = [doc for _, _, doc in decode_entries([(keys.requests, await admin.xrange(keys.requests))])]
            return [d for d in docs if d.get("ep", 0) > 0]

        again = await wait_until(resubmitted, timeout=10)
        assert [d["id"] for d in again] == ["dropped"] and chs["dropped"].epoch == 1
        await asyncio.sleep(3 * gw.silent_check_s)       # more rounds: nothing else is taken for lost
        assert [d["id"] for d in await resubmitted()] == ["dropped"]
        assert all(c.finish is None for c in (*chs.values(), unread))

        # A resumed copy dropped while only the copy before is recorded: resumed again.
        gw._resume(["placed"])
        await wait_until(lambda: _ids(resubmitted(), "placed"), timeout=10)
        read = await admin.xreadgroup(K.SCHEDULER_GROUP, "sched", {keys.requests: ">"}, count=10)
        copies = {(doc["id"], doc.get("ep", 0)): eid for _, eid, doc in decode_entries(read)}
        assert set(copies) == {("unread", 0), ("dropped", 1), ("placed", 1)}
        await admin.hset(keys.req("dropped"), mapping={"state": "dispatched", "rank": 0, "epoch": 1})
        await admin.xack(keys.requests, K.SCHEDULER_GROUP, copies["dropped", 1], copies["placed", 1])   # unread: held
        await wait_until(lambda: _ids(resubmitted(), "placed", "placed"), timeout=10)
        assert chs["placed"].epoch == 2
        await asyncio.sleep(3 * gw.silent_check_s)       # the placed resumed copy is not taken for lost
        assert sorted(d["id"] for d in await resubmitted()) == ["dropped", "placed", "placed"]
    finally:
        await gw.stop()
        await r.aclose()
        await admin.aclose()


def test_a_submission_acked_with_no_dispatch_is_resumed(redis_url, namespace):
    asyncio.run(_flow(redis_url, namespace))
