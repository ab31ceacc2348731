"""The default policy's pure parts: waterfill placement (late binding of prefill work), the
coordinated prefill budget, and undoing an admission the budget capped to nothing."""

import pytest

from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.sequence import Sequence
from services.engine_worker.step_budget import BudgetConfig, balanced_budget, trim_plan
from shared.messages import SamplingParams
from shared.policy.base import RequestInfo
from shared.policy.registry import make_policy
from shared.policy.staggered import BatcherFull
from shared.stats import RankStats, Snapshot


def _snap(pending, seq=1, recv=None, running=None):
    ranks = {r: RankStats(r, 0, seq, prefill_pending=p, recv=dict(recv or {}),
                          running=(running or [0] * len(pending))[r]) for r, p in enumerate(pending)}
    return Snapshot(0, seq, 0.0, ranks, seq=seq)


def _req(i, prompt=1000, t=0.0):
    return RequestInfo(str(i), prompt, 4096, t)


def _placing_at_once(**kw):
    """waterfill without its collection window, for the tests of where a request goes
    (the window has its own tests below)."""
    return make_policy("waterfill", collect_s=0.0, **kw)


def test_places_at_once_with_headroom_on_the_least_pending_rank():
    p = _placing_at_once(ranks=[0, 1, 2], level_tokens=4096)
    p.on_snapshot(_snap([3000, 100, 2000]))
    out = p.submit(_req(1), 0.0)
    assert [a.rank for a in out] == [1]
    out = p.submit(_req(2, prompt=500), 0.0)       # rank 1 now 1100 by its own send
    assert [a.rank for a in out] == [1]
    out = p.submit(_req(3, prompt=5000), 0.0)
    assert [a.rank for a in out] == [1]             # 1600 is still the least
    assert p.unplaced == 0


def test_keeps_requests_unplaced_while_every_rank_is_above_the_level_and_releases_fcfs_as_ranks_drain():
    p = make_policy("waterfill", ranks=[0, 1], level_tokens=4096, max_hold_s=10.0)
    p.on_snapshot(_snap([5000, 6000]))
    assert p.submit(_req(1), 0.0) == [] and p.submit(_req(2), 0.1) == []
    assert p.unplaced == 2
    assert p.poll(0.2) == []                         # nothing drained yet
    p.on_snapshot(_snap([5000, 1000], seq=2))
    out = p.poll(0.3)
    # rank 1 drained: it takes the oldest first, until it is above the level again
    assert [(a.request_id, a.rank) for a in out] == [("1", 1), ("2", 1)]


def test_equal_pending_prefill_goes_to_the_rank_with_fewer_sequences():
    p = _placing_at_once(ranks=[0, 1, 2], level_tokens=4096)
    p.on_snapshot(_snap([0, 0, 0], running=[9, 3, 6]))
    assert [a.rank for a in p.submit(_req(1, prompt=100), 0.0)] == [1]
    p.on_snapshot(_snap([500, 0, 0], seq=2, running=[0, 9, 6], recv={"scheduler": 1}))
    assert [a.rank for a in p.submit(_req(2, prompt=100), 0.0)] == [2]   # least pending first, then fewest


def test_a_rank_whose_slots_are_full_takes_nothing_until_one_frees():
    # a full rank queues one request (QUEUE_ROOM), then takes nothing
    p = _placing_at_once(ranks=[0, 1, 2], level_tokens=4096, max_hold_s=10.0, max_seqs={0: 4, 1: 4, 2: 8})
    p.on_snapshot(_snap([0, 3000, 3500], running=[5, 4, 8]))   # rank 0 has the least prefill, but no room
    assert [a.rank for a in p.submit(_req(1, prompt=100), 0.0)] == [1]    # rank 1's queue room
    assert [a.rank for a in p.submit(_req(2, prompt=100), 0.0)] == [2]    # then rank 2's
    assert p.submit(_req(3, prompt=100), 0.0) == [] and p.unplaced == 1  # every slot and queue taken
    p.on_snapshot(_snap([0, 3100, 3600], seq=2, running=[4, 5, 9], recv={"scheduler": 1}))
    assert [a.rank for a in p.poll(0.1)] == [0]      # a request on rank 0 finished: room frees
    # without slot limits the least pending rank takes everything at once
    q = _placing_at_once(ranks=[0, 1, 2], level_tokens=4096)
    q.on_snapshot(_snap([0, 3000, 3500], running=[5, 4, 8]))
    assert [a.rank for a in q.submit(_req(1, prompt=100), 0.0)] == [0]


