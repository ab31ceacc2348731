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


def _m(tp, eff=0.99, tt=50.0, itl=10.0):
    return {"throughput_tok_s": tp, "ttft_p99_ms": tt, "itl_p99_ms": itl, "efficiency_vs_ideal": eff}


def test_a_run_without_the_default_judges_nothing():
    # (--quick --only vllm looked the default's row up and raised KeyError)
    from services.simulator.bench_table import check_markdown, goal_lines
    doc = {"default": None, "points": [{"load": 1.0, "policies": {"vllm": _m(100.0)}}]}
    assert goal_lines(doc) == ["- load 1: the default policy is not in this run — not judged"]
    assert "not in this run" in check_markdown({("poisson", "client"): doc})


def test_the_uniform_check_names_a_peer_never_a_lockstep_policy():
    # (it named least_score "best peer", while the goal lines never counted it as one)
    from services.simulator.bench_table import check_markdown
    doc = {"default": "default", "points": [{"load": 1.0, "policies": {
        "default": _m(100.0), "least_score": _m(200.0), "vllm": _m(90.0)}}]}
    table = check_markdown({("poisson", "client"): doc})
    assert "| vllm:" in table and "least_score" not in table
    only_default = {"default": "default", "points": [{"load": 1.0, "policies": {"default": _m(100.0)}}]}
    assert "no peer in this run" in check_markdown({("poisson", "client"): only_default})


def test_an_efficiency_just_under_the_goal_never_reads_as_the_goal():
    from services.simulator.bench_table import goal_lines
    doc = {"default": "default", "points": [{"load": 1.0, "policies": {
        "default": _m(100.0, eff=0.9496), "vllm": _m(90.0)}}]}
    line = goal_lines(doc)[0]
    assert "efficiency 0.949 (goal >= 0.95) — NOT met" in line


def test_only_refuses_an_unknown_policy_before_running_anything(capsys):
    from services.simulator.bench_table import main
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--only", "bogus"])
    assert exc.value.code == 2
    assert "unknown policies" in capsys.readouterr().err


def test_a_sweep_names_the_default_only_when_it_ran():
    from services.simulator import sweep
    kw = dict(ranks=2, api_servers=1, workload="poisson", requests=30, seed=1)
    assert sweep.load_sweep([0.5], policies="vllm", **kw)["default"] is None
    assert sweep.load_sweep([0.5], policies="default", **kw)["default"] == "default"


def test_goal_tally_counts_each_judged_line_once():
    from services.simulator.bench_table import goal_tally
    lines = ["- load 0.5: throughput 1 vs best peer x 2 tok/s — NOT met; TTFT p99 0.1 s vs best x 0.2 s — met; "
             "ITL p99 5 vs 6 ms — met",
             "- load 1: the default policy is not in this run — not judged"]
    assert goal_tally(lines) == (1, 3)


@pytest.mark.parametrize("argv, says", [(["--workloads", "poisson,nope"], "unknown nope"),
                                        (["--seed", "2", "--only", "default"], "not with --only")])
def test_another_trace_refuses_what_it_cannot_judge_before_running_anything(capsys, argv, says):
    from services.simulator.bench_table import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_another_trace_prints_the_goals_on_that_seed_and_leaves_the_page(monkeypatch, capsys):
    from services.simulator import bench_table as bt
    page = bt.OUT.read_text()
    # a small group and trace, the same code path: the full one runs for minutes
    monkeypatch.setattr(bt, "RANKS", 2)
    monkeypatch.setattr(bt, "API_SERVERS", 1)
    monkeypatch.setattr(bt, "REQUESTS", 40)
    monkeypatch.setattr(bt, "LOADS", (0.5,))
    monkeypatch.setattr(bt, "POLICIES", "default,trtllm_adp_placement_only")
    bt.main(["--seed", "3", "--workloads", "poisson", "--profile", "deepseek-v3-gb200", "--jobs", "1"])
    out = capsys.readouterr().out
    assert "## poisson (deepseek-v3-gb200), seed 3:" in out
    assert "--seed 3 --sweep 0.5 --profile deepseek-v3-gb200" in out
    assert "best peer trtllm_adp_placement_only" in out
    missed, judged = (int(x) for x in out.rsplit("seed 3, poisson: ", 1)[1].split(" goal lines")[0].split(" of "))
    assert judged == 3 and 0 <= missed <= 3
    assert bt.OUT.read_text() == page
