"""The end of a backlog (services/engine_worker/step_budget.py tail_budget, rank_step.py
RankStep._tail): when every rank of a busy, decoding group has a last bit of prefill left,
it rides on the decode steps that follow instead of one long step that every decode waits
through; anywhere else the budget is what it was."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.rank_step import RankStep
from services.engine_worker.step_budget import TAIL_MAX_FILL, TAIL_MIN_FILL, BudgetConfig, tail_budget
from services.engine_worker.step_view import (BUSY_FLAG, TAIL_FLAG, F_ALIGN, F_BUSY, F_DECODE, F_HAS_WORK, F_MUST, F_QUEUED, F_TOKENS,
                                             FIELDS, StepView)

FULL = 4608


def _cfg(tail_steps: float = 4.0) -> BudgetConfig:
    return BudgetConfig(max_tokens=FULL, min_balance=0.9, backlog_steps=0.5, busy_tokens=0.15 * FULL,
                        busy_backlog_steps=0.25, min_delay_ms=200.0, max_delay_ms=3000.0, step_ms=0.0,
                        tail_steps=tail_steps)


def test_tail_budget_is_the_decodes_plus_a_share_of_the_largest_remainder():
    cfg = _cfg()
    # 1,074 left at most, 48 decodes at most: a quarter (269) is under the floor of 4608/16
    assert tail_budget([48, 40], [1074, 1042], cfg) == 48 + 288
    # 2,101 left: a quarter, rounded up
    assert tail_budget([52, 50], [2101, 2058], cfg) == 52 + 526
    # never above a full step
    assert tail_budget([4000], [4000], cfg) == FULL


def _rank_step(cfg: BudgetConfig) -> RankStep:
    core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=FULL, max_num_seqs=8, max_model_len=8192)
    return RankStep(1, core, BatchGate(rank=1, timeout_s=0.1), cfg)


def _view(queued: list[int], decode: int = 48, busy: int = 1) -> StepView:
    """4 ranks, each decoding ``decode``, with ``queued`` prefill tokens pending and all of
    it in this step's plan and past its deadline (what a long backlog leaves)."""
    rows = []
    for q in queued:
        row = [0] * FIELDS
        row[F_HAS_WORK], row[F_ALIGN], row[F_DECODE] = 1, 1, decode
        row[F_TOKENS] = row[F_MUST] = decode + q
        row[F_QUEUED] = q
        row[F_BUSY] = busy
        rows.append(row)
    return StepView(rows)


def test_a_busy_groups_last_prefill_is_spread_over_the_decode_steps():
    on, off = _rank_step(_cfg(4.0)), _rank_step(_cfg(0.0))
    tail = [1074, 1042, 1060, 1050]
    # without the spread the whole remainder runs in one step ...
    assert off._budget(_view(tail)) == 48 + 1074
    # ... with it, a quarter of it (at least a sixteenth of a full step) per step
    assert on._budget(_view(tail)) == 48 + 288


def test_a_small_remainder_runs_whole_unless_the_spread_began_above_it():
    """Spread, a remainder under TAIL_MIN_FILL of a full step makes two or three steps
    nearly as long as the one, each a slow interval for every decode (gb200 offline, seed
    2, 0.3x: ITL p99 22 -> 49 ms); a spread that began above it still runs to the end."""
    on, off = _rank_step(_cfg(4.0)), _rank_step(_cfg(0.0))
    small = [int(TAIL_MIN_FILL * FULL) - 1, 500, 520, 480]
    assert on._budget(_view(small)) == off._budget(_view(small)) == 48 + small[0]
    spreading = _view(small, busy=BUSY_FLAG | TAIL_FLAG)      # rank 0's row: the spread is under way
    assert on._budget(spreading) == 48 + 288


