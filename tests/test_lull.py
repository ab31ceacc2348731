"""A lull (services/engine_worker/step_budget.py lull_budget, rank_step.py RankStep.in_lull):
when no prompt has reached the group while many were due, the ranks with nothing queued
are not waited for, and the prompts queued elsewhere start in a step balanced among
themselves instead of waiting for the capped-steps bound. The last requests of a
benchmark with fixed lengths (vLLM benchmark_serving's random dataset, 1,024 in / 128 out)
waited up to 64 capped steps for company that was not coming: 0.945-0.951 of ideal at
1.0x, 0.983-0.986 with the rule (`lockstep simulate --workload fixed`, seeds 1-3;
docs/benchmarks.md, "How the default decides", item 3)."""

from __future__ import annotations

import pytest

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.rank_step import RankStep
from services.engine_worker.sequence import Sequence
from services.engine_worker.step_budget import BudgetConfig, lull_budget
from services.engine_worker.step_view import (BUSY_FLAG, LULL_FLAG, F_ALIGN, F_ARRIVED, F_BUSY, F_DECODE, F_HAS_WORK,
                                             F_QUEUED, F_TOKENS, FIELDS, StepView)
from shared.messages import SamplingParams

FULL = 2048


def _cfg(lull_prompts: float = 16.0) -> BudgetConfig:
    return BudgetConfig(max_tokens=FULL, min_balance=0.94, backlog_steps=0.5, busy_tokens=307.0,
                        busy_backlog_steps=0.25, busy_capped_steps=64, max_capped_steps=32, min_delay_ms=200.0,
                        max_delay_ms=3000.0, step_ms=0.0, lull_prompts=lull_prompts, lull_tau_s=2.0)


def _rank_step(cfg: BudgetConfig, rank: int = 0) -> RankStep:
    core = EngineScheduler(BlockManager(512, 16), max_num_batched_tokens=FULL, max_num_seqs=16, max_model_len=8192)
    return RankStep(rank, core, BatchGate(rank=rank, timeout_s=0.1), cfg)


def _view(queued: list[int], decode: int = 30, flags: int = BUSY_FLAG, arrived: int = 0,
          blocked: tuple[int, ...] = ()) -> StepView:
    """Ranks decoding ``decode`` each, with ``queued`` prefill tokens pending and (unless
    ``blocked``: its KV is full) all of it in this step's plan; rank 0's flags."""
    rows = []
    for i, q in enumerate(queued):
        row = [0] * FIELDS
        row[F_HAS_WORK], row[F_ALIGN], row[F_DECODE] = 1, 1, decode
        row[F_TOKENS] = decode + (0 if i in blocked else q)
        row[F_QUEUED] = q
        row[F_BUSY] = flags if i == 0 else 0
        row[F_ARRIVED] = arrived if i == 0 else 0
        rows.append(row)
    return StepView(rows)


def test_lull_budget_balances_among_the_ranks_that_have_prefill():
    # two ranks with a 1,024-token prompt, two with none: the two run it
    assert lull_budget([30, 30, 30, 30], [1054, 1054, 30, 30], [1024, 1024, 0, 0], 0.94, FULL) == 1054
    # every rank has prefill, or none: the ordinary rule decides
    assert lull_budget([30] * 4, [1054] * 4, [1024] * 4, 0.94, FULL) == 0
    assert lull_budget([30] * 4, [30] * 4, [0] * 4, 0.94, FULL) == 0
    # a rank that has prefill queued but cannot start it (KV full) is waited for
    assert lull_budget([30] * 4, [1054, 30, 30, 30], [1024, 1024, 0, 0], 0.94, FULL) == 0


def test_in_a_lull_a_queued_prompt_runs_without_the_ranks_that_have_none():
    rs = _rank_step(_cfg())
    last = [1024, 1024, 0, 0]
    # a busy group, half its ranks empty: held for company (the decodes only) ...
    assert rs._budget(_view(last)) == 30
    # ... unless rank 0 says no prompt has come for a while: then the two run theirs
    assert rs._budget(_view(last, flags=BUSY_FLAG | LULL_FLAG)) == 30 + 1024
    # a rank whose KV cannot take its prompt is company that will come: still held
    assert rs._budget(_view(last, flags=BUSY_FLAG | LULL_FLAG, blocked=(1,))) == 30


def test_without_the_rule_a_lull_changes_nothing():
    rs = _rank_step(_cfg(lull_prompts=0.0))
    assert rs._budget(_view([1024, 1024, 0, 0], flags=BUSY_FLAG | LULL_FLAG)) == 30


