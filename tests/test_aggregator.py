"""StepAggregator: per-rank ordering, grace, joins, deaths, min-interval coalescing.

The property tests replay random deliveries (interleavings, delays, duplicates, lost
reports, wave resets) against a reference model of the rules in DESIGN §5."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from shared.policy.aggregator import StepAggregator
from shared.stats import RankStats, Snapshot


def rs(rank: int, wave: int, step: int, **kw) -> RankStats:
    return RankStats(rank=rank, wave=wave, step=step, **kw)


def feed_step(agg: StepAggregator, ranks, wave: int, step: int, now: float) -> list[Snapshot]:
    out = []
    for r in ranks:
        s = agg.report(rs(r, wave, step, waiting=r), now)
        if s is not None:
            out.append(s)
    return out


# ------------------------------------------------------------------ unit tests

def test_finalizes_when_every_rank_reported():
    agg = StepAggregator(range(4), grace_s=0.05)
    assert agg.report(rs(0, 0, 1), 0.0) is None
    assert agg.report(rs(2, 0, 1), 0.001) is None
    assert agg.report(rs(1, 0, 1), 0.002) is None
    snap = agg.report(rs(3, 0, 1), 0.003)
    assert snap is not None and snap.key == (0, 1) and snap.seq == 1
    assert sorted(snap.ranks) == [0, 1, 2, 3] and snap.carried == ()
    assert agg.next_deadline() is None
    assert agg.finalized == agg.published == 1 and agg.carried_total == 0


def test_grace_carries_missing_ranks_from_their_last_report():
    agg = StepAggregator(range(3), grace_s=0.05)
    feed_step(agg, range(3), 0, 1, 0.0)
    agg.report(rs(0, 0, 2, waiting=7), 0.10)
    agg.report(rs(1, 0, 2), 0.11)
    assert agg.next_deadline() == 0.10 + 0.05
    assert agg.tick(0.14) is None
    snap = agg.tick(agg.next_deadline())
    assert snap is not None and snap.key == (0, 2) and snap.carried == (2,)
    assert snap.ranks[2].step == 1 and snap.ranks[0].waiting == 7
    assert agg.grace_expired == 1 and agg.carried_total == 1


def test_slow_rank_late_report_is_valid_not_out_of_order():
    """vLLM #52936: a slower engine's report for a step already finalized is valid data."""
    agg = StepAggregator(range(2), grace_s=0.05)
    feed_step(agg, range(2), 0, 1, 0.0)
    agg.report(rs(0, 0, 2), 0.1)
    assert agg.tick(0.2).carried == (1,)
    # rank 1's step-2 report arrives after step 2 was finalized: in order for rank 1
    assert agg.report(rs(1, 0, 2, waiting=9), 0.21) is None
    assert agg.stale_dropped == 0 and agg.late == 1
    agg.report(rs(0, 0, 3), 0.3)
    snap = agg.tick(0.4)
    assert snap.key == (0, 3) and snap.carried == (1,) and snap.ranks[1].waiting == 9


def test_stale_and_duplicate_are_judged_per_rank():
    agg = StepAggregator(range(2), grace_s=1.0)
    agg.report(rs(0, 0, 5), 0.0)
    agg.report(rs(1, 0, 3), 0.0)        # rank 1 is behind rank 0: fine, its own order
    agg.report(rs(1, 0, 3), 0.0)        # duplicate
    agg.report(rs(0, 0, 4), 0.0)        # older than rank 0's own last: stale
    assert agg.duplicates == 1 and agg.stale_dropped == 1 and agg.accepted == 2


def test_newer_complete_step_supersedes_older_pending():
    agg = StepAggregator(range(2), grace_s=1.0)
    agg.report(rs(0, 0, 1), 0.0)        # rank 1's step-1 report is lost
    assert agg.report(rs(0, 0, 2), 0.01) is None
    snap = agg.report(rs(1, 0, 2), 0.02)
    assert snap.key == (0, 2) and snap.carried == () and agg.superseded == 1


