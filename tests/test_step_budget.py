"""step_budget: the shared per-step token budget, the deadline rate, plan trimming, and
the simulator's engine model under the budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine_worker.batch import ChunkInput
from services.engine_worker.engine_scheduler import StepPlan
from services.engine_worker.step_budget import (BudgetConfig, allowed, allowed_all, must_tokens,
                                                shared_budget, trim_plan)
from services.simulator import runner
from services.engine_worker.step_view import Action
from services.engine_worker.sequence import Sequence
from services.simulator.engine_group import EngineConfig, EngineGroup
from shared.messages import SamplingParams
from shared.cost_model import CostModel

CFG = BudgetConfig(max_tokens=2048, horizon=4, spread=0.0, min_chunk=0, max_delay_ms=300, step_ms=10)


def test_one_big_prefill_is_capped_to_the_decode_level():
    # rank 0 could prefill 2000 tokens, the others only decode 30: no deadline presses,
    # so rank 0 fills up to the group's decode level instead of a 2030-token step.
    decode = [30] * 4
    tokens = [2030, 30, 30, 30]
    T = shared_budget(decode, tokens, None, CFG)
    assert T == 30
    assert allowed_all(decode, tokens, T) == [30, 30, 30, 30]


def test_level_when_every_rank_has_prefill():
    decode = [10, 10, 10, 10]
    tokens = [410, 810, 1210, 2010]
    T = shared_budget(decode, tokens, None, CFG)
    assert T == 10 + 400 // 4            # the least loaded rank drains over `horizon` steps
    assert allowed_all(decode, tokens, T) == [T] * 4    # a perfectly balanced step


def test_never_below_a_ranks_decodes_and_never_above_max_tokens():
    decode = [100, 5, 0]
    tokens = [100, 5, 3000]
    T = shared_budget(decode, tokens, None, CFG)
    assert T >= 100
    assert allowed(100, 100, T) == 100
    assert shared_budget([0, 0], [5000, 5000], [5000, 5000], CFG) == 2048


def test_no_prefill_anywhere_is_the_decode_max():
    assert shared_budget([3, 7, 0], [3, 7, 0], [3, 7, 0], CFG) == 7
    assert shared_budget([0, 0], [0, 0], None, CFG) == 1


def test_min_chunk_and_spread():
    cfg = BudgetConfig(max_tokens=2048, horizon=1, spread=0.5, min_chunk=16, max_delay_ms=300)
    # levels sorted: 10, 10, 500, 900 -> the median-ish quantile (index 2) is 500
    assert shared_budget([10, 10, 0, 0], [10, 10, 500, 900], None, cfg) == 500
    cfg0 = BudgetConfig(max_tokens=2048, horizon=1, spread=0.0, min_chunk=16)
    assert shared_budget([10, 10, 0, 0], [10, 10, 500, 900], None, cfg0) == 26


def test_a_deadline_raises_the_budget_for_everyone():
    decode = [20, 20, 20]
    tokens = [1020, 520, 20]
    T = shared_budget(decode, tokens, [220, 20, 20], CFG)
    assert T == 220
    assert allowed_all(decode, tokens, T) == [220, 220, 20]   # rank 1 fills up to T too
    # must is capped by what the rank can do
    assert shared_budget(decode, tokens, [5000, 20, 20], CFG) == 1020


def test_must_tokens_is_as_late_as_possible_and_all_at_the_deadline():
    # 1000 tokens, fresh, 300 ms / 10 ms steps = 30 steps left -> 34 tokens a step
    assert must_tokens(5, [(0.0, 1000)], now_ms=0.0, step_ms=0, cfg=CFG) == 5 + 34
    # 150 ms later: 15 steps left
    assert must_tokens(5, [(0.0, 1000)], now_ms=150.0, step_ms=0, cfg=CFG) == 5 + 67
    # at or past the deadline: everything (capped at max_tokens)
    assert must_tokens(5, [(0.0, 1000)], now_ms=299.0, step_ms=0, cfg=CFG) == 1005
    assert must_tokens(0, [(0.0, 5000)], now_ms=400.0, step_ms=0, cfg=CFG) == 2048
    # a younger request behind an older one: cumulative tokens against its own deadline
    got = must_tokens(0, [(0.0, 100), (250.0, 100)], now_ms=0.0, step_ms=0, cfg=CFG)
    assert got == max(-(-100 // 30), -(-200 // 55))
    assert must_tokens(7, [], now_ms=0.0, step_ms=0, cfg=CFG) == 7
    # step_ms=0 in the config: the caller's measured step is used
    cfg = BudgetConfig(max_delay_ms=300, step_ms=0)
    assert must_tokens(0, [(0.0, 1000)], now_ms=0.0, step_ms=100.0, cfg=cfg) == 334


def test_must_tokens_reads_bounded_work():
    pending = ((0.0, 100) for _ in range(10 ** 9))      # would never end if read in full
    assert must_tokens(0, pending, now_ms=0.0, step_ms=10.0, cfg=CFG) >= 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 128), st.integers(0, 2048), st.integers(0, 2048)),
                min_size=1, max_size=40))
def test_budget_properties(rows):
    decode = [d for d, _, _ in rows]
    tokens = [min(2048, d + a) for d, a, _ in rows]
    must = [min(2048, d + m) for d, _, m in rows]
    T = shared_budget(decode, tokens, must, CFG)
    assert 1 <= T <= 2048
    assert T >= max(decode)
    got = allowed_all(decode, tokens, T)
    for d, t, m, g in zip(decode, tokens, must, got):
        assert d <= g <= t or (t < d and g == t)          # decodes first, never above the plan
        assert g >= min(t, m)                             # a deadline is always served
        assert g == t or g == T                           # every capped rank runs exactly T
    assert max(got) <= max(T, max(decode))


def _chunk(sid, start, n, sample, prompt_len):
    return ChunkInput(sid, list(range(start, start + n)), start, [], sample, prompt_len=prompt_len)


def test_trim_plan_cuts_newest_prefill_and_keeps_decodes():
    d1 = Sequence("d1", list(range(40)), SamplingParams(max_tokens=100), generated=list(range(11)))
    d2 = Sequence("d2", list(range(40)), SamplingParams(max_tokens=100), generated=list(range(21)))
    plan = StepPlan(decode_seqs=[d1, d2],
                    prefill_chunks=[_chunk("c", 100, 300, True, 400),      # continuing prefill, finishes
                                    _chunk("n1", 0, 200, False, 500),      # admission, partial
                                    _chunk("n2", 0, 50, True, 50)],        # admission, whole prompt
                    prefill_tokens=550, decode_tokens=2, max_context=400, decode_context=61)
    trim_plan(plan, 2 + 300 + 120)
    assert [c.seq_id for c in plan.chunks] == ["d1", "d2", "c", "n1"]
    assert plan.chunks[3].num_tokens == 120 and plan.chunks[3].sample is False
    assert plan.chunks[2].num_tokens == 300 and plan.chunks[2].sample is True
    assert plan.num_tokens == 422 and plan.prefill_tokens == 420
    assert plan.max_context == 400
    trim_plan(plan, 1)                                     # never below the decodes
    assert [c.seq_id for c in plan.chunks] == ["d1", "d2"] and plan.num_tokens == 2
    assert plan.max_context == 61
    same = trim_plan(plan, 10 ** 6)
    assert same is plan and plan.num_tokens == 2


def test_engine_group_caps_the_big_prefill_and_meets_the_deadline():
    # rank 0: one 2000-token prompt; ranks 1..3: a short request each, decoding for long
    cost = CostModel()
    prompt = np.array([2000, 10, 10, 10]); out = np.array([5, 400, 400, 400])
    cfg = BudgetConfig(max_tokens=2048, max_delay_ms=300, step_ms=10)
    eng = EngineGroup(4, EngineConfig(), cost, prompt, out, out, budget=cfg)
    for i in (1, 2, 3):
        eng.deliver(None, i, i)
    t = 0.0
    s = eng.step(t); t += s.dur_s                     # ranks 1..3 prefill their 10 tokens
    eng.deliver(None, 0, 0)
    t0 = t
    biggest = 0
    while np.isnan(eng.first_t[0]):
        s = eng.step(t)
        assert s is not Action.PAUSE
        biggest = max(biggest, int(s.scheduled[0]))
        t += s.dur_s
    assert biggest < 2000                             # spread over several steps
    assert eng.first_t[0] - t0 <= 0.300 + 0.140       # deadline + at most one full step


def test_budget_spec_is_selectable_and_baselines_unchanged():
    kw = dict(ranks=4, api_servers=2, workload="bursty", requests=300, rate=30.0, seed=3)
    a, _ = runner.run(**kw, policies="least_tokens,aligned,staggered,staggered_aligned")
    b, _ = runner.run(**kw, policies="least_tokens,staggered")
    for name in ("least_tokens", "staggered"):
        assert a["policies"][name] == b["policies"][name]
    for name in ("aligned", "staggered_aligned"):
        assert a["policies"][name]["completed"] == 300
    c, _ = runner.run(**kw, policies="aligned", params={"aligned": {"budget.max_delay_ms": 50}})
    assert c["policies"]["aligned"]["completed"] == 300
    with pytest.raises(ValueError):
        runner.run(**kw, policies="least_tokens", params={"least_tokens": {"budget.horizon": 2}})


def test_the_sim_backends_time_scale_stretches_the_waits_tuned_to_the_device():
    """A sim cluster run n times slower (lockstep up --time-scale n) keeps its prefill waits n
    steps long, as the simulator has them at scale 1: a 200 ms wait on an 80 ms step would be
    2.5 steps instead of 25 (the live benchmark's default ran TTFT-first without this)."""
    from services.engine_worker.step_budget import from_settings
    from shared.settings import EngineSettings
    base = from_settings(EngineSettings(backend="sim"))
    slow = from_settings(EngineSettings(backend="sim", time_scale=10))
    assert (slow.min_delay_ms, slow.max_delay_ms, slow.busy_tau_s, slow.idle_wait_ms, slow.idle_hold_ms) == \
        pytest.approx((10 * base.min_delay_ms, 10 * base.max_delay_ms, 10 * base.busy_tau_s,
                       10 * base.idle_wait_ms, 10 * base.idle_hold_ms))
    assert (base.idle_wait_ms, base.idle_hold_ms) == (30.0, 5.0)
    assert (slow.backlog_steps, slow.max_capped_steps, slow.min_balance) == \
        (base.backlog_steps, base.max_capped_steps, base.min_balance)       # counted in steps: unscaled
    # the waits in full steps: the measured step is already slow, so they scale by themselves
    assert (slow.min_delay_steps, slow.max_delay_steps) == (base.min_delay_steps, base.max_delay_steps) == (1.5, 23.0)
    for same in (EngineSettings(backend="torch", time_scale=10), EngineSettings(backend="sim", time_scale=0)):
        assert from_settings(same) == base                                   # a real device; no device time
    assert EngineSettings(backend="sim", time_scale=10).wait_scale == 10.0
