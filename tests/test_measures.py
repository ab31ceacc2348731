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
    assert measures.balance_ratio([[0, 0]]) is None
    assert measures.balance_ratio(np.zeros((0, 4))) is None
    assert measures.balance_ratio([[3], [7]]) == 1.0


def test_idle_forward_fraction():
    steps = [[5, 0, 0, 1], [0, 0, 0, 0], [2, 2, 2, 2]]
    # work steps 1 and 3: 8 rank-steps, 2 idle
    assert measures.idle_forward_fraction(steps) == pytest.approx(2 / 8)
    # explicit idle flags: only flagged zero-token ranks count
    idle = [[False, True, False, False], [True] * 4, [False] * 4]
    assert measures.idle_forward_fraction(steps, idle) == pytest.approx(1 / 8)
    assert measures.idle_forward_fraction([[0, 0]]) is None
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
    assert measures.throughput(1000, 2.0, 2.0) is None      # no span: no data
    assert measures.throughput(0, 2.0, 12.0) == 0.0          # zero tokens over a real span: data
    assert measures.efficiency_vs_ideal(90.0, 100.0) == 0.9
    assert measures.efficiency_vs_ideal(90.0, 0.0) is None
    assert measures.efficiency_vs_ideal(90.0, None) is None
    assert measures.efficiency_vs_ideal(None, 100.0) is None


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
    assert acc.steps == 0 and acc.ttft == [] and acc.balance_ratio is None


# --- no data is not a perfect figure (issue #12, item 8) --------------------------------

def test_no_work_gives_none_for_balance_and_idle_fraction():
    for no_work in ([], [[]], np.zeros((0, 4)), [[0, 0, 0]], [[0, 0], [0, 0], [0, 0]]):
        assert measures.balance_ratio(no_work) is None, no_work
        assert measures.idle_forward_fraction(no_work) is None, no_work
    assert measures.idle_forward_fraction([[0, 0], [0, 0]], [[True, True], [False, True]]) is None


def test_accumulator_without_data_gives_none():
    acc = MeasureAccumulator()
    assert acc.balance_ratio is None
    assert acc.idle_forward_fraction is None
    assert acc.throughput is None
    assert all(v is None for v in acc.summary().values()), acc.summary()
    acc.add_step([0, 0], [True, True])          # steps, but none with work
    assert acc.steps == 1 and acc.balance_ratio is None and acc.idle_forward_fraction is None
    acc.add_request(output_tokens=10, arrival=3.0, finish=3.0)   # an empty span
    assert acc.throughput is None
    acc.add_step([4, 0])
    assert acc.balance_ratio == 0.5 and acc.idle_forward_fraction == 0.5


def _stat(t: float, step: int, rank: int, scheduled: int, idle: bool = False) -> dict:
    return {"t": t, "wave": 0, "step": step, "rank": rank, "scheduled": scheduled, "idle": idle,
            "prefill": 0, "dur_ms": 1.0}


def test_bench_report_without_step_stats_is_an_error_with_null_figures():
    from services.admin.bench_measures import engine_report

    sm = engine_report([], 2, 100.0, 200.0, "wrongns", "redis://user:secret@db:6379/0")
    assert sm["steps"] == 0 and sm["work_steps"] == 0
    assert sm["balance_ratio"] is None and sm["idle_forward_fraction"] is None
    err = sm["error"]
    assert "read no step stats from wrongns:stats" in err
    assert "--namespace" in err and "'wrongns'" in err and "--redis-url" in err
    assert "same Redis URL" in err and "null" in err
    assert "secret" not in err and "db:6379" in err
    # stats were read, but none inside the run window: still no data, and it says so
    sm = engine_report([_stat(10.0, 1, 0, 5), _stat(10.0, 1, 1, 5)], 2, 100.0, 200.0, "ls", None)
    assert sm["balance_ratio"] is None and sm["idle_forward_fraction"] is None
    assert "2 step stats were read, none inside the run window" in sm["error"]


def test_bench_report_with_step_stats_has_figures_and_no_error():
    from services.admin.bench_measures import engine_report

    rows = [_stat(150.0, 1, 0, 10), _stat(150.0, 1, 1, 0, idle=True),
            _stat(151.0, 2, 0, 4), _stat(151.0, 2, 1, 4)]
    sm = engine_report(rows, 2, 100.0, 200.0, "ls", "redis://db:6379/0")
    assert "error" not in sm
    assert sm["steps"] == 2
    assert sm["balance_ratio"] == pytest.approx(measures.balance_ratio([[10, 0], [4, 4]]))
    assert sm["idle_forward_fraction"] == pytest.approx(1 / 4)
    # steps, none with work: the figures are null, but the stats were read (no error)
    sm = engine_report([_stat(150.0, 1, 0, 0), _stat(150.0, 1, 1, 0)], 2, 100.0, 200.0, "ls", None)
    assert "error" not in sm and sm["balance_ratio"] is None and sm["idle_forward_fraction"] is None


