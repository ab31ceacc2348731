"""The api-server's side of a resume, against real Redis: the request is resubmitted under
a new epoch with the tokens already streamed, and the rank that streamed it is told to
retire its copy (it may only have stalled; services/engine_worker/ingest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services.api_server.gateway import Gateway
from shared import keys as K
from shared.bus import connect, decode_entries
from shared.messages import FIELD, Delta, Request, Resume, SamplingParams, encode, encode_deltas

pytestmark = [pytest.mark.timeout(60)]


async def _wait_entries(r, stream: str, n: int, bound_s: float = 10.0) -> list:
    deadline = time.monotonic() + bound_s
    while True:
        raw = await r.xrange(stream)
        entries = decode_entries([(stream.encode(), raw)]) if raw else []
        if len(entries) >= n:
            return [doc for _, _, doc in entries]
        assert time.monotonic() < deadline, f"{stream}: {len(entries)} entries, expected {n}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _gateway(redis_url: str, namespace: str):
    """A started api-server gateway "apitest", and a second connection to play the others."""
    keys = K.Keys(namespace)
    r, admin = connect(redis_url), connect(redis_url)
    gw = Gateway(r, keys, "apitest")
    await gw.start()
    try:
        yield gw, keys, admin
    finally:
        await gw.stop()
        await r.aclose()
        await admin.aclose()


async def _resume_flow(redis_url: str, namespace: str) -> None:
    async with _gateway(redis_url, namespace) as (gw, keys, admin):
        ch = gw.submit(Request("q1", "apitest", [1, 2, 3], SamplingParams(max_tokens=8), time.time()))
        ch2 = gw.submit(Request("q2", "apitest", [4, 5], SamplingParams(max_tokens=8), time.time()))
        await _wait_entries(admin, keys.requests, 2)
        out = keys.out("apitest")
        # Rank 3 streams two tokens of q1; q2 has not started anywhere yet.
        await admin.xadd(out, {FIELD: encode_deltas([Delta("q1", 0, [11, 12], rank=3)])})
        await asyncio.wait_for(ch.event.wait(), 10)
        assert ch.tokens == [11, 12] and ch.rank == 3
        # The scheduler took rank 3 for dead: both are resumed.
        await admin.xadd(out, {FIELD: encode(Resume(["q1", "q2"]))})
        docs = await _wait_entries(admin, keys.requests, 4)
        again = {d["id"]: d for d in docs[2:]}
        assert again["q1"]["g"] == [11, 12] and again["q1"]["ep"] == 1
        assert again["q2"].get("g", []) == [] and again["q2"]["ep"] == 1
        # Only the rank that streamed q1 hears of it: retire its epoch-0 copy.
        assert await _wait_entries(admin, keys.inbox(3), 1) == [{"k": "retire", "id": "q1", "r": 3, "ep": 0}]
        # A late delta of the old copy is ignored; the new one continues at position 2.
        await admin.xadd(out, {FIELD: encode_deltas([Delta("q1", 2, [99], rank=3, epoch=0),
                                                      Delta("q1", 2, [13], rank=0, epoch=1)])})
        deadline = time.monotonic() + 10
        while ch.tokens != [11, 12, 13]:
            assert time.monotonic() < deadline, ch.tokens
            await asyncio.sleep(0.02)
        assert ch2.tokens == []


def test_a_resume_resubmits_and_retires_the_stale_copy(redis_url, namespace):
    asyncio.run(_resume_flow(redis_url, namespace))


async def _gap_flow(redis_url: str, namespace: str) -> None:
    """Deltas lost in a Redis failover (written to the old primary after its replica was
    chosen; tests/test_sentinel.py once saw one under load): the stream jumps from position
    2 to 5. The request resumes from the two tokens the client has instead of ending in a
    "token stream gap" error, and the deltas past the gap are never shown."""
    async with _gateway(redis_url, namespace) as (gw, keys, admin):
        ch = gw.submit(Request("g1", "apitest", [1, 2, 3], SamplingParams(max_tokens=8), time.time()))
        await _wait_entries(admin, keys.requests, 1)
        out = keys.out("apitest")
        await admin.xadd(out, {FIELD: encode_deltas([Delta("g1", 0, [11, 12], rank=3)])})
        # positions 2-4 were lost; 5 and 6 arrive, the second with the finish
        await admin.xadd(out, {FIELD: encode_deltas([Delta("g1", 5, [16], rank=3),
                                                      Delta("g1", 6, [17], "length", rank=3)])})
        docs = await _wait_entries(admin, keys.requests, 2)
        assert docs[1]["id"] == "g1" and docs[1]["g"] == [11, 12] and docs[1]["ep"] == 1
        assert await _wait_entries(admin, keys.inbox(3), 1) == [{"k": "retire", "id": "g1", "r": 3, "ep": 0}]
        assert ch.finish is None and ch.tokens == [11, 12]
        # the resumed copy continues at position 2 and ends the request whole
        await admin.xadd(out, {FIELD: encode_deltas([Delta("g1", 2, [13, 14, 15, 16, 17, 18], "length",
                                                            rank=0, epoch=1)])})
        await asyncio.wait_for(ch.event.wait(), 10)
        deadline = time.monotonic() + 10
        while ch.finish is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert ch.tokens == [11, 12, 13, 14, 15, 16, 17, 18] and ch.finish == "length" and ch.error is None


def test_a_gap_in_the_token_stream_resumes_the_request(redis_url, namespace):
    asyncio.run(_gap_flow(redis_url, namespace))


def test_a_request_that_keeps_losing_deltas_ends_in_a_clear_error():
    from services.api_server.gateway import MAX_GAP_RESUMES, RequestChannel
    ch = RequestChannel("x")
    ch.req = Request("x", "a", [1], SamplingParams(max_tokens=8), 0.0)
    for epoch in range(MAX_GAP_RESUMES):
        ch.epoch = epoch
        assert ch.feed(Delta("x", 3, [9], rank=0, epoch=epoch), 0.0)        # a gap: resume it
        assert not ch.feed(Delta("x", 4, [9], rank=0, epoch=epoch), 0.0)    # past it: dropped, asked once
        assert ch.finish is None and ch.tokens == []
    ch.epoch = MAX_GAP_RESUMES
    assert not ch.feed(Delta("x", 3, [9], rank=0, epoch=MAX_GAP_RESUMES), 0.0)
    assert ch.finish == "error" and ch.error == "token stream gap"