def test_a_rank_out_of_kv_takes_nothing_until_a_report_says_it_can_start_its_queue():
    """A group out of KV before its slots: requests stay here, where the queue's ETA (and so
    the api-servers' 429s) sees them, and go to the first rank that frees room."""
    def snap(blocked, seq):
        s = _snap([50, 10], seq=seq, running=[7, 7], recv={"scheduler": seq - 1})
        for r, b in enumerate(blocked):
            s.ranks[r].kv_blocked, s.ranks[r].waiting = b, int(b)
            s.ranks[r].kv_used = s.ranks[r].kv_total = 32          # full, as a KV-bound rank's is
        return s
    p = _placing_at_once(ranks=[0, 1], level_tokens=4096, max_hold_s=10.0, max_seqs=256)
    p.on_snapshot(snap([False, True], 1))          # rank 1 has the least prefill, but no KV
    assert [a.rank for a in p.submit(_req(1, prompt=10), 0.0)] == [0]
    p.on_snapshot(snap([True, True], 2))
    assert p.submit(_req(2, prompt=10), 0.1) == [] and p.submit(_req(3, prompt=10), 0.2) == []
    assert p.unplaced == 2 and p.poll(5.0) == []  # a fresh view is trusted: held, not piled on a rank
    p.on_snapshot(snap([True, False], 3))
    # rank 1 started its queue: it takes what its KV held when it ran out (7 running) and one queued
    assert [(a.request_id, a.rank) for a in p.poll(5.1)] == [("2", 1)]
    assert p.unplaced == 1
    # its KV clear again (usage low, nobody waiting): the learned limit is forgotten
    s = snap([True, False], 4)
    s.ranks[1].kv_used, s.ranks[1].kv_total, s.ranks[1].running = 1, 32, 2
    p.on_snapshot(s)
    assert [(a.request_id, a.rank) for a in p.poll(5.2)] == [("3", 1)]


def test_a_rank_whose_slots_are_all_taken_still_queues_one_so_a_full_group_admits_together():
    """The queued request starts the step a slot frees, and the queued prompts are the
    backlog the step budget sees (waterfill.QUEUE_ROOM)."""
    p = _placing_at_once(ranks=[0, 1], level_tokens=100_000, max_hold_s=10.0, max_seqs=64)
    p.on_snapshot(_snap([0, 0], running=[64, 64]))       # every slot taken
    placed = [a.rank for k in range(4) for a in p.submit(_req(k, prompt=100), 0.0)]
    assert sorted(placed) == [0, 1] and p.unplaced == 2   # one queued on each, the rest kept here


def test_requests_arriving_together_wait_collect_s_then_go_longest_first_for_balance():
    """An offline batch or a burst reaches the scheduler one request at a time, microseconds
    apart. Placed in arrival order, each goes to the least loaded rank of the moment (1k, 1k,
    then 2k: 3k on one rank against 1k); collected for collect_s and placed longest first,
    the ranks even out."""
    p = make_policy("waterfill", ranks=[0, 1], level_tokens=100_000, collect_s=0.002, max_seqs=64)
    p.on_snapshot(_snap([0, 0]))
    assert p.submit(_req(1, prompt=1000), 1.0) == []
    assert p.submit(_req(2, prompt=1000), 1.0001) == []
    assert p.submit(_req(3, prompt=2000), 1.0002) == []
    assert p.next_deadline() == pytest.approx(1.002)      # the oldest has waited collect_s
    assert p.poll(1.0019) == []
    out = p.poll(p.next_deadline())
    assert [a.request_id for a in out] == ["3", "1", "2"]
    load = {0: 0, 1: 0}
    for a in out:
        load[a.rank] += {"1": 1000, "2": 1000, "3": 2000}[a.request_id]
    assert load == {0: 2000, 1: 2000}
    assert p.unplaced == 0 and p.stats()["hold_ms_mean"] <= 2.0 + 1e-6