def test_rank_that_moved_past_a_step_is_not_waited_for():
    agg = StepAggregator(range(2), grace_s=1.0)
    agg.report(rs(1, 0, 2), 0.0)        # rank 1 lost its step-1 report
    snap = agg.report(rs(0, 0, 1), 0.01)
    assert snap is not None and snap.key == (0, 1) and agg.grace_expired == 0
    assert snap.ranks.keys() == {0}      # rank 1 has nothing at or before step 1


def test_rank_skipping_a_step_completes_the_pending_one():
    agg = StepAggregator(range(2), grace_s=1.0)
    assert agg.report(rs(0, 0, 1), 0.0) is None
    snap = agg.report(rs(1, 0, 2), 0.01)             # rank 1's step-1 report was lost
    assert snap is not None and snap.key == (0, 1) and snap.carried == ()
    assert snap.ranks.keys() == {0} and agg.grace_expired == 0


def test_waves_reset_step_counters():
    agg = StepAggregator(range(2), grace_s=0.05)
    assert feed_step(agg, range(2), 0, 40, 0.0)[0].key == (0, 40)
    snap = feed_step(agg, range(2), 1, 0, 1.0)[0]
    assert snap.key == (1, 0) and snap.seq == 2 and agg.stale_dropped == 0
    feed_step(agg, range(2), 0, 41, 1.1)           # a straggler from the old wave
    assert agg.stale_dropped == 2 and agg.published == 2


def test_joining_rank_does_not_block_finalization():
    agg = StepAggregator(range(2), grace_s=10.0)
    feed_step(agg, range(2), 0, 1, 0.0)
    agg.set_live([0, 1, 2])                         # rank 2 joins and never reports
    snaps = feed_step(agg, range(2), 0, 2, 0.1)
    assert [s.key for s in snaps] == [(0, 2)] and agg.grace_expired == 0
    # once it has reported it is waited for like everyone else
    assert agg.report(rs(2, 0, 3), 0.2) is None
    assert feed_step(agg, range(2), 0, 3, 0.2)[0].ranks.keys() == {0, 1, 2}
    assert feed_step(agg, range(2), 0, 4, 0.3) == []
    assert agg.report(rs(2, 0, 4), 0.3).key == (0, 4)


def test_dead_rank_is_removed_and_unblocks_pending_step():
    agg = StepAggregator(range(3), grace_s=10.0)
    feed_step(agg, range(3), 0, 1, 0.0)
    feed_step(agg, range(2), 0, 2, 0.1)             # rank 2 died before step 2
    agg.set_live([0, 1])
    assert agg.next_deadline() <= 0.1
    snap = agg.tick(0.11)
    assert snap.key == (0, 2) and snap.ranks.keys() == {0, 1} and snap.carried == ()
    assert agg.report(rs(2, 0, 3), 0.2) is None and agg.not_live == 1


def test_min_interval_coalesces_to_newest():
    agg = StepAggregator(range(2), grace_s=1.0, min_interval_s=0.1)
    assert feed_step(agg, range(2), 0, 1, 0.00)[0].seq == 1
    assert feed_step(agg, range(2), 0, 2, 0.03) == []
    assert feed_step(agg, range(2), 0, 3, 0.06) == []
    assert agg.next_deadline() == 0.1 and agg.coalesced == 1
    assert agg.tick(0.09) is None
    snap = agg.tick(0.1)
    assert snap.key == (0, 3) and snap.seq == 2
    assert agg.finalized == 3 and agg.published == 2 and agg.next_deadline() is None


def test_never_publishes_an_older_or_equal_step():
    agg = StepAggregator(range(2), grace_s=0.05)
    feed_step(agg, range(2), 0, 5, 0.0)
    assert feed_step(agg, [0, 1], 0, 5, 0.01) == []          # duplicates
    assert agg.report(rs(0, 0, 6), 0.02) is None
    assert agg.report(rs(1, 0, 4), 0.03) is None             # stale
    assert agg.tick(0.2).key == (0, 6)


