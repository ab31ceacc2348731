"""Bundled simulator profiles load; the blog calibration runs and reports every figure.

The calibration's closeness to the blog is reported (docs/calibration.md), never asserted:
a small trace is not the blog's 16,000 requests."""

import json
import math

import pytest

from services.simulator import calibrate, profile


@pytest.mark.parametrize("name", profile.bundled())
def test_every_bundled_profile_loads(name):
    p = profile.load(name)
    assert p.name == name
    assert p.source
    assert p.cost.step_ms(1, 0) > 0 and p.cost.idle_ms > 0
    e = p.engine
    assert e.max_num_batched_tokens >= e.max_num_seqs >= 1
    assert e.num_kv_blocks * e.block_size >= e.max_model_len
    assert p.to_dict()["name"] == name


def test_calibrated_profiles_are_bundled():
    assert {"default", "deepseek-v3-gb200", "small-cpu"} <= set(profile.bundled())
    for name in ("deepseek-v3-gb200", "small-cpu"):
        assert "fit" in profile.load(name).extra


def test_unknown_field_is_an_error(tmp_path):
    doc = json.loads((profile.PROFILE_DIR / "default.json").read_text())
    doc["cost"]["warp_ms"] = 1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="unknown cost fields"):
        profile.load(bad)
    doc = json.loads((profile.PROFILE_DIR / "default.json").read_text())
    doc["engine"]["max_batch"] = 4
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="unknown engine fields"):
        profile.load(bad)
    with pytest.raises(ValueError, match="unknown profile"):
        profile.load("no-such-profile")


def test_blog_calibration_reports_every_figure():
    # a small copy: fewer slots so that requests still queue, outputs clipped to stay fast
    doc = calibrate.run(requests=160, engine={"max_num_seqs": 4, "max_num_batched_tokens": 512,
                                              "max_model_len": 2048})
    assert set(doc["rows"]) == set(calibrate.BLOG_ROWS)
    for key, row in doc["rows"].items():
        assert row["policy"] == calibrate.BLOG_ROWS[key][0]
        for k in ("blog_tok_s", "blog_speedup", "blog_balance", "throughput_tok_s", "speedup",
                  "speedup_diff", "balance_blog", "balance_ratio", "balance_diff", "sol_tok_s"):
            assert row[k] is not None, k
        assert row["throughput_tok_s"] > 0
        assert 0 < row["balance_blog"] <= 1 and 0 < row["balance_ratio"] <= 1
        assert row["completed"] == 160
    assert doc["rows"]["baseline"]["speedup"] == pytest.approx(1.0)
    assert "round_robin" in doc["extra"]
    assert "| full_strategy |" in calibrate.table(doc)
    base = doc["rows"]["baseline"]
    assert base["sol_gain"] >= 0 and 0 < base["balance_time"] <= 1
    assert base["balance_time"] == pytest.approx(1 / (1 + base["sol_gain"]))
    assert base["blog_sol_gain"] == pytest.approx(0.5411, abs=5e-5)  # what the blog prints
    assert base["balance_match"]["measure"] == "sol_gain"
    assert doc["rows"]["full_strategy"]["balance_match"]["measure"] == "balance_blog"
    assert "| baseline | 54.11% | sol_gain |" in calibrate.detail_table(doc)


def test_blog_window_figures_are_null_before_the_window():
    import numpy as np

    assert calibrate.window(100) is None and calibrate.window(0) is None
    assert calibrate.window(150) == slice(100, 150)
    assert calibrate.window(20000) == slice(*calibrate.WINDOW)
    assert calibrate.sol_gain(np.zeros(0), np.zeros(0)) is None
    # two equal steps, one balanced and one at half: elapsed / (1 + 0.5) - 1
    assert calibrate.sol_gain(np.ones(2), np.array([1.0, 0.5])) == pytest.approx(1 / 3)


def test_the_cost_models_documented_figures_are_its_constants():
    """shared/cost_model.py and the default profile quote two step times (they drifted from
    the constants, then counted the whole batch's KV where callers pass the longest context):
    a 128-sequence decode at 1k context and a 2,048-token prefill chunk."""
    import shared.cost_model as cm
    from shared.cost_model import CostModel

    for cost in (CostModel(), profile.load("default").cost):
        assert round(cost.step_ms(128, 1000)) == 16      # max_ctx: the longest context (engine_group, worker)
        assert round(cost.step_ms(2048, 2048)) == 131
    assert "~16 ms" in cm.__doc__ and "~131 ms" in cm.__doc__
    assert "~16 ms" in profile.load("default").source and "~131 ms" in profile.load("default").source


def test_blog_trace_keeps_the_blogs_means_under_its_caps():
    from services.simulator import workload

    tr = workload.generate("blog", 20000, 1.0, 0, 1, max_model_len=32768)
    assert tr.prompt.max() <= workload.BLOG_PROMPT_MAX and tr.output.max() <= workload.BLOG_OUTPUT_MAX
    assert tr.prompt.mean() == pytest.approx(803.1, rel=0.02)
    assert tr.output.mean() == pytest.approx(3653.8, rel=0.03)
    # the capped mean is exact in expectation; the median grows as the cap tightens
    assert workload._capped_median(3653.8, 0.9, 1e9) == pytest.approx(3653.8 / math.exp(0.405), rel=1e-6)
    assert workload._capped_median(3653.8, 0.9, 20000) > workload._capped_median(3653.8, 0.9, 1e9)
    with pytest.raises(ValueError):
        workload._capped_median(3653.8, 0.9, 3000)
