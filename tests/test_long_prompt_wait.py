"""The long-prompt wait (services/engine_worker/rank_step.py RankStep._long_prompt_waits,
prompt_window.py): where the group's recent prompts have a long tail, a shorter prompt may
wait for company until 0.8 of the time the longest 1 % take to prefill at full rate, less
its own, while the group is not busy. The TTFT tail stays the long prompts', and the longer
window lets more ranks' prefill share steps: heavy-tailed prompts at 32 ranks x 8
api-servers ran at 0.912 / 0.892 of ideal at 0.8 / 1.0x, behind TensorRT-LLM's and SGLang's
gates, and run at 0.923 / 0.904, ahead of them (docs/benchmarks.md, "How the default
decides", item 3)."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.prompt_window import MIN_SAMPLES, PromptWindow
from services.engine_worker.rank_step import RankStep, group_view
from services.engine_worker.sequence import Sequence
from services.engine_worker.step_budget import BudgetConfig
from services.engine_worker.step_view import F_ARRIVED, F_ARRIVED_N, F_LONGEST
from shared.messages import SamplingParams

FULL = 2048
FULL_MS = 8.0 + 0.06 * FULL   # what the rank measured a full step at: 130.9 ms


def _cfg(long_quantile: float = 0.99) -> BudgetConfig:
    return BudgetConfig(max_tokens=FULL, min_balance=0.94, max_capped_steps=32, min_delay_ms=200.0,
                        max_delay_ms=3000.0, min_delay_steps=1.5, max_delay_steps=23.0, step_ms=0.0,
                        long_quantile=long_quantile, long_share=0.8)


def _rank(cfg: BudgetConfig, past: list[int]) -> RankStep:
    """A rank that measured its steps (a full one 131 ms, the last 10 ms) and saw the group
    receive prompts of the sizes ``past`` (the rows fill its window: the test below), in a
    group where others decode."""
    rs = RankStep(0, EngineScheduler(BlockManager(4096, 16), FULL, 128, 32768), BatchGate(rank=0), cfg)
    for _ in range(10):
        for x in (20, FULL):
            rs.step_tokens = x
            rs.note_step(8.0 + 0.06 * x)
    rs.step_tokens = 33
    rs.note_step(10.0)   # the last step (on the line), which the deadlines pace with
    if rs.prompts is not None:
        for n in past:
            rs.prompts.add(n)
    rs.group_idle = rs.group_quiet = False   # the others decode: a lone prefill delays them
    return rs


def _must_at(rs: RankStep, prompt: int, now_s: float) -> int:
    """What this rank's deadlines need at ``now_s`` of a ``prompt``-token prompt that
    arrived at 0."""
    seq = Sequence("new", [1] * prompt, SamplingParams(max_tokens=16))
    rs.core.add(seq)
    rs.arrived(seq, 0.0)
    must, _ = rs.prefill_need(rs.core.schedule(), now_s)
    return must


HEAVY = [300] * 100 + [10240] * 3   # the 99th percentile is a 10k-token prompt (5 full steps)
LIGHT = [300] * 100 + [2000] * 3    # the longest are under a full step


def test_the_prompt_window_keeps_the_last_prompts_sorted():
    w = PromptWindow(4)
    for n in (50, 10, 40):
        w.add(n)
    assert w.quantile(0.5) is None          # fewer than 4 (its size): nothing known yet
    w.add(30)
    assert w.quantile(0.0) == 10 and w.quantile(0.99) == 50
    w.add(20)                               # 50 leaves: the oldest
    assert len(w) == 4 and w.quantile(0.99) == 40
    big = PromptWindow(1024)
    for n in range(MIN_SAMPLES - 1):
        big.add(n)
    assert big.quantile(0.99) is None
    big.add_many(1000, 2)
    assert big.quantile(0.99) == 1000
    big.add_many(5, 10**6)                  # more than it holds: a window of them, no more work
    assert len(big) == 1024 and big.quantile(0.99) == 5
    with pytest.raises(ValueError):
        PromptWindow(0)


def _bare(rank: int) -> RankStep:
    return RankStep(rank, EngineScheduler(BlockManager(4096, 16), FULL, 128, 32768), BatchGate(rank=rank), _cfg())


def test_every_rank_fills_the_same_window_from_the_rows():
    """A rank alone sees 1/ranks of the prompts: its own 99th percentile was its largest one
    or two, and on log-normal prompts it lengthened waits where no long prompts were. So each
    row reports the prompts that reached the rank (their sum, the longest, how many), and
    every rank adds every row: the longest exactly, the others as their mean."""
    ranks = [_bare(0), _bare(1)]
    for k, n in enumerate((100, 300, 800)):
        ranks[0].arrived(Sequence(f"a{k}", [1] * n, SamplingParams(max_tokens=4)), 0.0)
    ranks[1].arrived(Sequence("b", [1] * 5000, SamplingParams(max_tokens=4)), 0.0)
    planned = [rs.plan(0.01) for rs in ranks]
    assert [planned[0][1][i] for i in (F_ARRIVED, F_LONGEST, F_ARRIVED_N)] == [1200, 800, 3]
    view = group_view([row for _, row in planned])
    for rs, (plan, _) in zip(ranks, planned):
        rs.decide(plan, view, 0.01)
    for rs in ranks:
        assert rs.prompts._sorted == [200, 200, 800, 5000] and rs.unreported == []
    # reported once: the next rows carry nothing
    assert all(rs.plan(0.02)[1][F_ARRIVED_N] == 0 for rs in ranks)


def test_a_short_prompt_waits_for_company_while_the_long_prompts_take_longer():
    # 250 ms after it arrived, past the 1.5-full-step wait (196 ms): without the rule its
    # deadline has passed and it needs everything now, a lone step the group waits through
    assert _must_at(_rank(_cfg(long_quantile=0.0), HEAVY), 200, 0.25) == 200
    # with it, it may wait until 0.8 x 5 full steps (524 ms) less its own 13 ms: paced over
    # the 26 steps of 10 ms left, in slices the other ranks' prefill can share
    assert _must_at(_rank(_cfg(), HEAVY), 200, 0.25) == 8
    # its deadline still comes: by 0.52 s it needs everything
    assert _must_at(_rank(_cfg(), HEAVY), 200, 0.52) == 200


def test_the_long_prompts_and_log_normal_streams_keep_the_ordinary_wait():
    # a long prompt itself is no shorter prompt: its own prefill takes the whole wait
    assert _must_at(_rank(_cfg(), HEAVY), 10240, 0.25) == FULL
    # where the longest recent prompts fit in the 1.5-full-step wait, nothing changes
    assert _must_at(_rank(_cfg(), LIGHT), 200, 0.25) == 200
    # nor before 32 prompts were seen
    assert _must_at(_rank(_cfg(), [10240] * 20), 200, 0.25) == 200


def test_a_busy_group_keeps_its_own_waits():
    """Busy, the group is throughput-first with waits of its own (they grow with the
    backlog); the long-prompt wait there cost bursty bursts at 32 ranks 1.3 % (0.962 -> 0.950
    of ideal at 1.0x)."""
    rs = _rank(dataclasses.replace(_cfg(), busy_tokens=307.0), HEAVY)
    rs.meter.avg = 1.0   # a full step of prefill pending on every rank, on average
    assert rs.meter.busy and _must_at(rs, 200, 0.25) == 200


def test_an_idle_group_does_not_wait_for_the_long_prompts():
    rs = _rank(_cfg(), HEAVY)
    rs.group_idle = rs.group_quiet = True   # a lone step delays no one (idle_wait_ms: none set here)
    assert _must_at(rs, 200, 0.25) == 200


@pytest.mark.parametrize("bad", [dict(long_quantile=1.0), dict(long_quantile=-0.1), dict(long_share=-1.0),
                                 dict(long_window=0)])
def test_long_prompt_settings_are_checked(bad):
    with pytest.raises(ValueError):
        BudgetConfig(**bad)


def test_each_rank_reports_how_long_its_long_prompts_are():
    from services.engine_worker.outputs import _budget_state
    assert _budget_state(_rank(_cfg(), HEAVY))["long_prompt_tokens"] == 10240
    assert _budget_state(_rank(_cfg(), [300] * 10))["long_prompt_tokens"] is None    # too few yet: null, not 0
    assert _budget_state(_rank(_cfg(long_quantile=0.0), HEAVY))["long_prompt_tokens"] is None   # off