# ------------------------------------------------------------------ property tests

@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 5))
    grace = draw(st.sampled_from([0.01, 0.05, 0.2]))
    keys, wave, step = [], 0, 0
    for _ in range(draw(st.integers(1, 14))):
        if draw(st.integers(0, 5)) == 0:
            wave, step = wave + 1, 0                           # pause: the wave resets steps
        else:
            step += draw(st.integers(1, 2))
        keys.append((wave, step))
    events = []  # (time, tiebreak, rank, key)
    for i, k in enumerate(keys):
        for r in range(n):
            if draw(st.integers(0, 7)) == 0:
                continue                                     # lost report
            copies = 2 if draw(st.integers(0, 9)) == 0 else 1
            for _ in range(copies):
                delay = draw(st.sampled_from([0.0, 0.001, 0.004, 0.02, 0.09, 0.3]))
                events.append((i * 0.03 + delay, len(events), r, k))
    events.sort()
    return n, grace, events


def replay(n: int, grace: float, events):
    """Drive the aggregator like a service would (ticks at next_deadline) and check every
    published snapshot against a reference model of the rules."""
    agg = StepAggregator(range(n), grace_s=grace)
    newest: dict[int, tuple] = {}                 # reference per-rank newest accepted key
    accepted: dict[int, list[RankStats]] = {r: [] for r in range(n)}
    first_seen: dict[tuple, float] = {}
    stale = dups = 0
    published: list[tuple[float, Snapshot]] = []

    def check(snap: Snapshot | None, now: float):
        if snap is None:
            return
        if published:
            assert snap.key > published[-1][1].key, "published step went backwards"
            assert snap.seq == published[-1][1].seq + 1
        published.append((now, snap))
        k = snap.key
        for r in range(n):
            older = [s for s in accepted[r] if (s.wave, s.step) <= k]
            if not older:
                assert r not in snap.ranks
                continue
            # every live rank's newest data at or before the step is in the snapshot
            assert snap.ranks[r] is older[-1], (r, k)
            assert (r in snap.carried) == ((older[-1].wave, older[-1].step) != k)
        if now < first_seen[k] + grace:
            # finalized before the grace period: no live rank skipped unless it moved past
            for r in range(n):
                if r in snap.carried or r not in snap.ranks:
                    assert newest.get(r, (-1, -1)) > k, f"rank {r} skipped before grace at {k}"

    for t, _, r, k in events:
        d = agg.next_deadline()
        while d is not None and d <= t:
            check(agg.tick(d), d)
            d = agg.next_deadline()
        stats = RankStats(rank=r, wave=k[0], step=k[1])
        prev = newest.get(r)
        if prev is not None and k < prev:
            stale += 1
        elif prev is not None and k == prev:
            dups += 1
        else:
            newest[r] = k
            accepted[r].append(stats)
            first_seen.setdefault(k, t)
        check(agg.report(stats, t), t)
        # per-rank ordering: a rank's in-order report is never dropped
        assert agg.last_key(r) == newest[r]
        # promptness: once every rank reported a step or moved past it, it is final
        if len(newest) == n:
            floor = min(newest.values())
            done = [k for k in first_seen if k <= floor]
            if done:
                assert agg.final_key is not None and agg.final_key >= max(done)
    # drain: every step that got a report is final within its grace period
    d = agg.next_deadline()
    while d is not None:
        check(agg.tick(d), d)
        d = agg.next_deadline()
    assert agg.stale_dropped == stale and agg.duplicates == dups
    if first_seen:
        assert agg.final_key == max(first_seen)
        assert published and published[-1][1].key == max(first_seen)
    assert agg.pending_steps() == 0
    for now, snap in published:
        assert now <= first_seen[snap.key] + grace + 1e-12
    return agg, published


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_property_random_deliveries(sc):
    replay(*sc)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 20), st.randoms(use_true_random=False))
