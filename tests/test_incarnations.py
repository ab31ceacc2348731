"""Failover is exact (issue #14.4, #14.7): every scheduler leadership dispatches under its
own incarnation id, batch numbers of a new leader sort after the old one's on the engines'
gate, and the engines' per-dispatcher ``recv`` marks are bounded."""

from __future__ import annotations

import pytest

from services.engine_worker.batch_gate import BatchGate, batch_number
from services.engine_worker.recv_marks import RecvMarks
from services.engine_worker.sequence import Sequence
from services.scheduler.service import SchedulerService
from shared.bus import connect
from shared.messages import FIELD, Request, SamplingParams
from shared.policy.staggered import StaggeredBatcher
from tests.helpers import wait_until
from tests.test_scheduler_live import _have, _req, _settings, running

pytestmark = pytest.mark.timeout(60)


def _seq(rid: str, batch: str, counts: list[int]) -> Sequence:
    req = Request(rid, "api", list(b"hello"), SamplingParams(max_tokens=2), 0.0, rank=0, batch=batch,
                  batch_counts=counts)
    return Sequence.from_request(req)


def test_batch_numbers_order_across_incarnations_and_keep_the_plain_form():
    assert batch_number("scheduler-17") == 17                      # the simulator's single scheduler
    assert batch_number("scheduler.1-5") > 0
    assert batch_number("scheduler.2-1") > batch_number("scheduler.1-999999")
    assert batch_number("scheduler.1-2") > batch_number("scheduler.1-1")
    for other in ("api-x-3", "scheduler.x-1", "schedulerX.1-1", None, "", "scheduler.1-"):
        assert batch_number(other) == 0
    b = StaggeredBatcher(dispatcher_id="scheduler", ranks=[0])
    assert b.poll(0.0) == [] and batch_number(b.submit(_info("r"), 0.0)[0].batch) == 1


def _info(rid):
    from shared.policy.base import RequestInfo
    return RequestInfo(rid, 4, 4, 0.0)


def test_a_new_leaders_batch_is_gated_although_ranks_completed_higher_numbers_before():
    """Rank 1 completed batch 57 of the old leader; the new leader's first batch has a
    share on both ranks: rank 0 must hold it until rank 1's share arrived (with restarted
    numbers 'scheduler-1' the old marks covered it and gating was silently off)."""
    gate = BatchGate(rank=0, timeout_s=10.0)
    old = batch_number("scheduler.1-57")
    gate.complete = old                               # rank 0 too saw the old leader's batches
    seq = _seq("n1", "scheduler.2-1", [1, 1])
    gate.on_arrival(seq)
    assert not gate.may_prefill(seq)
    gate.after_exchange([gate.complete, old], [gate.oldest_held(), 0], 0, now=0.0)
    assert not gate.may_prefill(seq), "released on the old leader's completion marks"
    gate.after_exchange([gate.complete, batch_number("scheduler.2-1")], [0, 0], 0, now=0.1)
    assert gate.may_prefill(seq)


async def test_each_leadership_dispatches_under_its_own_incarnation(redis_url, namespace):
    r = connect(redis_url)
    seen = []
    try:
        for i in range(2):
            svc = SchedulerService(_settings(redis_url, namespace))
            async with running(svc):
                ids = {f"L{i}a", f"L{i}b"}
                for rid in sorted(ids):
                    await r.xadd(svc.keys.requests, {FIELD: _req(rid)})
                docs = await wait_until(lambda: _have(r, svc.keys, ids), timeout=10)
                seen.append((svc.dispatcher_id, [docs[x] for x in sorted(ids)]))
    finally:
        await r.aclose()
    (d0, docs0), (d1, docs1) = seen
    assert d0 != d1 and d0.startswith("scheduler.") and d1.startswith("scheduler.")
    assert {d["dp"] for d in docs0} == {d0} and {d["dp"] for d in docs1} == {d1}
    b0, b1 = docs0[0]["b"], docs1[0]["b"]
    assert b0.startswith(d0 + "-") and b1.startswith(d1 + "-")
    assert batch_number(b1) > batch_number(b0) > 0
    # The new leader's seqs start at 1 again: its own, echoed per incarnation.
    assert min(d["ds"] for d in docs1) == 1


def test_recv_marks_are_bounded_per_incarnation():
    m = RecvMarks(max_entries=3, idle_s=100.0)
    m.note("scheduler.1", 5, 0.0)
    m.note("scheduler.1", 3, 1.0)                  # seqs only grow
    assert m.as_dict() == {"scheduler.1": 5}
    for i in range(10):                            # api-server incarnations come and go
        m.note(f"api-api0-{i}", 1, 2.0 + i)
    m.note("scheduler.2", 7, 20.0)
    assert len(m) == 3 and m.get("scheduler.2") == 7
    assert set(m.as_dict()) == {"api-api0-8", "api-api0-9", "scheduler.2"}
    # Not heard from for idle_s: forgotten.
    assert m.as_dict(now=115.0) == {"scheduler.2": 7}
    assert m.as_dict(now=500.0) == {}
