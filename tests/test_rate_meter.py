"""The decaying rate behind coordinated prefill's lone share (shared/rate_meter.py)."""

from __future__ import annotations

import math

import pytest

from shared.rate_meter import RateMeter


def test_nothing_added_reads_zero():
    assert RateMeter(10.0).rate(5.0) == 0.0


def test_a_steady_rate_reads_as_itself_from_the_start():
    m = RateMeter(10.0)
    for k in range(1, 21):             # 100 tokens every 0.1 s: 1,000 tokens/s
        m.add(100, k * 0.1)
    assert m.rate(2.0) == pytest.approx(1000, rel=0.06)    # 2 s in: not 2,000 tokens / 10 s
    for k in range(21, 301):
        m.add(100, k * 0.1)
    assert m.rate(30.0) == pytest.approx(1000, rel=0.06)


def test_a_first_burst_is_read_over_the_time_it_had_not_the_whole_window():
    m = RateMeter(10.0)
    m.add(10_000, 0.0)
    assert m.rate(0.0) == pytest.approx(10_000 / 10.0 / -math.expm1(-0.1), rel=1e-9)   # ~10,500/s
    assert m.rate(0.0) > 10 * 10_000 / 10.0 / 2


def test_it_decays_once_arrivals_stop():
    m = RateMeter(10.0)
    for k in range(1, 301):
        m.add(100, k * 0.1)
    # 10 s with nothing: the decayed sum falls by e (the normalisation by the time it had
    # grows meanwhile: the first tokens came at 0.1 s)
    assert m.rate(40.0) == pytest.approx(m.rate(30.0) * math.exp(-1.0) * math.expm1(-2.99) / math.expm1(-3.99))


def test_the_window_must_be_positive():
    with pytest.raises(ValueError):
        RateMeter(0.0)