def test_longest_first_only_while_every_request_together_fits_in_a_free_slot():
    """With more requests than free sequence slots, reordering changes which requests are
    served first, not only how they spread (offline at 1.5x: efficiency 0.940 against 0.965
    in arrival order), so they go in arrival order."""
    p = make_policy("waterfill", ranks=[0, 1], level_tokens=100_000, max_seqs=2)
    p.on_snapshot(_snap([0, 0], running=[1, 1]))        # one free slot on each rank
    for k, prompt in enumerate((1000, 1000, 2000)):
        assert p.submit(_req(k, prompt=prompt), 0.0) == []
    assert [a.request_id for a in p.poll(0.002)] == ["0", "1", "2"]


def test_only_requests_that_arrived_together_are_reordered():
    p = make_policy("waterfill", ranks=[0, 1], level_tokens=4096, max_hold_s=10.0, max_seqs=64,
                    together_s=0.05)
    p.on_snapshot(_snap([5000, 6000]))                  # every rank above the level: all wait
    for k, (prompt, t) in enumerate(((100, 0.0), (3000, 0.1), (100, 0.2), (3000, 0.21)), start=1):
        assert p.submit(_req(k, prompt=prompt), t) == []
    assert p.unplaced_tokens == 6200                    # the queue's ETA counts prompt tokens
    p.on_snapshot(_snap([0, 0], seq=2))
    # 1 and 2 arrived 100 ms apart: arrival order; 3 and 4 10 ms apart: the longer first
    assert [a.request_id for a in p.poll(0.5)] == ["1", "2", "4", "3"]
    assert p.unplaced_tokens == 0


def test_longest_first_keeps_every_entry_it_does_not_place_even_with_a_repeated_id():
    p = make_policy("waterfill", ranks=[0], level_tokens=1000, max_seqs=64)
    p.on_snapshot(_snap([0]))
    for prompt in (500, 2000, 300):            # the same id twice (a redelivered request)
        p.submit(RequestInfo("x" if prompt != 300 else "y", prompt, 4096, 0.0), 0.0)
    out = p.poll(0.002)
    assert [a.request_id for a in out] == ["x"] and p.unplaced == 2   # 2000 placed: the rank is full


def test_the_simulated_default_places_with_the_schedulers_settings():
    from services.simulator.baselines import _default_spec
    from shared.settings import SchedulerSettings
    pol = _default_spec().factory(dispatcher_id="s", client_index=0, num_api_servers=1, client_mode=False,
                                  ranks=[0, 1], block_size=16)
    s = SchedulerSettings()
    assert (pol.collect_s, pol.together_s) == (s.collect_ms / 1000, s.together_ms / 1000) != (0, 0)


def test_an_unplaced_request_is_released_by_the_bound_even_if_the_view_never_changes():
    p = make_policy("waterfill", ranks=[0, 1], level_tokens=100, max_hold_s=2.0)
    p.on_snapshot(_snap([5000, 6000]))
    assert p.submit(_req(1), 0.0) == []
    assert p.next_deadline() == pytest.approx(2.0)
    assert p.poll(1.9) == []
    out = p.poll(2.0)
    assert [a.rank for a in out] == [0] and p.stats()["released_by_bound"] == 1


