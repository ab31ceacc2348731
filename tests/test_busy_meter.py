"""The busy measure of coordinated prefill (services/engine_worker/busy_meter.py) and how
RankStep applies it: a sustained backlog turns the shared budget throughput-first, one
burst does not, and every rank follows rank 0's verdict so that all compute the same T."""

from __future__ import annotations

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.busy_meter import BusyMeter
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.rank_step import RankStep
from services.engine_worker.step_budget import BudgetConfig
from services.engine_worker.step_view import (F_ALIGN, F_BUSY, F_DECODE, F_HAS_WORK, F_MUST, F_QUEUED, F_TOKENS,
                                             FIELDS, StepView)


def test_a_sustained_backlog_makes_the_group_busy_and_its_end_makes_it_idle_again():
    m = BusyMeter(level=0.15, tau_s=2.0)
    m.observe(0.0, 0.0)
    assert not m.busy
    t = 0.0
    while not m.busy:            # 0.5 full steps pending, step after step
        t += 0.01
        m.observe(0.5, t)
        assert t < 2.0, "a backlog three times the level never made the group busy"
    assert t > 0.5               # ... but only once it lasted (averaged, not the last step)
    while m.busy:
        t += 0.01
        m.observe(0.0, t)
    assert m.avg < 0.15


def test_one_burst_does_not_flip_it_and_level_zero_never_is_busy():
    m = BusyMeter(level=0.15, tau_s=2.0)
    m.observe(0.0, 0.0)
    m.observe(8.0, 0.01)         # one step with eight full steps pending
    m.observe(0.0, 0.02)
    assert not m.busy
    off = BusyMeter(level=0.0, tau_s=2.0)
    off.observe(100.0, 0.0)
    assert not off.busy


def test_the_busy_threshold_is_prompt_tokens_a_rank_whatever_the_step_size():
    """Set in full steps, the same 0.15 was 307 tokens a rank on 2,048-token steps but 691
    on the gb200 profile's 4,608: there poisson at 1.0x never turned busy (efficiency
    0.929, against 0.964 counted in tokens)."""
    def meter(max_tokens: int) -> BusyMeter:
        core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=max_tokens, max_num_seqs=8,
                               max_model_len=8192)
        cfg = BudgetConfig(max_tokens=max_tokens, min_balance=0.9, busy_tokens=307.0)
        return RankStep(0, core, BatchGate(rank=0), cfg).meter

    for tokens, busy in ((400, True), (250, False)):
        for max_tokens in (2048, 4608):
            m = meter(max_tokens)
            m.observe(tokens / max_tokens, 0.0)   # the meter reads pending prefill in full steps
            assert m.busy is busy, (tokens, max_tokens)


def _rank_step(rank: int) -> RankStep:
    core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=4096)
    gate = BatchGate(rank=rank, timeout_s=0.1)
    cfg = BudgetConfig(max_tokens=2048, min_balance=0.9, backlog_steps=0.5, busy_tokens=0.15 * 2048,
                       busy_backlog_steps=0.25, min_delay_ms=200.0, max_delay_ms=3000.0, step_ms=0.0)
    return RankStep(rank, core, gate, cfg)


def _view(rank0_busy: int) -> StepView:
    """4 ranks, all decoding 20: rank 1 has 3,000 prefill tokens pending (2,000 in this
    step's plan), whose deadlines need 1,200 now; rank 3 has 500, with no deadline near.
    The group's pending prefill, each rank's counted up to a full step, is (2,048 + 500) /
    (4 x 2,048) = 0.31 full steps: headroom for backlog_steps 0.5, a backlog for
    busy_backlog_steps 0.25 (on two ranks: one rank's alone is never a backlog)."""
    pending = {1: (2000, 1200, 3000), 3: (500, 0, 500)}   # rank: (plan, must, queued)
    rows = []
    for r in range(4):
        plan, must, queued = pending.get(r, (0, 0, 0))
        row = [0] * FIELDS
        row[F_HAS_WORK], row[F_ALIGN], row[F_DECODE] = 1, 1, 20
        row[F_TOKENS] = 20 + plan
        row[F_MUST] = 20 + must
        row[F_QUEUED] = queued
        rows.append(row)
    rows[0][F_BUSY] = rank0_busy
    rows[2][F_BUSY] = 1 - rank0_busy      # another rank's verdict is not applied
    return StepView(rows)


def test_the_shared_budget_follows_rank_0s_busy_verdict():
    rs = _rank_step(2)
    # With headroom the prefill deadline holds: T rises to what rank 1 must compute.
    assert rs._budget(_view(rank0_busy=0)) == 1220
    # Busy (rank 0 says so): the backlog rule applies and balance decides, so T stays at
    # the decode level and rank 1's prefill waits for company.
    assert rs._budget(_view(rank0_busy=1)) == 20
    # Whatever this rank's own meter says.
    rs.meter.observe(5.0, 0.0)
    assert rs.meter.busy and rs._budget(_view(rank0_busy=0)) == 1220


def test_a_rank_reports_its_own_verdict_in_its_row():
    rs = _rank_step(0)
    _, row = rs.plan(0.0)
    assert len(row) == FIELDS and row[F_BUSY] == 0
    rs.meter.observe(1.0, 0.0)
    _, row = rs.plan(0.01)
    assert row[F_BUSY] == 1
