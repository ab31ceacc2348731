"""shared/measures.py on hand-computed cases."""

import math

import numpy as np
import pytest

from shared import measures
from shared.measures import MeasureAccumulator


def test_step_balance():
    assert measures.step_balance([4, 4, 4, 4]) == 1.0
    assert measures.step_balance([8, 0, 0, 0]) == 0.25
    assert measures.step_balance([0, 0]) is None


def test_balance_ratio_token_weighted_and_skips_empty_steps():
    steps = [[4, 4], [6, 2], [0, 0]]
    # step 1: ratio 1.0, 8 tokens; step 2: mean 4 / max 6 = 2/3, 8 tokens; step 3 ignored
    assert measures.balance_ratio(steps) == pytest.approx((1.0 * 8 + (2 / 3) * 8) / 16)
    steps = [[10, 0], [1, 1]]
    # 0.5 weighted by 10, 1.0 weighted by 2
    assert measures.balance_ratio(steps) == pytest.approx((0.5 * 10 + 1.0 * 2) / 12)
    assert measures.balance_ratio([[0, 0]]) == 1.0
    assert measures.balance_ratio(np.zeros((0, 4))) == 1.0
    assert measures.balance_ratio([[3], [7]]) == 1.0


def test_idle_forward_fraction():
    steps = [[5, 0, 0, 1], [0, 0, 0, 0], [2, 2, 2, 2]]
    # work steps 1 and 3: 8 rank-steps, 2 idle
    assert measures.idle_forward_fraction(steps) == pytest.approx(2 / 8)
    # explicit idle flags: only flagged zero-token ranks count
    idle = [[False, True, False, False], [True] * 4, [False] * 4]
    assert measures.idle_forward_fraction(steps, idle) == pytest.approx(1 / 8)
    assert measures.idle_forward_fraction([[0, 0]]) == 0.0
    assert measures.idle_forward_fraction([[1, 0]]) == 0.5


def test_percentiles_nearest_rank():
    p = measures.percentiles([1, 2, 3, 4])
    assert p == {"p50": 2.0, "p90": 4.0, "p99": 4.0}
    v = list(range(1, 101))
    assert measures.percentile(v, 50) == 50
    assert measures.percentile(v, 90) == 90
    assert measures.percentile(v, 99) == 99
    assert math.isnan(measures.percentile([], 50))


def test_weighted_percentile_equals_repeated_values():
    vals, w = [10.0, 20.0, 30.0], [1, 2, 7]
    rep = [10.0] + [20.0] * 2 + [30.0] * 7
    for q in (10, 25, 50, 90, 99):
        assert measures.percentile(vals, q, weights=w) == measures.percentile(rep, q)
    assert measures.percentile([5.0, 7.0], 50, weights=[0, 3]) == 7.0


def test_throughput_and_efficiency():
    assert measures.throughput(1000, 2.0, 12.0) == 100.0
    assert measures.throughput(1000, 2.0, 2.0) == 0.0
    assert measures.efficiency_vs_ideal(90.0, 100.0) == 0.9
    assert math.isnan(measures.efficiency_vs_ideal(90.0, 0.0))


def test_accumulator_matches_batch_functions():
    rng = np.random.default_rng(3)
    m = rng.integers(0, 50, size=(200, 8))
    m[rng.random(200) < 0.1] = 0
    acc = MeasureAccumulator()
    for row in m.tolist():
        acc.add_step(row)
    assert acc.balance_ratio == pytest.approx(measures.balance_ratio(m))
    assert acc.idle_forward_fraction == pytest.approx(measures.idle_forward_fraction(m))
    assert acc.steps == 200


def test_accumulator_latencies_and_throughput():
    acc = MeasureAccumulator()
    acc.add_request(ttft_s=0.1, e2e_s=1.0, output_tokens=100, arrival=0.0, finish=1.0)
    acc.add_request(ttft_s=0.3, e2e_s=2.0, output_tokens=100, arrival=1.0, finish=4.0)
    acc.add_itl(0.02, count=9)
    acc.add_itl(0.05, count=1)
    s = acc.summary()
    assert s["throughput_tok_s"] == pytest.approx(50.0)
    assert s["ttft_p50_ms"] == pytest.approx(100.0)
    assert s["ttft_p99_ms"] == pytest.approx(300.0)
    assert s["itl_p50_ms"] == pytest.approx(20.0)
    assert s["itl_p99_ms"] == pytest.approx(50.0)
    acc.reset()
    assert acc.steps == 0 and acc.ttft == [] and acc.balance_ratio == 1.0