def test_a_fresh_view_keeps_a_request_unplaced_past_the_bound_and_a_stale_one_releases_it():
    """Every rank full by a view that keeps coming: sending the request would only queue it
    behind one rank's batch, so it waits however long; when the snapshots stop, the bound
    releases it max_hold_s after the last one."""
    p = make_policy("waterfill", ranks=[0, 1], level_tokens=4096, max_hold_s=2.0, max_seqs=2)
    p.on_snapshot(_snap([0, 0], running=[3, 3]))          # 2 slots + 1 queued each: full
    assert p.submit(_req(1), 0.0) == []
    for k, t in enumerate((1.0, 2.0, 3.0, 4.0), start=2):   # a snapshot a second, still full
        p.on_snapshot(_snap([0, 0], seq=k, running=[3, 3]))
        assert p.poll(t) == [], t
    assert p.next_deadline() == pytest.approx(6.0)        # two seconds after the last view
    assert p.poll(5.9) == []
    assert [a.rank for a in p.poll(6.0)] == [0] and p.stats()["released_by_bound"] == 1


def test_polling_at_next_deadline_always_releases():
    """Regression: poll(next_deadline()) must release the unplaced request. With the bound
    computed as now - t0 >= max_hold_s, float rounding ((t0 + 5) - t0 < 5) kept it unplaced
    and the caller polled again at the same instant forever (a simulator hang)."""
    for t0 in (60.398252889171125, 11.55581805922733, 6.2964790047645325, 0.1):
        p = make_policy("waterfill", ranks=[0, 1], level_tokens=1, max_hold_s=5.0)
        p.on_snapshot(_snap([5000, 6000]))
        assert p.submit(_req(1), t0) == []
        d = p.next_deadline()
        assert [a.request_id for a in p.poll(d)] == ["1"], t0


def test_drop_and_bounded_queue():
    p = make_policy("waterfill", ranks=[0], level_tokens=1, max_unplaced=2)
    p.on_snapshot(_snap([10]))
    p.submit(_req(1), 0.0)
    p.submit(_req(2), 0.0)
    with pytest.raises(BatcherFull):
        p.submit(_req(3), 0.0)
    assert p.drop("1") and not p.drop("1")
    assert p.unplaced == 1 and p.unplaced_tokens == 1000


def test_client_mode_places_immediately():
    p = make_policy("waterfill", ranks=[0, 1], num_api_servers=4, client_mode=True)
    p.on_snapshot(_snap([9000, 8000]))
    assert p.choose(_req(1), 0.0).rank == 1


def test_balanced_budget_takes_the_largest_level_most_ranks_can_fill():
    # four ranks could each compute 2048; one can only 100: T = 2048 keeps 4*2048+100 / 5*2048 = 0.81
    assert balanced_budget([10, 10, 10, 10, 10], [2048, 2048, 2048, 2048, 100], 0.8, 2048) == 2048
    assert balanced_budget([10, 10, 10, 10, 10], [2048, 2048, 2048, 2048, 100], 0.9, 2048) == 100
    # only one rank has prefill: no budget above the decodes keeps the step balanced
    assert balanced_budget([50, 50, 50, 50], [2048, 50, 50, 50], 0.9, 2048) == 50
    # nobody has prefill: the largest decode
    assert balanced_budget([7, 3], [7, 3], 0.9, 2048) == 7


def test_budget_config_rejects_bad_balance():
    with pytest.raises(ValueError):
        BudgetConfig(min_balance=1.0)


def test_a_trimmed_away_admission_gives_its_kv_back():
    core = EngineScheduler(BlockManager(64, 16), 256, 8, 1024)
    a = Sequence("a", list(range(200)), SamplingParams(max_tokens=10))
    b = Sequence("b", list(range(300)), SamplingParams(max_tokens=10))
    core.add(a)
    core.add(b)
    plan = core.schedule()
    assert [q.id for q in plan.admitted] == ["a", "b"] and core.bm.num_used_blocks == 13 + 19
    trim_plan(plan, 200)                            # b's chunk is cut away entirely
    assert plan.dropped == ["b"]
    core.unadmit([q for q in plan.admitted if q.id in plan.dropped])
    assert core.bm.num_used_blocks == 13            # b holds no KV while it waits
    assert [q.id for q in core.waiting] == ["b"] and [q.id for q in core.running] == ["a"]
    core.postprocess(plan, {"a": 5}, 0.0)
    plan = core.schedule()                          # b is admitted again, from the front
    assert [q.id for q in plan.admitted] == ["b"]


