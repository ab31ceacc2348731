"""Dispatch policies: even bursts, recv-based reconciliation, rotating ties, drained ranks,
client mode with several api-servers sharing snapshots."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shared.policy.base import Assignment, DispatchPolicy, RequestInfo
from shared.policy.dispatch import LeastScore, LeastTokens, RoundRobin
from shared.policy.registry import make_policy
from shared.stats import RankStats, Snapshot

POLICIES = [RoundRobin, LeastScore, LeastTokens]


def req(i: int, prompt: int = 100, out: int = 50) -> RequestInfo:
    return RequestInfo(id=f"r{i}", prompt_tokens=prompt, max_tokens=out, arrival=float(i))


class Engines:
    """Fake engines: each rank's inbox is a FIFO; a rank 'receives' a prefix of it, counts
    received requests as waiting and echoes the highest seq per dispatcher in recv."""

    def __init__(self, ranks):
        self.inflight: dict[int, list[tuple[Assignment, RequestInfo]]] = {r: [] for r in ranks}
        self.received: dict[int, list[tuple[Assignment, RequestInfo]]] = {r: [] for r in ranks}
        self.step = 0

    def send(self, a: Assignment, r: RequestInfo) -> None:
        self.inflight[a.rank].append((a, r))

    def receive(self, rnd: random.Random) -> None:
        for rank, q in self.inflight.items():
            k = rnd.randint(0, len(q))
            self.received[rank] += q[:k]
            del q[:k]

    def snapshot(self, t: float = 0.0) -> Snapshot:
        self.step += 1
        ranks = {}
        for rank, got in self.received.items():
            recv: dict[str, int] = {}
            for a, _ in got:
                recv[a.dispatcher] = max(recv.get(a.dispatcher, 0), a.seq)
            ranks[rank] = RankStats(rank=rank, wave=0, step=self.step, waiting=len(got),
                                    outstanding=sum(r.prompt_tokens + r.max_tokens for _, r in got),
                                    recv=recv)
        return Snapshot(wave=0, step=self.step, t=t, ranks=ranks, seq=self.step)

    def counts(self) -> Counter:
        return Counter({r: len(self.inflight[r]) + len(self.received[r]) for r in self.inflight})


def within(counts: Counter, ranks, lo=0.9, hi=1.1) -> bool:
    mean = sum(counts.values()) / len(ranks)
    return all(lo * mean <= counts[r] <= hi * mean for r in ranks)


@pytest.mark.parametrize("cls", POLICIES)
def test_implements_protocol_and_registry(cls):
    p = cls(ranks=[0, 1])
    assert isinstance(p, DispatchPolicy)
    assert type(make_policy(p.name, ranks=[0, 1], num_api_servers=3, client_mode=True)) is cls


@pytest.mark.parametrize("cls", POLICIES)
def test_burst_before_first_snapshot_spreads_evenly(cls):
    p = cls(ranks=[0, 1, 2, 3])
    c = Counter(p.choose(req(i), 0.0).rank for i in range(400))
    assert c == {0: 100, 1: 100, 2: 100, 3: 100}


@pytest.mark.parametrize("cls", POLICIES)
def test_burst_with_snapshots_mid_burst_stays_balanced(cls):
    rnd = random.Random(7)
    ranks = [0, 1, 2, 3]
    p, eng = cls(ranks=ranks), Engines(ranks)
    for i in range(400):
        eng.send(p.choose(req(i), i * 0.001), req(i))
        if i % 37 == 36:
            eng.receive(rnd)
            p.on_snapshot(eng.snapshot())
    assert within(eng.counts(), ranks), eng.counts()
    if cls is not RoundRobin:  # exact view: nothing double counted, nothing forgotten
        assert eng.counts() == {0: 100, 1: 100, 2: 100, 3: 100}


def test_recv_reconciliation_counts_each_dispatch_once():
    p = LeastTokens(ranks=[0, 1])
    eng = Engines([0, 1])
    sent = [p.choose(req(i, prompt=10 * (i + 1), out=0), 0.0) for i in range(4)]
    assert [(a.rank, a.seq, a.dispatcher) for a in sent] == [
        (0, 1, "scheduler"), (1, 1, "scheduler"), (0, 2, "scheduler"), (1, 2, "scheduler")]
    for i, a in enumerate(sent):
        eng.send(a, req(i, prompt=10 * (i + 1), out=0))
    # rank 0 received only its first request; rank 1 both
    eng.received[0] = eng.inflight[0][:1]; eng.inflight[0] = eng.inflight[0][1:]
    eng.received[1] = eng.inflight[1][:]; eng.inflight[1] = []
    snap = eng.snapshot()
    p.on_snapshot(snap)
    assert p.local_load(0) == 30                           # seq 2 (30 tokens) not shown yet
    assert p.local_load(1) == 0
    assert p.scores() == {0: 10 + 30, 1: 20 + 40}            # each dispatch counted exactly once
    p.on_snapshot(snap)                                       # a repeated snapshot changes nothing
    assert p.snapshots_ignored == 1 and p.scores() == {0: 40, 1: 60}
    assert p.reconciled == 3


def test_replace_mode_forgets_unreceived_dispatches_like_vllm():
    p = LeastScore(ranks=[0, 1], reconcile=False)
    eng = Engines([0, 1])
    for i in range(4):
        eng.send(p.choose(req(i), 0.0), req(i))
    p.on_snapshot(eng.snapshot())                             # engines received nothing yet
    assert p.scores() == {0: 0.0, 1: 0.0}                     # the 4 in flight are forgotten


def test_local_ttl_bounds_additions_an_engine_never_acknowledges():
    p = LeastScore(ranks=[0], local_ttl_s=5.0)
    p.choose(req(0), 0.0)
    p.choose(req(1), 10.0)
    p.on_snapshot(Snapshot(0, 1, 10.0, {0: RankStats(0, 0, 1)}, seq=1))
    assert p.local_load(0) == 1 and p.expired == 1


def test_ties_rotate_instead_of_favouring_low_ranks():
    p = LeastScore(ranks=list(range(4)))
    picks = []
    for k in range(40):
        # engines finish everything between decisions: every snapshot is an exact tie
        p.on_snapshot(Snapshot(0, k + 1, 0.0, {r: RankStats(r, 0, k + 1, recv={"scheduler": 10**6})
                                               for r in range(4)}, seq=k + 1))
        picks.append(p.choose(req(k), 0.0).rank)
    assert Counter(picks) == {0: 10, 1: 10, 2: 10, 3: 10}
    assert len(set(picks[:4])) == 4


def test_dispatchers_break_first_ties_differently():
    firsts = {LeastScore(ranks=list(range(8)), dispatcher_id=f"api-{i}").choose(req(0), 0).rank
              for i in range(8)}
    assert len(firsts) > 1


@pytest.mark.parametrize("cls", POLICIES)
def test_drained_rank_gets_nothing(cls):
    p = cls(ranks=[0, 1, 2, 3])
    p.set_ranks([0, 1, 3])
    # rank 2 even looks idle while the others are loaded
    p.on_snapshot(Snapshot(0, 1, 0.0, {r: RankStats(r, 0, 1, waiting=0 if r == 2 else 50,
                                                    outstanding=0 if r == 2 else 9999)
                                       for r in range(4)}, seq=1))
    c = Counter(p.choose(req(i), 0.0).rank for i in range(300))
    assert c[2] == 0 and set(c) == {0, 1, 3}


@pytest.mark.parametrize("cls", POLICIES)
def test_no_ranks_raises_clear_error(cls):
    p = cls()
    with pytest.raises(ValueError, match="no rank"):
        p.choose(req(0), 0.0)
    p.set_ranks([])
    with pytest.raises(ValueError, match="no rank"):
        p.choose(req(0), 0.0)


def test_ranks_taken_from_snapshot_when_never_set():
    p = LeastScore()
    p.on_snapshot(Snapshot(0, 1, 0.0, {r: RankStats(r, 0, 1, waiting=r) for r in range(3)}, seq=1))
    assert p.choose(req(0), 0.0).rank == 0


def test_explicit_request_is_counted_in_the_view():
    p = LeastScore(ranks=[0, 1])
    a = p.note_explicit(req(0), 1, 0.0)
    assert (a.rank, a.seq, a.reason, a.dispatcher) == (1, 1, "explicit", "scheduler")
    assert p.scores() == {0: 0.0, 1: 4.0}
    assert p.choose(req(1), 0.0).rank == 0
    assert p.scores() == {0: 4.0, 1: 4.0}
    # a pinned request to a drained rank is recorded too
    b = p.note_explicit(req(3), 5, 0.0)
    assert b.seq == 1 and p.local_load(5) == 1


def test_kv_penalty_steers_away_from_full_cache():
    snap = Snapshot(0, 1, 0.0, {
        0: RankStats(0, 0, 1, waiting=2, kv_used=95, kv_total=100),
        1: RankStats(1, 0, 1, waiting=3, kv_used=10, kv_total=100)}, seq=1)
    plain, kv = LeastScore(ranks=[0, 1]), LeastScore(ranks=[0, 1], kv_penalty=6.0)
    plain.on_snapshot(snap); kv.on_snapshot(snap)
    assert plain.choose(req(0), 0).rank == 0 and kv.choose(req(0), 0).rank == 1


def test_least_tokens_weighs_request_size():
    p = LeastTokens(ranks=[0, 1])
    assert p.choose(req(0, prompt=1000, out=1000), 0).rank == 0
    assert [p.choose(req(i, prompt=10, out=10), 0).rank for i in range(1, 6)] == [1] * 5


@pytest.mark.parametrize("cls", [LeastScore, LeastTokens])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_client_mode_two_api_servers_share_snapshots(cls, seed):
    rnd = random.Random(seed)
    ranks = list(range(4))
    apis = [cls(ranks=ranks, dispatcher_id=f"api-{i}", num_api_servers=2, client_mode=True)
            for i in range(2)]
    assert apis[0].scale == 2.0
    eng = Engines(ranks)
    for i in range(400):
        p = apis[rnd.randrange(2)]
        eng.send(p.choose(req(i), i * 0.001), req(i))
        if i % 29 == 28:
            eng.receive(rnd)
            snap = eng.snapshot()
            for q in apis:
                q.on_snapshot(snap)
    assert within(eng.counts(), ranks), eng.counts()


def test_seq_is_per_dispatcher_and_rank():
    p = RoundRobin(ranks=[0, 1, 2], dispatcher_id="api-3")
    got = [p.choose(req(i), 0) for i in range(7)]
    per_rank: dict[int, list[int]] = {}
    for a in got:
        assert a.dispatcher == "api-3"
        per_rank.setdefault(a.rank, []).append(a.seq)
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in per_rank.values())
    assert sorted(len(s) for s in per_rank.values()) == [2, 2, 3]


def test_snapshots_from_the_aggregator_drive_the_policy():
    """End to end in the pure core: engines report through StepAggregator, whose snapshot
    (with recv echoes) reconciles the policy's local view."""
    from shared.policy.aggregator import StepAggregator

    agg = StepAggregator(range(2), grace_s=0.05)
    p = LeastScore(ranks=[0, 1])
    a = [p.choose(req(i), 0.0) for i in range(4)]         # 2 per rank, seqs 1 and 2
    assert p.local_load(0) == p.local_load(1) == 2
    agg.report(RankStats(0, 0, 1, waiting=2, recv={"scheduler": 2}), 0.01)
    snap = agg.report(RankStats(1, 0, 1, waiting=1, recv={"scheduler": 1}), 0.01)
    p.on_snapshot(snap)
    assert p.local_load(0) == 0 and p.local_load(1) == 1
    assert p.scores() == {0: 8.0, 1: 8.0} and {x.rank for x in a} == {0, 1}


def test_unseen_sends_drop_exactly_what_the_engine_echoed():
    from shared.policy.unseen import UnseenSends
    u = UnseenSends()
    assert [u.send(a, b, t) for a, b, t in ((10, 1, 0.0), (20, 2, 1.0), (30, 3, 2.0))] == [1, 2, 3]
    assert u.reconcile(1) == (1, 0) and (u.amount, u.blocks, len(u)) == (50, 5, 2)
    assert u.reconcile(1, sent_before=1.5) == (0, 1) and (u.amount, u.blocks) == (30, 3)
    u.clear()
    assert (u.amount, len(u)) == (0, 0) and u.send(5) == 4    # the seq keeps counting