def _arrive(rs: RankStep, n: int, sid: int) -> None:
    rs.arrived(Sequence(str(sid), list(range(n)), SamplingParams(max_tokens=4)), 0.0)


def test_rank_0_flags_a_lull_once_many_prompts_were_due_and_none_came():
    rs = _rank_step(_cfg())
    for i in range(20):          # a stream: 1,000-token prompts, one every 10 ms (100/s)
        _arrive(rs, 1000, i)
    t = 0.0
    for _ in range(200):
        t += 0.01
        rs.decide(rs.core.schedule(), _view([0, 0, 0, 0], arrived=1000), t)
        assert not rs.plan(t)[1][F_BUSY] & LULL_FLAG
    # the stream stops: about 16 prompts' time (160 ms, a little more as the rate decays)
    # without one is a lull, 150 ms is not yet
    last = t
    while t < last + 0.15:
        t += 0.01
        rs.decide(rs.core.schedule(), _view([0, 0, 0, 0]), t)
    assert not rs.plan(t)[1][F_BUSY] & LULL_FLAG
    while t < last + 0.25:
        t += 0.01
        rs.decide(rs.core.schedule(), _view([0, 0, 0, 0]), t)
    assert rs.plan(t)[1][F_BUSY] & LULL_FLAG
    # a prompt arrives: the lull is over
    t += 0.01
    rs.decide(rs.core.schedule(), _view([0, 0, 0, 0], arrived=1000), t)
    assert not rs.plan(t)[1][F_BUSY] & LULL_FLAG


def test_a_long_step_is_no_lull():
    """Arrivals reach the rows one step late, so the quiet time is judged up to the last
    view: a 500 ms step (a long prefill) in a stream of 100 prompts/s is not 50 prompts'
    silence."""
    rs = _rank_step(_cfg())
    for i in range(20):
        _arrive(rs, 1000, i)
    t = 0.0
    for _ in range(200):
        t += 0.01
        rs.decide(rs.core.schedule(), _view([0, 0, 0, 0], arrived=1000), t)
    assert not rs.plan(t + 0.5)[1][F_BUSY] & LULL_FLAG


@pytest.mark.parametrize("bad", [dict(lull_prompts=-1.0), dict(lull_tau_s=0.0)])
def test_lull_settings_are_checked(bad):
    with pytest.raises(ValueError):
        BudgetConfig(**bad)


def test_the_fixed_workload_is_every_request_alike():
    """`lockstep simulate --workload fixed`, the shape behind the rule: vLLM
    benchmark_serving's random dataset at its defaults (1,024 in, 128 out), Poisson arrivals."""
    from services.simulator import workload
    tr = workload.generate("fixed", 300, 50.0, 1, api_servers=2, max_model_len=4096)
    assert set(tr.prompt.tolist()) == {1024} and set(tr.output.tolist()) == {128}
    gaps = tr.t[1:] - tr.t[:-1]
    assert (gaps >= 0).all() and 1 / 50.0 * 0.7 < gaps.mean() < 1 / 50.0 * 1.3


def _blocked_cfg(blocked_tokens: int) -> BudgetConfig:
    from dataclasses import replace
    return replace(_cfg(lull_prompts=0.0), blocked_tokens=blocked_tokens)


def test_a_busy_group_with_a_blocked_rank_runs_short_steps():
    # (rank_step.py _budget, align_blocked_tokens) 16 ranks decoding 30 each with a
    # 600-token prompt, one of which cannot start its prompt (KV full): the balance rule
    # alone runs 630-token steps ((15 x 630 + 30) / (16 x 630) = 0.94); the cap keeps them
    # to the decodes + 192, so the blocked rank's sequences finish, and free its room, in
    # shorter steps (ramp at 1.0-1.5x, seeds 1-3: 0.938 -> 0.945 of ideal on average)
    queued = [600] * 16
    assert _rank_step(_blocked_cfg(0))._budget(_view(queued, blocked=(3,))) == 630
    assert _rank_step(_blocked_cfg(192))._budget(_view(queued, blocked=(3,))) == 30 + 192


def test_the_blocked_cap_needs_a_blocked_rank_and_a_busy_group_and_keeps_prefill_going():
    rs = _rank_step(_blocked_cfg(192))
    assert rs._budget(_view([600] * 16)) == 630                          # nobody blocked
    assert rs._budget(_view([600] * 16, flags=0, blocked=(3,))) == 630   # not busy: the balance rule alone
    # many decodes (a large max_num_seqs): the cap is above them, so the others still prefill
    assert rs._budget(_view([FULL] * 16, decode=300, blocked=(3,))) == 300 + 192