def _rank(r, prompts, cfg):
    from services.engine_worker.batch_gate import BatchGate
    from services.engine_worker.rank_step import RankStep
    core = EngineScheduler(BlockManager(4096, 16), 2048, 128, 8192)
    rs = RankStep(r, core, BatchGate(rank=r), cfg)
    for k, n in enumerate(prompts):
        q = Sequence(f"{r}-{k}", list(range(n)), SamplingParams(max_tokens=16))
        core.add(q)
        rs.arrived(q, 0.0)
    return rs


def _step(ranks, now):
    from services.engine_worker.rank_step import group_view
    plans, rows = zip(*(rs.plan(now) for rs in ranks))
    view = group_view(list(rows))
    for rs, p in zip(ranks, plans):
        rs.decide(p, view, now)
    return [p.num_tokens for p in plans]


COORD = BudgetConfig(max_tokens=2048, min_balance=0.9, max_capped_steps=3, max_delay_ms=3000.0, step_ms=0.0)


def test_coordinated_prefill_runs_at_once_when_no_other_rank_has_prefill_pending():
    ranks = [_rank(0, [1500], COORD), _rank(1, [], COORD)]
    assert _step(ranks, 0.0) == [1500, 0]


def test_coordinated_prefill_under_a_backlog_runs_balanced_steps():
    # both ranks have lots pending; rank 1's plan is small this step (one short prompt first)
    ranks = [_rank(0, [2048] * 4, COORD), _rank(1, [2048] * 4, COORD)]
    assert _step(ranks, 0.0) == [2048, 2048]          # both can fill the budget: full steps


def _decoding(rs):
    """``rs`` with one sequence decoding (a group where some rank decodes is not quiet: there
    a prefill step would hold every decode, tests/test_quiet_group.py)."""
    q = Sequence(f"{rs.rank}-decoding", list(range(4)), SamplingParams(max_tokens=1000))
    rs.core.add(q)
    rs.arrived(q, 0.0)
    rs.core.postprocess(rs.core.schedule(), {q.id: 7}, 0.0)
    return rs


def test_a_capped_prefill_runs_after_max_capped_steps():
    # rank 1 has prefill pending that it cannot start (its one slot decodes), so rank 0's big chunk is capped...
    full = _decoding(_rank(1, [], COORD))
    for k in range(3):
        q = Sequence(f"1-{k}", list(range(2048)), SamplingParams(max_tokens=16))
        full.core.add(q)
        full.arrived(q, 0.0)
    full.core.max_num_seqs = 1
    ranks = [_rank(0, [2048] * 3, COORD), full]
    got = [_step(ranks, 0.01 * k) for k in range(6)]
    # capped while rank 1 can only add a few tokens, then forced after max_capped_steps
    assert got[0][0] < 2048
    assert any(g[0] == 2048 for g in got[1:5])


def test_min_delay_lets_a_lone_prefill_wait_for_company_but_not_past_its_deadline():
    # nothing pending elsewhere: with align_min_delay_ms the prefill is paced over that
    # window (so prefills arriving meanwhile on other ranks share its steps) and done by it
    cfg = BudgetConfig(max_tokens=2048, min_balance=0.9, max_capped_steps=1000, max_delay_ms=3000.0,
                       min_delay_ms=200.0, step_ms=10.0)
    ranks = [_rank(0, [1500], cfg), _rank(1, [], cfg)]
    first = _step(ranks, 0.0)
    assert 0 < first[0] < 1500
    done, now = first[0], 0.0
    while done < 1500:
        now += 0.010
        done += _step(ranks, now)[0]
    assert now <= 0.200 + 0.010


IDLE = BudgetConfig(max_tokens=2048, min_balance=0.9, max_capped_steps=1000, max_delay_ms=3000.0,
                    min_delay_ms=200.0, step_ms=10.0, idle_wait_ms=30.0)


