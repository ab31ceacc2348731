"""The engine-side batch gate: ranks release a batch in the same step, or on the leader's timeout."""

from __future__ import annotations

from services.engine_worker.batch_gate import BatchGate, batch_number
from services.engine_worker.sequence import Sequence
from shared.messages import SamplingParams


def seq(i: int, batch: str | None, counts: list[int] | None) -> Sequence:
    return Sequence(id=f"r{i}", prompt=[1, 2, 3], params=SamplingParams(max_tokens=4), batch=batch,
                    batch_counts=counts)


def exchange(gates: list[BatchGate], now: float) -> None:
    rows = [g.row() for g in gates]
    completes = [r[0] for r in rows]
    oldest = [r[1] for r in rows]
    leader = rows[0][2]
    for g in gates:
        g.after_exchange(completes, oldest, leader, now)


def test_batch_number():
    assert batch_number("scheduler-17") == 17
    assert batch_number(None) == 0
    assert batch_number("api-x-3") == 0      # other dispatchers are not gated


def test_released_together_only_when_every_share_arrived():
    gates = [BatchGate(rank=r) for r in range(3)]
    counts = [2, 1, 0]
    a, b, c = seq(1, "scheduler-1", counts), seq(2, "scheduler-1", counts), seq(3, "scheduler-1", counts)
    gates[0].on_arrival(a)
    gates[1].on_arrival(c)
    exchange(gates, 0.0)
    assert not gates[0].may_prefill(a) and not gates[1].may_prefill(c)   # rank 0 has 1 of 2
    gates[0].on_arrival(b)
    exchange(gates, 0.01)
    assert gates[0].may_prefill(a) and gates[0].may_prefill(b) and gates[1].may_prefill(c)
    assert gates[0].released_full == 1 and gates[1].released_full == 1


def test_leader_timeout_releases_everywhere_in_the_same_exchange():
    gates = [BatchGate(rank=r, timeout_s=0.1) for r in range(2)]
    counts = [1, 1]
    a = seq(1, "scheduler-5", counts)
    gates[0].on_arrival(a)          # rank 1's share never comes
    exchange(gates, 0.0)
    exchange(gates, 0.05)
    assert not gates[0].may_prefill(a)
    exchange(gates, 0.2)            # the leader decides ...
    assert not gates[0].may_prefill(a)
    exchange(gates, 0.21)           # ... and every rank applies it from the same row
    assert gates[0].may_prefill(a)
    assert gates[0].released_timeout == 1


def test_unbatched_requests_never_wait_and_bookkeeping_is_pruned():
    g = BatchGate(rank=0)
    assert g.may_prefill(seq(1, None, None))
    for n in range(1, 200):
        s = seq(n, f"scheduler-{n}", [1])
        g.on_arrival(s)
        g.after_exchange([g.complete], [g.oldest_held()], 0, n)
        assert g.may_prefill(s)
        g.forget_done(set())
    assert not g.counts and not g.arrived and not g.released


def test_a_batch_only_this_rank_shares_is_released_on_arrival():
    gates = [BatchGate(rank=r) for r in range(4)]
    lone = seq(1, "scheduler-9", [0, 0, 1, 0])
    gates[2].on_arrival(lone)
    assert gates[2].may_prefill(lone)            # no exchange needed: nobody else has a share
    assert gates[2].released_full == 1 and gates[2].oldest_held() == 0
    shared = seq(2, "scheduler-10", [0, 0, 1, 1])
    gates[2].on_arrival(shared)
    assert not gates[2].may_prefill(shared)      # rank 3's share still counts
    exchange(gates, 0.0)
    assert not gates[2].may_prefill(shared)
    gates[2].forget_done(set())
    assert 9 not in gates[2].counts
