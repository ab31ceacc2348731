"""The measured full step (services/engine_worker/step_clock.py) and the waits of
coordinated prefill that follow it: a prefill waits the same number of full steps for
company on a fast engine and on a slow one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.rank_step import RankStep
from services.engine_worker.step_budget import BudgetConfig
from services.engine_worker.step_clock import StepClock


def _steps(clock: StepClock, fixed: float, per_token: float, sizes: list[int]) -> None:
    for x in sizes:
        clock.observe(x, fixed + per_token * x)


def test_a_line_through_steps_of_different_sizes_gives_the_full_steps_duration():
    c = StepClock(max_tokens=2048)
    _steps(c, 8.0, 0.06, [5, 40, 600, 12, 2048, 300, 7, 1500] * 10)
    assert c.full_step_ms == pytest.approx(8.0 + 0.06 * 2048, rel=1e-6)   # 130.9 ms
    slow = StepClock(max_tokens=4608)
    _steps(slow, 19.9, 0.1097, [30, 512, 4608, 900, 60, 2500] * 10)
    assert slow.full_step_ms == pytest.approx(19.9 + 0.1097 * 4608, rel=1e-6)   # ~525 ms
    assert (c.token_ms, slow.token_ms) == (pytest.approx(0.06), pytest.approx(0.1097))


def test_steps_of_one_size_give_no_estimate_and_keep_the_last_one():
    c = StepClock(max_tokens=2048, halflife_steps=50)
    _steps(c, 8.0, 0.06, [20] * 50)           # decodes only: no line through one point
    assert c.full_step_ms == 0.0
    _steps(c, 8.0, 0.06, [20, 2048] * 20)
    fitted = c.full_step_ms
    assert fitted == pytest.approx(130.9, rel=0.01)
    # A long run of decodes whose durations jitter (9 / 12 ms at 19 / 21 tokens: 1.5 ms a
    # token between two neighbours): once the spread of sizes has decayed, a line through
    # them alone would say a full step takes ~3 s; the last good fit stands instead.
    for k in range(2000):
        c.observe(19 + 2 * (k % 2), 9.0 + 3.0 * (k % 2))
    assert c.full_step_ms == pytest.approx(fitted, rel=0.02)
    c.observe(0, 8.0)                         # an idle step and a bad duration teach nothing
    c.observe(100, 0.0)
    assert c.full_step_ms == pytest.approx(fitted, rel=0.01)


def test_a_newer_engine_speed_replaces_the_old_one():
    c = StepClock(max_tokens=2048, halflife_steps=50)
    _steps(c, 8.0, 0.06, [20, 2048] * 100)
    _steps(c, 16.0, 0.12, [20, 2048] * 500)   # the same engine, twice as slow (e.g. a hotter device)
    assert c.full_step_ms == pytest.approx(16.0 + 0.12 * 2048, rel=0.02)


# --- a step that is partly the group's: ranks that share a device, experts that see every token

def _shared_device_steps(clock: StepClock, reps: int = 10) -> None:
    """4 torch ranks on 2 CPU cores, as measured live: 20 ms + 0.02 ms per token of the
    busiest rank + 0.275 ms per token of the ranks' mean. A 2,048-token prefill alone takes
    ~200 ms, on every rank at once ~620 ms (the capacity probe), a small decode ~25 ms."""
    for _ in range(reps):
        for x, m in SHARED_STEPS:
            clock.observe(x, _shared_cost(x, m), m)


SHARED_STEPS = ((20, 10.0), (2048, 512.0), (2048, 2048.0), (600, 150.0))   # (busiest, mean tokens)


def _shared_cost(x: int, m: float) -> float:
    return 20.0 + 0.02 * x + 0.275 * m


def test_the_part_of_a_step_that_follows_the_groups_total_is_told_apart():
    c = StepClock(max_tokens=2048)
    _shared_device_steps(c)
    assert c.token_ms == pytest.approx(0.02, rel=1e-6)
    assert c.shared_ms == pytest.approx(0.275, rel=1e-6)
    assert c.full_step_ms == pytest.approx(20.0 + 0.295 * 2048, rel=1e-6)   # every rank full: ~624 ms
    # the same durations read against the busiest rank alone: a token looks 6x as dear
    line = StepClock(max_tokens=2048)
    for _ in range(10):
        for x, m in SHARED_STEPS:
            line.observe(x, _shared_cost(x, m))
    assert line.shared_ms == 0.0 and line.token_ms > 0.1


def test_no_shared_part_where_the_busiest_rank_alone_sets_the_step():
    # the mean varies apart from the busiest (lone and joint prefills), the duration does not
    c = StepClock(max_tokens=2048)
    for k in range(200):
        for x, m in SHARED_STEPS:
            c.observe(x, 8.0 + 0.06 * x + (1.5 if k % 2 else -1.5), m)   # +-1.5 ms of jitter
    assert c.shared_ms == 0.0 and c.token_ms == pytest.approx(0.06, rel=0.01)
    # one rank prefilling at a time: its tokens and the mean move together, nothing to tell apart
    together = StepClock(max_tokens=2048)
    for x in [20, 2048, 600, 1200] * 20:
        together.observe(x, 20.0 + 0.02 * x + 0.275 * x / 4, x / 4)
    assert together.shared_ms == 0.0 and together.token_ms == pytest.approx(0.02 + 0.275 / 4, rel=1e-6)


def test_a_small_or_uncertain_shared_part_is_not_counted():
    # 3 % of a token's cost shared, in +-5 ms of jitter: too small to act on, the line stands
    c = StepClock(max_tokens=2048)
    for k in range(400):
        for x, m in SHARED_STEPS:
            c.observe(x, 8.0 + 0.058 * x + 0.002 * m + (5.0 if (k + x) % 2 else -5.0), m)
    assert c.shared_ms == 0.0
    # a third of it shared, but 10 rounds of steps in +-40 ms of jitter: not yet told apart
    c = StepClock(max_tokens=2048)
    for k in range(10):
        for x, m in SHARED_STEPS:
            c.observe(x, 8.0 + 0.04 * x + 0.02 * m + (40.0 if (k + x // 10) % 2 else -40.0), m)
    assert c.shared_ms == 0.0


def _rank_step(max_tokens: int) -> RankStep:
    core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=max_tokens, max_num_seqs=8,
                           max_model_len=4096)
    cfg = BudgetConfig(max_tokens=max_tokens, min_balance=0.9, min_delay_ms=200.0, max_delay_ms=3000.0,
                       min_delay_steps=1.5, max_delay_steps=23.0, step_ms=0.0)
    return RankStep(0, core, BatchGate(rank=0, timeout_s=0.1), cfg)


def _run_steps(rs: RankStep, fixed: float, per_token: float, sizes: list[int]) -> None:
    for x in sizes:
        rs.step_tokens = x                    # what decide() records of the step's busiest rank
        rs.note_step(fixed + per_token * x)


def test_the_waits_for_company_are_full_steps_of_this_engine():
    # Before a full step is measured, the configured milliseconds.
    rs = _rank_step(2048)
    assert rs.delays_ms() == (200.0, 3000.0)
    # The simulator's default engine: ~131 ms a full step, so 1.5 / 23 steps = ~200 ms / ~3 s.
    _run_steps(rs, 8.0, 0.06, [10, 2048, 300, 1200] * 5)
    lo, hi = rs.delays_ms()
    assert lo == pytest.approx(1.5 * 130.88) and hi == pytest.approx(23 * 130.88)
    # A gb200 engine (4,608-token steps of ~525 ms): the same steps, four times the time.
    # With the waits fixed in milliseconds a prefill waited 0.4 steps there and the group
    # ran unbalanced prefill steps (poisson at 1.0x: 0.80 of ideal; 0.93 with these).
    slow = _rank_step(4608)
    _run_steps(slow, 19.9, 0.1097, [30, 4608, 700, 2500] * 5)
    lo, hi = slow.delays_ms()
    assert lo == pytest.approx(1.5 * (19.9 + 0.1097 * 4608)) and lo > 3 * 200.0
    assert hi == pytest.approx(23 * (19.9 + 0.1097 * 4608))


def test_waits_set_in_milliseconds_only_stay_milliseconds():
    rs = _rank_step(2048)
    rs.budget = BudgetConfig(max_tokens=2048, min_balance=0.9, min_delay_ms=150.0, max_delay_ms=1000.0)
    _run_steps(rs, 8.0, 0.06, [10, 2048] * 5)
    assert rs.delays_ms() == (150.0, 1000.0)


def test_the_delays_in_steps_must_not_be_negative():
    with pytest.raises(ValueError):
        BudgetConfig(min_delay_steps=-1.0)


# --- the wait for company only where lone prefills would crowd the group (align_lone_share)

LONE = BudgetConfig(max_tokens=2048, min_balance=0.9, max_capped_steps=32, max_delay_ms=3000.0,
                    min_delay_ms=200.0, min_delay_steps=1.5, max_delay_steps=23.0, step_ms=0.0,
                    lone_share=0.2, lone_share_full=0.3, lone_tau_s=10.0)


def _group(cfg: BudgetConfig, traffic_tokens: int, steps=None, new_tokens: int = 500) -> list[RankStep]:
    """4 ranks that measured 8 ms + 0.06 ms a token (a full step 131 ms; ``steps`` feeds
    another device's steps to each rank's clock); rank 1 decodes.
    Each rank has seen ``traffic_tokens`` of prompts arrive just now (served since), and the
    group has met once (so each rank counted every rank's arrivals)."""
    from services.engine_worker.sequence import SamplingParams, Sequence
    ranks = []
    for r in range(4):
        rs = RankStep(r, EngineScheduler(BlockManager(4096, 16), 2048, 128, 8192), BatchGate(rank=r), cfg)
        if steps is None:
            _steps(rs.clock, 8.0, 0.06, [20, 2048] * 10)
        else:
            steps(rs.clock)
        rs.note_step(10.0)   # the last step's duration, which deadlines pace with
        for k in range(traffic_tokens // 2000):
            past = Sequence(f"{r}-past{k}", list(range(2000)), SamplingParams(max_tokens=4))
            rs.arrived(past, 0.0)
            rs.forget(past.id)
        ranks.append(rs)
    dec = Sequence("1-dec", list(range(8)), SamplingParams(max_tokens=64))
    ranks[1].core.add(dec)
    ranks[1].core.postprocess(ranks[1].core.schedule(), {"1-dec": 5}, 0.0)
    _meet(ranks, 0.0)   # one step: every rank counts the group's arrivals
    new = Sequence("0-new", list(range(new_tokens)), SamplingParams(max_tokens=16))
    ranks[0].core.add(new)
    ranks[0].arrived(new, 0.0)
    return ranks


def _meet(ranks: list[RankStep], now: float) -> list[int]:
    from services.engine_worker.rank_step import group_view
    plans, rows = zip(*(rs.plan(now) for rs in ranks))
    view = group_view(list(rows))
    for rs, p in zip(ranks, plans):
        rs.decide(p, view, now)
    return [p.num_tokens for p in plans]


def _first_step(ranks: list[RankStep]) -> list[int]:
    return _meet(ranks, 0.001)


def test_a_prefill_in_a_group_with_few_prompts_arriving_starts_at_once():
    """Live on 4 torch ranks (poisson, ~5 requests/s) the default held every first token
    ~1.5 full steps for company that never came (TTFT p50 246 against least_score's 26
    ms, throughput no higher): prompts reached the group at a rate whose lone prefill steps
    would take ~1/3 of its time. Below align_lone_share a prefill starts at once."""
    ranks = _group(LONE, traffic_tokens=0)
    assert ranks[0].lone_share(0.001) < LONE.lone_share
    assert _first_step(ranks) == [500, 1, 0, 0]
    # the same group with the rule off waits for company: a paced part of the prompt
    off = _group(replace(LONE, lone_share=0.0, lone_share_full=0.0), traffic_tokens=0)
    assert 0 < _first_step(off)[0] < 500


def test_a_prefill_in_a_group_crowded_with_prompts_waits_for_company():
    # 6,000 prompt tokens on each of 4 ranks at once, on an engine that just started. Read
    # over the time it had (1 s at least), ~25,000 tokens/s x 0.06 ms: prefilled alone they
    # would take 1.5x the group's time, and the wait for company stands. Averaged as if
    # spread over the whole 10 s window they read 2,400 tokens/s (0.14: calm) and ran alone.
    ranks = _group(LONE, traffic_tokens=6_000)
    assert ranks[0].lone_share(0.001) > LONE.lone_share_full
    got = _first_step(ranks)
    assert 0 < got[0] < 500 and got[1] == 1


def test_on_a_shared_device_a_prefill_starts_at_once_where_waiting_saves_nothing():
    """Live on 4 torch ranks sharing 2 cores, the capacity probe's steps (every rank's full
    prefill at once, ~620 ms) taught a line through the busiest rank's tokens that a token
    costs ~0.3 ms, the lone share read 0.45 and every first token waited 1.5 such steps
    (TTFT p99 1.85 s against least_score's 0.36 s, throughput level). What waiting for
    company saves is only the busiest rank's part, 0.02 ms a token there."""
    ranks = _group(LONE, traffic_tokens=2_000, steps=_shared_device_steps)
    assert ranks[0].clock.shared_ms == pytest.approx(0.275, rel=1e-3)
    assert ranks[0].lone_share(0.001) < LONE.lone_share
    assert _first_step(ranks) == [500, 1, 0, 0]
    # the same arrivals judged by the busiest-rank line alone would have waited
    rate = ranks[0].prompt_rate.rate(0.001)
    assert rate * (0.02 + 0.275) / 1000.0 > LONE.lone_share_full


# --- the wait grows with the backlog only where the group has no headroom (align_grow_share)

GROW = replace(LONE, grow_share=1.0, grow_share_full=2.0)


def _must_beside_a_backlog(cfg: BudgetConfig, traffic_tokens: int) -> int:
    """Rank 0's deadline tokens for its 500-token prompt, 11 ms after it arrived, while rank
    2 holds a full step of prefill (a quarter of the group's: the other ranks' backlog
    rank 0's wait grows with)."""
    from services.engine_worker.sequence import SamplingParams, Sequence
    from services.engine_worker.step_view import F_MUST
    ranks = _group(cfg, traffic_tokens)
    big = Sequence("2-big", list(range(2048)), SamplingParams(max_tokens=16))
    ranks[2].core.add(big)
    ranks[2].arrived(big, 0.0)
    _first_step(ranks)   # the view that tells rank 0 of rank 2's backlog
    return ranks[0].plan(0.011)[1][F_MUST]


def test_with_headroom_the_wait_for_company_does_not_grow_with_the_backlog():
    """On poisson at 0.3x (16 ranks) the wait grew with the few prompts pending elsewhere
    to ~6 full steps, and its first tokens' p99 was 0.29 s against 0.24 s for placement
    alone; the lone-prefill share read ~0.86 there: every prompt prefilled alone would
    still fit in the group's time. Below align_grow_share the wait stays at its minimum,
    1.5 full steps (196 ms): 500 tokens over 18 steps of 10 ms."""
    ranks = _group(GROW, traffic_tokens=2_000)
    assert LONE.lone_share_full < ranks[0].lone_share(0.011) < GROW.grow_share
    assert _must_beside_a_backlog(GROW, 2_000) == 28
    # the rule off: the wait grows to 0.25 x 23 full steps (752 ms), the pace to 7 a step
    assert _must_beside_a_backlog(replace(GROW, grow_share_full=0.0), 2_000) == 7


def test_without_headroom_the_wait_grows_with_the_backlog():
    ranks = _group(GROW, traffic_tokens=18_000)
    assert ranks[0].lone_share(0.011) > GROW.grow_share_full
    assert _must_beside_a_backlog(GROW, 18_000) == 7


def test_a_busy_group_keeps_the_whole_growth_whatever_the_share():
    """On the blog workload (gb200, 8 ranks, more requests than slots) prompts reach the
    ranks only as slots free, so the share read 0.6 while a queue waited in the scheduler;
    without the growth the default fell from 26,364 to 25,985 tok/s (TTFT p99 230 -> 240 s).
    A busy group (its pending prefill sustained) is no group with headroom."""
    busy = replace(GROW, busy_tokens=307.0, busy_tau_s=1e-3)   # a meter that follows at once
    ranks = _group(busy, traffic_tokens=2_000)
    assert ranks[0].lone_share(0.011) < GROW.grow_share
    got = _must_beside_a_backlog(busy, 2_000)
    assert got == _must_beside_a_backlog(replace(busy, grow_share_full=0.0), 2_000)
    assert got < _must_beside_a_backlog(GROW, 2_000)


def test_the_growths_shares_must_be_ordered():
    with pytest.raises(ValueError):
        BudgetConfig(grow_share=2.0, grow_share_full=1.0)
    assert BudgetConfig(grow_share=1.0, grow_share_full=0.0).grow_share_full == 0.0   # 0: always grows


def test_each_step_teaches_the_clock_its_busiest_and_mean_tokens():
    class Recorder:
        def observe(self, *args):
            seen.append(args)

    ranks, seen = _group(LONE, traffic_tokens=0), []
    _first_step(ranks)               # rank 0 prefills 500, rank 1 decodes 1
    ranks[2].clock = Recorder()
    ranks[2].note_step(60.0)
    assert seen == [(500, 60.0, pytest.approx(501 / 4))]


def test_each_ranks_arrivals_are_counted_once():
    # a rank's row carries what arrived since its last row the group saw: meeting again with
    # nothing new adds nothing (counted at every meeting, the rate would climb each step)
    ranks = _group(LONE, traffic_tokens=2_000)
    assert all(rs.arrived_tokens == (500 if rs.rank == 0 else 0) for rs in ranks)
    before = ranks[1].prompt_rate.rate(0.0)
    _meet(ranks, 0.0)
    assert ranks[1].prompt_rate.rate(0.0) == pytest.approx(before + 500 / LONE.lone_tau_s / -math.expm1(-0.1))
    _meet(ranks, 0.0)
    assert ranks[1].prompt_rate.rate(0.0) == pytest.approx(before + 500 / LONE.lone_tau_s / -math.expm1(-0.1))


def test_a_views_mean_tokens_follow_a_trimmed_column():
    # the step's mean is read after the budget trims the tokens column (what ran, not what was planned)
    from services.engine_worker.step_view import FIELDS, F_TOKENS, StepView
    rows = [[0] * FIELDS for _ in range(4)]
    for row, t in zip(rows, (2048, 0, 0, 0)):
        row[F_TOKENS] = t
    view = StepView(rows)
    assert (view.max_tokens, view.mean_tokens) == (2048, 512.0)
    view.set_column(F_TOKENS, [1024, 1024, 1024, 1024])
    assert (view.max_tokens, view.mean_tokens) == (1024, 1024.0)


def _small_steps(n: int):
    def feed(clock: StepClock) -> None:
        for k in range(n):   # decodes with a short prompt now and then: 60-200 tokens a step
            x = 60 + (k * 37) % 140
            clock.observe(x, 8.0 + 0.06 * x)
    return feed


def test_where_the_steps_stay_small_a_prefill_starts_at_once():
    """A chat-sized workload (128-token prompts among decodes) never spreads the steps
    enough for a fit, so the waits stayed at their milliseconds before one: every first
    token waited 200 ms, at every load (TTFT p99 212 ms against the peers' 29). A lone
    prefill there costs the other ranks little: no wait."""
    clock = StepClock(2048)
    _small_steps(40)(clock)
    assert clock.full_step_ms == 0.0 and clock.small_steps
    big = StepClock(2048)
    for _ in range(40):
        big.observe(2048, 131.0)           # an offline batch: full steps, no spread either
    assert big.full_step_ms == 0.0 and not big.small_steps
    ranks = _group(LONE, traffic_tokens=6_000, steps=_small_steps(40))
    assert _first_step(ranks) == [500, 1, 0, 0]
    early = _group(LONE, traffic_tokens=6_000, steps=_small_steps(4))   # too few steps to judge
    assert 0 < _first_step(early)[0] < 500
    # a big prefill among small steps still waits its short wait for company, paced
    big_one = _group(LONE, traffic_tokens=6_000, steps=_small_steps(40), new_tokens=1500)
    assert 0 < _first_step(big_one)[0] < 1500


def test_the_full_rate_is_known_from_the_first_big_step_before_any_fit():
    # a burst on a fresh cluster: its first step is full on every rank, long before a fit
    small = StepClock(2048)
    small.observe(300, 100.0)                   # under half a full step: says nothing of a full one
    assert small.full_rate_tps == 0.0
    c = StepClock(2048)
    c.observe(2048, 4000.0)                     # 4 torch ranks on 2 CPU cores: a 4 s full step
    c.observe(2048, 4100.0, mean_tokens=1500)   # the ranks' mean is what they computed: slower
    assert c.full_step_ms == 0.0 and c.full_rate_tps == pytest.approx(512.0)
    fitted = StepClock(2048)
    for _ in range(20):
        fitted.observe(2048, 130.0)
        fitted.observe(512, 40.0)
    assert fitted.full_rate_tps == pytest.approx(2048 / 0.130, rel=0.02)


def test_the_engines_own_model_is_the_rate_until_a_step_is_measured():
    # the sim's cost model knows its full step: a burst on a cluster that had served
    # nothing met no rate and was admitted whole (10,000 at once: 8,192, up to 82 s)
    c = StepClock(max_tokens=2048)
    assert c.full_rate_tps == 0.0
    c.prior_ms = 128.0
    assert c.full_rate_tps == 16_000.0
    c.observe(2048, 256.0)                      # a measured step, slower: it wins
    assert c.full_rate_tps == 8_000.0


def test_the_fixed_part_is_the_fits_intercept():
    c = StepClock(max_tokens=2048)
    assert c.fixed_ms == 0.0                     # no fit: none
    for _ in range(50):
        for x in (128, 1024, 2048):
            c.observe(x, 8.0 + 0.06 * x)
    assert c.fixed_ms == pytest.approx(8.0, abs=0.1)