def test_the_spread_under_way_rides_in_rank_0s_row():
    rs = _rank_step(_cfg(4.0))
    big = [int(TAIL_MIN_FILL * FULL) + 100, 1000, 1000, 1000]
    rs.decide(rs.core.schedule(), _view(big), 0.0)
    assert rs.tail_on
    _, row = rs.plan(0.01)
    assert row[F_BUSY] & TAIL_FLAG
    rs.decide(rs.core.schedule(), _view([0, 0, 0, 0]), 0.02)   # the prefill ended: so did the spread
    assert not rs.tail_on and not rs.plan(0.03)[1][F_BUSY] & TAIL_FLAG


def test_the_spread_keeps_the_share_it_began_with_and_ends_in_tail_steps_steps():
    """A share of what remains each step shrank geometrically: a remainder of 0.44 of a
    step took 7 steps, not 4, and the last prompts' first tokens waited through them
    (16-rank offline at 0.3x, TTFT p99 1.31 s against 1.28 s with the share fixed)."""
    rs = _rank_step(_cfg(4.0))
    left = [1600, 1580, 1590, 1570]
    T = rs._budget(_view(left))
    assert T == 48 + 400                                   # a quarter of the largest remainder
    steps = 1
    while max(left) > 0:
        left = [max(0, q - (T - 48)) for q in left]
        if max(left) == 0:
            break
        T = rs._budget(_view(left, busy=BUSY_FLAG | TAIL_FLAG))
        assert T == 48 + 400                               # under way: the same share, not a quarter of what is left
        steps += 1
    assert steps == 4


@pytest.mark.parametrize("queued, decode, busy", [
    ([1074, 0, 1060, 1050], 48, 1),                 # a rank without prefill: new arrivals, not a tail
    ([int(TAIL_MAX_FILL * FULL)] * 4, 48, 1),        # a remainder near a full step is a step of its own
    ([1074, 1042, 1060, 1050], 48, 0),              # headroom: TTFT first as before
    ([1074, 1042, 1060, 1050], 0, 1),               # nobody decodes: no steps to ride on
])
def test_no_spread_outside_a_busy_decoding_groups_last_prefill(queued, decode, busy):
    on, off = _rank_step(_cfg(4.0)), _rank_step(_cfg(0.0))
    assert on._budget(_view(queued, decode, busy)) == off._budget(_view(queued, decode, busy))


def test_offline_backlog_ends_in_small_steps_and_every_request_completes():
    """The simulator (the same RankStep) on a gb200-profile offline batch of 170 requests
    on 4 ranks: four full prefill steps leave ~1,400 tokens on every rank. Without the
    spread they run in one step; with the product's default, every later step is the
    decodes (43 here) plus at most a quarter of that remainder, and nothing is lost."""
    from services.simulator import profile, workload
    from services.simulator.sim import SimConfig, resolve_policies, run_policy
    prof = profile.load("deepseek-v3-gb200")
    cfg = dataclasses.replace(SimConfig(), ranks=4, api_servers=1, engine=prof.engine, cost=prof.cost, seed=1)
    tr = workload.generate("offline", 170, 1.0, 1, 1, max_model_len=prof.engine.max_model_len)
    spec = resolve_policies("default", cfg)[0]
    spread = spec.step_budget["tail_steps"]
    assert spread > 0                                   # the product's default spreads
    busiest = {}
    for steps in (0.0, spread):
        s = dataclasses.replace(spec, step_budget={**spec.step_budget, "tail_steps": steps})
        r = run_policy(tr, s, cfg)
        assert r.completed == len(tr)
        busiest[steps] = r.scheduled.max(axis=1)
    last_full = int(np.nonzero(busiest[0.0] >= FULL)[0].max())
    remainder = int(busiest[0.0][last_full + 1])
    assert FULL / 4 < remainder < TAIL_MAX_FILL * FULL
    assert busiest[spread][:last_full + 1].tolist() == busiest[0.0][:last_full + 1].tolist()
    assert busiest[spread][last_full + 1:].max() <= 64 + -(-remainder // int(spread))