def test_watch_measures_without_work_are_null():
    from services.admin.watch import measures_of

    snaps = [{"ranks": {"0": {"scheduled": 0, "idle": False}, "1": {"scheduled": 0, "idle": False}}}]
    m = measures_of(snaps, 10.0)
    assert m["steps"] == 1 and m["balance_ratio"] is None and m["idle_forward_fraction"] is None


def test_goal_lines_say_no_data():
    from services.simulator import bench_table

    none = {"throughput_tok_s": None, "efficiency_vs_ideal": None, "ttft_p99_ms": None, "itl_p99_ms": None}
    doc = {"default": "default", "points": [
        {"load": 0.5, "policies": {"default": dict(none), "vllm": dict(none)}},
        {"load": 1.0, "policies": {"default": dict(none), "vllm": dict(none)}}]}
    text = "\n".join(bench_table.goal_lines(doc))
    assert "throughput no data vs best peer vllm no data — NOT met" in text
    assert "TTFT p99 no data vs best vllm no data — NOT met" in text
    assert "efficiency no data (goal >= 0.95) — NOT met" in text
    assert "ITL p99 no data vs no data — NOT met" in text


def test_lockstep_bench_json_without_step_stats_exits_1_with_error(monkeypatch):
    import json

    import typer
    from typer.testing import CliRunner

    from services.admin import bench_cmd, bench_measures

    async def fake_run_bench(url, redis_url, namespace, *a, **kw):
        doc = {"url": url, "namespace": namespace, "model": "m", "trace": "poisson", "requests": 1,
               "completed": 1, "failed": 0, "throughput_tok_s": 10.0}
        doc.update(bench_measures.engine_report([], 2, 0.0, 1.0, namespace, redis_url))
        return doc

    monkeypatch.setattr(bench_cmd, "run_bench", fake_run_bench)
    app = typer.Typer()
    bench_cmd.register(app)
    app.command("noop")(lambda: None)       # two commands: `bench` stays a sub-command
    res = CliRunner().invoke(app, ["bench", "--url", "http://x", "--redis-url", "redis://h:1/0",
                                   "--namespace", "wrongns", "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.stdout.strip().splitlines()[0])
    assert doc["balance_ratio"] is None and doc["idle_forward_fraction"] is None
    assert "--namespace" in doc["error"] and "'wrongns'" in doc["error"]
    assert "read no step stats" in res.stderr


def test_lockstep_bench_load_runs_at_a_fraction_of_the_measured_capacity(monkeypatch):
    import json

    import typer
    from typer.testing import CliRunner

    from services.admin import bench_cmd

    calls = []

    async def fake_run_bench(url, redis_url, namespace, workload, requests, rate, seed, trace, *a, at_once=False, **kw):
        calls.append((rate, at_once))
        # the probe: 10 requests all at once take 2 s -> capacity 5 requests/s
        return {"url": url, "namespace": namespace, "model": "m", "trace": workload, "requests": requests,
                "completed": requests, "failed": 0, "duration_s": 2.0 if at_once else 9.0,
                "throughput_tok_s": 1.0, "balance_ratio": 0.9, "idle_forward_fraction": 0.0}

    monkeypatch.setattr(bench_cmd, "run_bench", fake_run_bench)
    app = typer.Typer()
    bench_cmd.register(app)
    app.command("noop")(lambda: None)
    base = ["bench", "--url", "http://x", "--redis-url", "redis://h:1/0", "--requests", "10", "--json"]
    res = CliRunner().invoke(app, base + ["--load", "1.2"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert calls == [(bench_cmd.DEFAULT_RATE, True), (pytest.approx(6.0), False)]
    assert doc["capacity_rps"] == pytest.approx(5.0) and doc["rate"] == pytest.approx(6.0)
    assert doc["capacity_measured"] is True and doc["capacity_probe"]["completed"] == 10
    calls.clear()                           # a given capacity is not measured
    res = CliRunner().invoke(app, base + ["--load", "0.5", "--capacity", "8"])
    assert res.exit_code == 0 and calls == [(pytest.approx(4.0), False)]
    res = CliRunner().invoke(app, base + ["--capacity", "8"])
    assert res.exit_code == 2 and "only applies with --load" in res.stderr
