"""Waiting for company only where it comes soon (rank_step.py company_shortfall, the
step row's F_COMPANY): under a backlog a step holds back for the ranks without prefill
(``min_balance``), and that pays only when prompts reach the group several times a step.
Prompts of many steps each arrive about once a step: the wait idled every other rank
(`lockstep simulate --workload fixed:16000:16 --ranks 8 --api-servers 4 --requests 300
--seed 2`: 0.884 of ideal at 1.0x, 0.976 with the rule; docs/benchmarks.md, "How the
default decides")."""

from __future__ import annotations

import pytest

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.rank_step import RankStep
from services.engine_worker.sequence import Sequence
from services.engine_worker.step_budget import BudgetConfig
from services.engine_worker.step_view import (BUSY_FLAG, F_ALIGN, F_ARRIVED, F_BUSY, F_COMPANY, F_DECODE,
                                             F_HAS_WORK, F_QUEUED, F_TOKENS, FIELDS, StepView)
from shared.messages import SamplingParams

FULL = 2048


def _cfg(company_prompts: float = 0.25) -> BudgetConfig:
    return BudgetConfig(max_tokens=FULL, min_balance=0.94, backlog_steps=0.5, busy_tokens=307.0,
                        busy_backlog_steps=0.25, busy_capped_steps=64, max_capped_steps=32, min_delay_ms=200.0,
                        max_delay_ms=3000.0, step_ms=0.0, company_prompts=company_prompts)


def _rank_step(cfg: BudgetConfig) -> RankStep:
    core = EngineScheduler(BlockManager(512, 16), max_num_batched_tokens=FULL, max_num_seqs=16, max_model_len=32768)
    return RankStep(0, core, BatchGate(rank=0, timeout_s=0.1), cfg)


def _view(queued: list[int], decode: int = 16, arrived: int = 0, company: int = 0,
          blocked: tuple[int, ...] = ()) -> StepView:
    """A busy group: ranks decoding ``decode`` each, ``queued`` prefill pending (all in this
    step's plan, unless ``blocked``: its KV is full); rank 0 reports ``arrived`` prompt
    tokens and the shortfall ``company``."""
    rows = []
    for i, q in enumerate(queued):
        row = [0] * FIELDS
        row[F_HAS_WORK], row[F_ALIGN], row[F_DECODE] = 1, 1, decode
        row[F_TOKENS] = decode + (0 if i in blocked else min(q, FULL - decode))
        row[F_QUEUED] = q
        row[F_BUSY] = BUSY_FLAG if i == 0 else 0
        row[F_ARRIVED] = arrived if i == 0 else 0
        row[F_COMPANY] = company if i == 0 else 0
        rows.append(row)
    return StepView(rows)


def _stream(rs: RankStep, prompt: int, per_s: float, ranks: int = 8, for_s: float = 30.0) -> float:
    """Prompts of ``prompt`` tokens reaching the group ``per_s`` a second for ``for_s``, one
    view per 10 ms, a full step measured at 130 ms; the time at the end."""
    rs.arrived(Sequence("m", list(range(prompt)), SamplingParams(max_tokens=4)), 0.0)   # the mean prompt
    for _ in range(40):
        rs.clock.observe(FULL, 130.0, FULL)
        rs.clock.observe(FULL // 4, 40.0, FULL // 4)
    t, due = 0.0, 0.0
    while t < for_s:
        t += 0.01
        due += per_s * 0.01
        n = int(due)
        due -= n
        rs.decide(rs.core.schedule(), _view([0] * ranks, arrived=n * prompt), t)
    return t


def test_long_prompts_that_arrive_about_once_a_step_fall_short():
    rs = _rank_step(_cfg())
    assert rs.company_shortfall(0.0) == 0.0               # nothing measured: the full floor
    t = _stream(rs, 16000, 7.7)                           # fixed:16000:16 on 8 ranks at capacity
    assert rs.clock.full_step_ms == pytest.approx(130.0, rel=0.05)
    # 7.7 prompts/s x 0.13 s / 8 ranks = 0.125 per rank per full step: half of 0.25
    assert rs.company_shortfall(t) == pytest.approx(0.5, abs=0.05)
    assert rs.plan(t)[1][F_COMPANY] == pytest.approx(500, abs=50)


def test_short_prompts_that_arrive_many_times_a_step_keep_the_floor():
    rs = _rank_step(_cfg())
    t = _stream(rs, 1000, 40.0)                           # 0.65 per rank per full step
    assert rs.company_shortfall(t) == 0.0
    assert rs.plan(t)[1][F_COMPANY] == 0


def test_without_the_rule_the_floor_stays():
    rs = _rank_step(_cfg(company_prompts=0.0))
    t = _stream(rs, 16000, 7.7)
    assert rs.company_shortfall(t) == 0.0


def test_rank_0s_shortfall_lowers_the_balance_a_step_must_keep():
    rs = _rank_step(_cfg())
    seven = [16000] * 7 + [0]                             # one rank of eight has no prefill
    # the full floor (0.94): seven ranks' 2,048 and one's 16 is 0.876 balanced: decodes only
    assert rs._budget(_view(seven)) == 16
    # company comes seldom (half the rate at which waiting pays): the floor is 0.47, the step runs
    assert rs._budget(_view(seven, company=500)) == FULL
    # and a step only one rank of eight could fill is still held back
    assert rs._budget(_view([16000] + [0] * 7, company=500)) == 16
    # a rank that holds prefill it cannot start (its KV is full) is company that will come
    # as its room frees: the full floor stands (letting the others run collapsed a KV-bound group)
    assert rs._budget(_view([16000] * 6 + [16000, 0], company=500, blocked=(6,))) == 16


def test_company_prompts_is_checked():
    with pytest.raises(ValueError):
        BudgetConfig(company_prompts=-1.0)


def test_a_rank_reports_the_prompt_tokens_per_second_of_its_full_steps():
    # the scheduler's least wait for a young backlog (scheduler/queue_eta.py) divides by it
    from services.engine_worker.outputs import _budget_state
    rs = _rank_step(_cfg())
    assert _budget_state(rs)["prefill_tps"] is None           # nothing measured: no figure, not 0
    for _ in range(40):
        rs.clock.observe(FULL, 130.0, FULL)
        rs.clock.observe(FULL // 4, 40.0, FULL // 4)
    assert _budget_state(rs)["prefill_tps"] == pytest.approx(FULL / 0.130, rel=0.05)


def test_a_rank_reports_the_requests_per_second_its_slots_let_it_finish():
    from services.engine_worker.outputs import _budget_state
    from services.engine_worker.slot_turnover import SlotTurnover
    rs = _rank_step(_cfg())
    slots = SlotTurnover(max_num_seqs=128, max_tokens=FULL, kv_tokens=10**7)
    assert _budget_state(rs, slots)["seq_rps"] is None         # nothing measured: no figure, not 0
    slots.finished(200, 40)
    assert _budget_state(rs, slots)["seq_rps"] is None         # no full step known yet
    rs.clock.prior_ms = 130.0                                  # the sim's model of one
    step_ms = 130.0 * (128 + 3.2 * 200) / FULL                # every slot's decode and 3.2 prompts a step
    assert _budget_state(rs, slots)["seq_rps"] == pytest.approx(3.2 * 1000 / step_ms, rel=0.01)
