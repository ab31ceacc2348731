"""A retire reaches its rank even when the scheduler's recovery scans that rank's inbox
while the rank is taken for dead (services/scheduler/orphan_page.py), against the real
Redis; and the page plan itself (pure).

Before: recovery read and acked the retire with the dead rank's other undelivered
entries, so a rank back from a stall never saw it and its stale copy ran on beside the
resumed one (doubling that request's work)."""

from __future__ import annotations

import time

import orjson
import pytest

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.ingest import ingest
from services.engine_worker.rank_state import RankState
from services.engine_worker.rank_step import RankStep
from services.scheduler.housekeeping import recover_orphans
from services.scheduler.orphan_page import RETIRE_KEEP_S, plan_page
from shared import keys as K
from shared.bus import connect, decode_entries, ensure_group, entry_id_key
from shared.messages import FIELD, Request, Retire, SamplingParams, encode

pytestmark = pytest.mark.timeout(60)

API = "apiK"


class _Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level: str):
        return lambda event, **kw: self.events.append(event)


def _rank_state() -> RankState:
    core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512)
    gate = BatchGate(rank=0, timeout_s=0.5)
    return RankState(0, core, gate, RankStep(0, core, gate, None))


def _req(rid: str, epoch: int = 0) -> bytes:
    return encode(Request(rid, API, [1, 2, 3], SamplingParams(max_tokens=4), time.time(), epoch=epoch))


async def test_a_retire_survives_scans_of_its_dead_rank_and_reaches_it(redis_url, namespace):
    """Rank 0 stalls while running q0 and is taken for dead (rank 1 lives on): q0 is
    resumed, its api-server writes rank 0 a retire, and q1 is placed on rank 0 before the
    scheduler sees it dead. Two more scans run while rank 0 is still dead; then it comes
    back and must read the retire (and not q1, resumed elsewhere)."""
    r = connect(redis_url)
    keys = K.Keys(namespace)
    inbox = keys.inbox(0)
    st, log = _rank_state(), _Log()
    try:
        await ensure_group(r, inbox, K.ENGINE_GROUP, "0")
        await r.xadd(inbox, {FIELD: _req("q0")})
        running = await r.xreadgroup(K.ENGINE_GROUP, "rank0-a", {inbox: ">"}, count=10)
        await r.hset(keys.rank_info(0), mapping={"consumer": "rank0-a"})
        await r.xadd(inbox, {FIELD: _req("q1")})
        scan = lambda: recover_orphans(r, keys, [0, 1], {1}, {0, 1})   # noqa: E731
        assert sorted((await scan())[API]) == ["q0", "q1"]
        retire_id = await r.xadd(inbox, {FIELD: encode(Retire("q0", 0, 0))})   # gateway._resume
        for _ in range(2):
            assert await scan() == {}
        # Rank 0 is back (the same incarnation): it reads its inbox.
        back = await r.xreadgroup(K.ENGINE_GROUP, "rank0-a", {inbox: ">"}, count=10)
        docs = [(eid, doc) for _, eid, doc in decode_entries(back)]
        assert [d["k"] for _, d in docs] == ["retire"], docs
        assert docs[0][1]["id"] == "q0" and docs[0][1]["ep"] == 0
        assert docs[0][1]["t"] == entry_id_key(retire_id)[0]   # its first write, kept for its bound
        # ... and it drops the stale copy it was running.
        ingest(st, [(eid, doc) for _, eid, doc in decode_entries(running)], log)
        assert st.core.get("q0") is not None
        ingest(st, docs, log)
        assert st.core.get("q0") is None and "stale_copy_retired" in log.events
    finally:
        await r.aclose()


def _entry(i: int, doc: bytes) -> tuple[bytes, dict]:
    return f"{1_000_000 + i}-0".encode(), {FIELD: doc}


def test_page_plan_requeues_retires_and_what_lies_past_the_bound():
    now = 1_000_010
    entries = [_entry(0, _req("a")), _entry(1, encode(Retire("x", 0, 2))), _entry(2, _req("b")),
               _entry(3, _req("c")), _entry(4, encode(Retire("y", 0, 0)))]
    page = plan_page(entries, b"1000002-0", now)
    assert [eid for eid, _ in page.resume] == [b"1000000-0", b"1000002-0"]
    assert page.ack == [eid for eid, _ in entries] and page.at_bound
    assert page.requeue[1] == entries[3][1]   # past the bound: back as it was
    kept = [Retire.from_dict(orjson.loads(f[FIELD])) for f in (page.requeue[0], page.requeue[2])]
    assert [(k.id, k.epoch, k.since) for k in kept] == [("x", 2, 1_000_001), ("y", 0, 1_000_004)]
    # Not at the bound yet: the scan reads on.
    assert not plan_page(entries[:2], b"1000002-0", now).at_bound


def test_a_retire_is_dropped_once_it_has_waited_its_bound():
    first = 1_000_000
    rt = encode(Retire("x", 0, 0, since=first))
    eid = b"2000000-0"   # (already put back: a later id than its first write)
    assert plan_page([(eid, {FIELD: rt})], None, first + int(RETIRE_KEEP_S * 1000)).requeue == [{FIELD: rt}]
    gone = plan_page([(eid, {FIELD: rt})], None, first + int(RETIRE_KEEP_S * 1000) + 1)
    assert gone.requeue == [] and gone.ack == [eid] and gone.resume == []