def _prefilled_by(ranks, now=0.0, tokens=1500):
    """When rank 0 has computed ``tokens`` of its prompt, stepping every 10 ms from ``now``."""
    done = 0
    while done < tokens and now < 5.0:                      # bounded: a deadline runs it in full
        done += _step(ranks, now)[0]
        now += 0.010
    return now - 0.010


def test_a_lone_prefill_in_an_idle_group_waits_only_idle_wait_ms():
    """With nothing decoding anywhere and nothing else pending, a lone prefill step delays no
    one, and company is unlikely (arrivals are sparse, or something would decode): a single
    request on an idle `lockstep up` (4 torch ranks on CPU) waited the whole 200 ms for
    company, TTFT 217 ms against 51 ms without coordinated prefill; now 56 ms."""
    ranks = [_rank(0, [1500], IDLE), _rank(1, [], IDLE)]
    assert _prefilled_by(ranks) <= 0.030 + 0.010


def test_a_lone_prefill_beside_decodes_still_waits_for_company():
    # rank 1 decodes: a lone prefill step on rank 0 would stall it, so the 200 ms wait holds
    ranks = [_rank(0, [], IDLE), _rank(1, [8], IDLE)]
    core = ranks[1].core
    core.postprocess(core.schedule(), {"1-0": 5}, 0.0)     # its prompt done: it decodes from now on
    _step(ranks, 0.0)                                       # every rank has seen a view with a decode
    q = Sequence("0-0", list(range(1500)), SamplingParams(max_tokens=16))
    ranks[0].core.add(q)
    ranks[0].arrived(q, 0.0)
    assert 0.030 + 0.010 < _prefilled_by(ranks) <= 0.200 + 0.010   # paced toward 200 ms, not 30


def _small_group(backlog_steps, prompts):
    cfg = BudgetConfig(max_tokens=2048, min_balance=0.9, max_capped_steps=1000, max_delay_ms=3000.0,
                       min_delay_ms=200.0, step_ms=10.0, backlog_steps=backlog_steps)
    return [_rank(r, p, cfg) for r, p in enumerate(prompts)]


def _lone_prompt_prefill(backlog_steps, beside=()):
    """(tokens of rank 0's 8k prompt computed, when the last step ran) within 2 s of 10 ms steps."""
    ranks = _small_group(backlog_steps, [[8000], list(beside), [], []])
    done, now = 0, 0.0
    while done < 8000 and now < 2.0:
        done += _step(ranks, now)[0]
        now += 0.010
    return done, now


def test_one_long_prompt_alone_is_no_backlog_its_deadline_holds():
    """A rank's pending prefill counts toward the group's backlog only up to one full step:
    an 8k prompt with nothing pending elsewhere was counted whole (8,000 of 4 x 2,048 tokens
    = a backlog), so its deadlines gave way to the balance rule and it crawled through the
    capped-steps bound (bursty at 0.3x: 16k prompts' first tokens at 2-5 s). A 1,000-token
    prompt on another rank keeps the group from being one rank alone (the rule below); it
    also stretches the 8k prompt's wait for company to 200 ms + 3 s x 1,000 / (0.5 x 4 x
    2,048) = 0.73 s at most (counted whole, it had barely started after 2 s)."""
    done, now = _lone_prompt_prefill(backlog_steps=0.5, beside=[1000])
    assert done >= 8000 and now <= 0.733 + 0.010, (done, now)


def test_one_rank_alone_is_no_backlog_even_in_a_small_group():
    """In a group of 4 a rank's one full step is a quarter of the group's, a busy group's
    whole backlog threshold (``busy_backlog_steps`` 0.25): a lone 8k prompt in an idle group
    turned its own deadlines off and crawled through the capped-steps bound (heavy-tail at
    4 ranks, 0.3x: TTFT p99 2.5 s against the peers' 0.84 s). A backlog needs prefill
    pending on two ranks at least: nobody else has any to share a step with."""
    done, now = _lone_prompt_prefill(backlog_steps=0.25)
    assert done >= 8000 and now <= 0.200 + 0.010, (done, now)      # done by its 200 ms deadline


