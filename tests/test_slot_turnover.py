"""The requests a rank's slots let it finish per step (services/engine_worker/slot_turnover.py)."""

import pytest

from services.engine_worker.slot_turnover import SlotTurnover


def test_nothing_finished_is_no_figure():
    t = SlotTurnover(max_num_seqs=128, max_tokens=2048, kv_tokens=10**6)
    assert t.per_step == 0.0 and t.per_s(130.0) == 0.0


def test_slots_over_the_steps_a_request_holds_one():
    t = SlotTurnover(max_num_seqs=128, max_tokens=2048, kv_tokens=10**6)
    for _ in range(100):
        t.finished(prompt_tokens=200, generated=40)          # one prefill step rides with the first token
    assert t.per_step == pytest.approx(128 / 40)
    # a step computes every slot's decode and 3.2 new prompts: 768 tokens of a 2,048 step
    assert t.step_tokens == pytest.approx(128 + 3.2 * 200)
    assert t.per_s(130.0) == pytest.approx(3.2 * 1000 / (130 * 768 / 2048))
    assert t.per_s(130.0, fixed_ms=10.0) == pytest.approx(3.2 * 1000 / (10 + 120 * 768 / 2048))
    assert t.per_s(0.0) == 0.0                                 # no full step timed: no rate


def test_decode_heavy_steps_are_not_taken_for_full_ones():
    # long outputs: 128 decodes and a tenth of a prompt a step, ~20 ms where a full step
    # takes 131: at the full step's pace the wait read was six times too long
    t = SlotTurnover(max_num_seqs=128, max_tokens=2048, kv_tokens=10**7)
    for _ in range(10):
        t.finished(prompt_tokens=100, generated=1_000)
    assert t.step_tokens == pytest.approx(128 + 0.128 * 100)
    assert t.per_s(131.0, fixed_ms=8.0) == pytest.approx(0.128 * 1000 / (8 + 123 * 140.8 / 2048))
    assert t.per_s(131.0, fixed_ms=8.0) > 5 * 0.128 * 1000 / 131.0


def test_a_long_prompts_chunks_hold_the_slot_too():
    t = SlotTurnover(max_num_seqs=8, max_tokens=2048, kv_tokens=10**6)
    t.finished(prompt_tokens=16_384, generated=10)           # 8 chunks: 7 steps before the first token
    assert t.per_step == pytest.approx(8 / 17)


def test_the_kv_cache_bounds_the_slots():
    t = SlotTurnover(max_num_seqs=128, max_tokens=2048, kv_tokens=16 * 256)
    t.finished(prompt_tokens=900, generated=100)            # 1,000 tokens each: 4 fit
    assert t.slots == pytest.approx(4.096)
    assert t.per_step == pytest.approx(4.096 / 100)


def test_the_means_follow_recent_requests():
    t = SlotTurnover(max_num_seqs=128, max_tokens=2048, kv_tokens=10**6)
    t.finished(200, 10)
    for _ in range(300):
        t.finished(200, 100)
    assert t.per_step == pytest.approx(1.28, rel=0.01)
