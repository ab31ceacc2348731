"""scripts/bench-table --only: re-run some policies and merge them into the last full run."""

from __future__ import annotations

import pytest

from services.simulator.bench_table import merge


def _sweep(loads, rows):
    return {"points": [{"load": x, "policies": {k: {"eff": v[i]} for k, v in rows.items()}}
                       for i, x in enumerate(loads)]}


def test_merge_replaces_the_rerun_policies_and_keeps_the_others():
    old = _sweep([0.5, 1.0], {"default": [0.9, 0.8], "vllm": [0.7, 0.6]})
    new = _sweep([0.5, 1.0], {"default": [0.95, 0.96]})
    out = merge(old, new)
    assert [p["policies"]["default"]["eff"] for p in out["points"]] == [0.95, 0.96]
    assert [p["policies"]["vllm"]["eff"] for p in out["points"]] == [0.7, 0.6]


def test_merge_refuses_different_load_points():
    with pytest.raises(ValueError, match="different load points"):
        merge(_sweep([0.5, 1.0], {"a": [1, 1]}), _sweep([0.5], {"a": [1]}))


def test_a_sweep_on_another_profile_names_it_in_its_command():
    from services.simulator.bench_table import cmd
    doc = {"config": {"ranks": 16, "api_servers": 4, "workload": "poisson", "requests": 2000, "seed": 1,
                      "dispatch": "each system's own", "profile": "deepseek-v3-gb200"},
           "points": [{"load": 0.5}, {"load": 1.0}]}
    assert "--sweep 0.5,1 --profile deepseek-v3-gb200 --policies" in cmd(doc)
    doc["config"]["profile"] = "default"
    assert "--profile" not in cmd(doc)


def test_a_sweep_with_no_peer_judges_no_goal():
    from services.simulator.bench_table import goal_lines
    m = {"throughput_tok_s": 100.0, "ttft_p99_ms": 50.0, "itl_p99_ms": 10.0, "efficiency_vs_ideal": 0.99}
    doc = {"default": "default",
           "points": [{"load": 1.0, "policies": {"default": m, "least_score": m}}]}
    assert goal_lines(doc) == ["- load 1: no peer in this run — not judged"]