def test_property_in_order_within_grace_publishes_every_step_whole(n, steps, rnd):
    """No losses, per-rank order kept, every report inside the grace: each step is
    published once, with every rank's own report and nothing carried."""
    events = []
    for s in range(1, steps + 1):
        for r in range(n):
            events.append((s * 1.0 + rnd.random() * 0.04, len(events), r, (0, s)))
    events.sort()
    agg, published = replay(n, 0.05, events)
    assert [snap.key for _, snap in published] == [(0, s) for s in range(1, steps + 1)]
    assert all(snap.carried == () and len(snap.ranks) == n for _, snap in published)
    assert agg.grace_expired == 0 and agg.superseded == 0


def test_bounded_pending_steps_under_a_silent_rank():
    agg = StepAggregator(range(3), grace_s=0.05)
    feed_step(agg, range(3), 0, 0, 0.0)
    for s in range(1, 200):
        t = s * 0.02
        d = agg.next_deadline()
        while d is not None and d <= t:
            agg.tick(d)
            d = agg.next_deadline()
        feed_step(agg, [0, 1], 0, s, t)            # rank 2 is silent (dead, not yet removed)
        assert agg.pending_steps() <= 4
    assert agg.stale_dropped == 0 and agg.carried_total == agg.finalized - 1
    assert agg.grace_expired == agg.finalized - 1


def test_cold_start_set_live_waits_for_every_rank():
    agg = StepAggregator([], grace_s=1.0)
    agg.set_live([0, 1])                     # joining an empty cluster: waited for from the start
    assert agg.report(rs(0, 0, 1), 0.0) is None
    assert agg.report(rs(1, 0, 1), 0.0).ranks.keys() == {0, 1}


def test_a_group_of_new_incarnations_begins_the_sequence_again():
    # Every rank's process replaced and their counters back at the start: without
    # `restarted` each report was older than that rank's last one, dropped, and the view froze.
    agg = StepAggregator(range(2), grace_s=0.05)
    assert feed_step(agg, range(2), 3, 10, 0.0)[0].key == (3, 10)
    agg.restarted(0)
    snap = agg.report(rs(1, 3, 11), 0.01)                  # rank 0 is not waited for until it reports
    assert snap.key == (3, 11) and list(snap.ranks) == [1]  # (nor shown: its old process's load is gone)
    assert agg.report(rs(0, 0, 1), 0.03) is None            # one new rank, one old: (0, 1) is late, not a step
    assert agg.final_key == (3, 11) and agg.restarts == 0
    agg.restarted(1)                                        # now every live rank is new
    assert agg.restarts == 1 and agg.final_key is None
    snaps = feed_step(agg, range(2), 0, 2, 0.04)            # rank 1 is waited for from its first report on
    assert [s.key for s in snaps] == [(0, 2)]
    snaps = feed_step(agg, range(2), 0, 3, 0.05)
    assert [s.key for s in snaps] == [(0, 3)] and sorted(snaps[0].ranks) == [0, 1]
    agg.restarted(7)                                        # not a live rank: nothing changes
    assert agg.final_key == (0, 3)


def test_a_group_back_from_the_dead_begins_the_sequence_again():
    # Every rank's heartbeat lapsed (the scheduler saw them dead) before new processes took
    # the slots: they come back through set_live, not restarted().
    agg = StepAggregator(range(2), grace_s=0.05)
    assert feed_step(agg, range(2), 3, 10, 0.0)[0].key == (3, 10)
    agg.set_live([1])
    agg.set_live([0, 1])                      # one rank back: the other's sequence goes on
    assert agg.restarts == 0 and agg.final_key == (3, 10)
    agg.set_live([])
    agg.set_live([0, 1])
    assert agg.restarts == 1 and agg.final_key is None
    assert [s.key for s in feed_step(agg, range(2), 0, 1, 0.1)] == [(0, 1)]


def test_counters_are_plain_ints():
    agg = StepAggregator(range(2))
    feed_step(agg, range(2), 0, 1, 0.0)
    c = agg.counters()
    assert c["published"] == c["finalized"] == 1 and all(type(v) is int for v in c.values())