def test_two_ranks_pending_are_still_a_backlog_in_a_small_group():
    # the guard above is about one rank alone: with two, the balance rule caps the prefill
    ranks = _small_group(0.25, [[8000], [8000], [], []])
    ranks[3] = _decoding(ranks[3])                    # someone decodes: the group is not quiet
    assert _step(ranks, 0.0)[:2] == [1, 1]            # half the group prefilling: capped to its decode floor


def test_the_scheduler_status_counts_the_requests_waterfill_keeps_unplaced():
    # `lockstep watch` reads policy_unplaced from the scheduler's status: under the default
    # policy it read only the placement counters, so it showed 0 however many waited.
    from services.scheduler.leadership import _agg_counters
    from services.scheduler.state import SchedulerState
    from shared.policy.aggregator import StepAggregator

    p = make_policy("waterfill", ranks=[0, 1], level_tokens=100)
    p.on_snapshot(_snap([5000, 6000]))
    assert p.submit(_req(1), 0.0) == [] and p.submit(_req(2), 0.0) == []
    counters = _agg_counters(SchedulerState(ranks=[0, 1], policy=p, agg=StepAggregator([0, 1])))
    assert counters["policy_unplaced"] == 2


HOLD = BudgetConfig(max_tokens=2048, min_balance=0.9, max_capped_steps=3, max_delay_ms=3000.0,
                    min_delay_ms=200.0, step_ms=0.0, idle_wait_ms=30.0, idle_hold_ms=5.0)


def _arrive(rs, n, now, k=0):
    q = Sequence(f"{rs.rank}-late{k}", list(range(n)), SamplingParams(max_tokens=16))
    rs.core.add(q)
    rs.arrived(q, now)


def test_requests_sent_together_to_an_idle_group_start_in_one_step():
    """Requests sent at once reach the ranks a millisecond or two apart. In an idle group the
    first to land ran at once, alone (a paced crumb of it, the step time still unknown), and
    the rest waited out that step: on deepseek-v3-gb200 offline every first token came 24 ms
    late. Now the group holds (no forward) for up to idle_hold_ms while no rank decodes, and
    the ranks start together; the hold's many rounds (the worker meets every 2 ms, the
    simulator on every arrival) are not capped steps, which would force rank 0 alone."""
    ranks = [_rank(0, [1500], HOLD)] + [_rank(r, [], HOLD) for r in (1, 2, 3)]
    for k in range(10):                                     # rank 0 alone: no forward
        assert _step(ranks, 0.0002 * k) == [0, 0, 0, 0]
    for r in (1, 2, 3):
        _arrive(ranks[r], 1500, 0.002)
    assert _step(ranks, 0.002) == [0, 0, 0, 0]              # they may still fill more of a step
    assert _step(ranks, 0.004) == [0, 0, 0, 0]
    assert _step(ranks, 0.0051) == [1500] * 4               # rank 0's hold is over: one balanced step


def test_the_hold_ends_once_every_rank_has_a_full_step():
    ranks = [_rank(r, [3000], HOLD) for r in range(4)]
    assert _step(ranks, 0.0) == [2048] * 4                  # nothing left to wait for


def test_a_lone_request_is_held_idle_hold_ms_then_runs_whole():
    # no step measured yet: pacing it over the 30 ms idle wait with a guessed step only
    # spent launches on crumbs; after the hold it runs in one step
    ranks = [_rank(0, [1500], HOLD)] + [_rank(r, [], HOLD) for r in (1, 2, 3)]
    assert _step(ranks, 0.004) == [0, 0, 0, 0]
    assert _step(ranks, 0.005) == [1500, 0, 0, 0]


def test_no_hold_while_a_rank_decodes():
    # a hold stalls every decode in the group: beside decodes a prefill is paced, never held
    ranks = [_rank(0, [], HOLD), _rank(1, [8], HOLD)]
    core = ranks[1].core
    core.postprocess(core.schedule(), {"1-0": 5}, 0.0)
    _step(ranks, 0.0)
    _arrive(ranks[0], 1500, 0.001)
    got = _step(ranks, 0.001)
    assert got[1] == 1 and got[0] > 0
