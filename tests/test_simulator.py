"""The simulator: deterministic, measures right on cases small enough to reason about,
every request completes under every policy, and the CLI prints one JSON object."""

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from services.admin.simulate_cmd import register
from services.simulator import profile as profile_mod, runner, sim, workload
from services.simulator.baselines import POLICY_NAMES
from services.engine_worker.step_view import Action
from services.simulator.engine_group import EngineConfig, EngineGroup
from shared.cost_model import CostModel
from shared.policy.base import Assignment


def _trace(tmp_path, rows):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_deterministic_json(tmp_path):
    kw = dict(ranks=4, api_servers=2, workload="bursty", requests=300, rate=20.0, seed=5,
              policies="least_score,vllm,staggered,trtllm_adp_balance")
    a, _ = runner.run(**kw)
    b, _ = runner.run(**kw)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c, _ = runner.run(**{**kw, "seed": 6})
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)


def test_trace_file_round_trip_is_deterministic(tmp_path):
    tr = workload.generate("heavy-tail", 200, 15.0, 1, api_servers=3)
    p = tmp_path / "t.jsonl"
    workload.dump_jsonl(tr, p)
    a, _ = runner.run(ranks=3, api_servers=3, trace=p, policies="vllm,least_tokens")
    b, _ = runner.run(ranks=3, api_servers=3, trace=p, policies="vllm,least_tokens")
    assert a == b
    assert a["config"]["requests"] == 200


@pytest.mark.timeout(120)
def test_a_replayed_trace_starts_at_zero_whatever_its_clock(tmp_path):
    # epoch-stamped traces gave other figures than the same trace from 0 (the gaps lost
    # their precision), and at 1e15 s the simulator hung (a poll did not advance its clock)
    tr = workload.generate("poisson", 60, 10.0, 1, api_servers=1)
    docs = []
    for offset in (0.0, 1.7e9, 1e15):
        p = tmp_path / f"t{offset:g}.jsonl"
        workload.dump_jsonl(workload.Trace(t=tr.t + offset, prompt=tr.prompt, output=tr.output, api=tr.api,
                                           name=tr.name), p)
        doc, _ = runner.run(ranks=2, api_servers=1, trace=p, policies="default,vllm")
        docs.append({k: v["ttft_p50_ms"] for k, v in doc["policies"].items()})
    for k in docs[0]:
        assert abs(docs[1][k] - docs[0][k]) < 1e-3 * docs[0][k], docs   # 1.7e9 keeps ~0.1 us of precision
        assert docs[2][k] > 0, docs   # 1e15 keeps 1/8 s (the file's own precision), and it ends: no hang


def test_one_rank_is_balanced_and_never_idle():
    doc, _ = runner.run(ranks=1, api_servers=2, workload="poisson", requests=200, rate=5.0,
                        policies="all")
    for name, p in doc["policies"].items():
        assert p["balance_ratio"] == 1.0, name
        assert p["idle_forward_fraction"] == 0.0, name
        assert p["completed"] == 200, name


def test_two_ranks_one_request_idles_half(tmp_path):
    p = _trace(tmp_path, [{"t": 0.0, "prompt_tokens": 100, "output_tokens": 10}])
    doc, res = runner.run(ranks=2, api_servers=1, trace=p, policies="least_score,round_robin,staggered")
    for name, m in doc["policies"].items():
        assert m["completed"] == 1
        assert m["idle_forward_fraction"] == 0.5, name
        assert m["balance_ratio"] == 0.5, name
    r = res[0]
    # one prefill step then 9 decode steps, each with one rank working
    assert r.scheduled.shape == (10, 2)
    assert sorted(r.scheduled.max(axis=1).tolist()) == [1] * 9 + [100]
    assert (r.scheduled.min(axis=1) == 0).all()


def test_a_batch_reaches_a_scheduler_over_the_hops_jitter(tmp_path):
    """The api-server -> scheduler hop has its jitter like every other: a batch sent at one
    instant does not reach the dispatcher in one instant. TensorRT-LLM's idle executor
    blocks for one request and starts it alone (executor_request_queue.py
    _get_from_request_queue, batch_wait_timeout_ms=0), so its first step has one request."""
    p = _trace(tmp_path, [{"t": 0.0, "prompt_tokens": 500, "output_tokens": 4}] * 64)
    _, (r,) = runner.run(ranks=4, api_servers=2, trace=p, policies="trtllm_adp_placement_only")
    assert r.scheduled[0].tolist().count(0) == 3 and r.scheduled[0].max() == 500
    assert r.scheduled[1].min() > 0                      # the rest arrived during that step
    cfg = sim.SimConfig(jitter_ms=0.0)                   # with no jitter they do arrive at once
    _, (r0,) = runner.run(ranks=4, api_servers=2, trace=p, policies="trtllm_adp_placement_only", cfg=cfg)
    assert r0.scheduled[0].min() > 0


def test_every_request_completes_under_every_policy():
    doc, _ = runner.run(ranks=4, api_servers=3, workload="heavy-tail", requests=400, rate=40.0,
                        policies="all")
    assert set(doc["policies"]) == set(POLICY_NAMES)
    for name, p in doc["policies"].items():
        assert p["completed"] == 400, name
        assert 0.0 < p["balance_ratio"] <= 1.0
        assert 0.0 <= p["idle_forward_fraction"] < 1.0
        assert p["efficiency_vs_ideal"] > 0.5
        for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "throughput_tok_s"):
            assert p[k] is not None and p[k] > 0, (name, k)


def test_step_time_follows_the_busiest_rank():
    cost = CostModel(fixed_ms=10.0, token_ms=1.0, ctx_ms_per_1k=0.0)
    prompt = np.array([50, 5]); out = np.array([1, 1])
    eng = EngineGroup(2, EngineConfig(), cost, prompt, out, out)
    eng.deliver(None, 0, 0)
    eng.deliver(None, 1, 1)
    s = eng.step(0.0)
    assert s.scheduled.tolist() == [50, 5]
    assert s.dur_s == pytest.approx(0.060)          # 10 + 1 * max(50, 5) ms
    assert sorted(s.finished) == [0, 1]
    assert eng.step(s.dur_s) is Action.PAUSE         # nothing left: the group pauses


def test_a_shared_token_cost_follows_the_ranks_mean():
    # experts fed by every rank: that part of the step follows the group's mean, not the busiest
    cost = CostModel(fixed_ms=10.0, token_ms=1.0, ctx_ms_per_1k=0.0, shared_token_ms=0.5)
    prompt = np.array([50, 10]); out = np.array([1, 1])
    eng = EngineGroup(2, EngineConfig(), cost, prompt, out, out)
    eng.deliver(None, 0, 0)
    eng.deliver(None, 1, 1)
    assert eng.step(0.0).dur_s == pytest.approx(0.075)   # 10 + 1 * 50 + 0.5 * (50 + 10) / 2 ms


def test_chunked_prefill_kv_budget_and_seq_limit():
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=2, num_kv_blocks=10, block_size=16)
    prompt = np.array([100, 10, 10]); out = np.array([3, 3, 3])
    eng = EngineGroup(1, cfg, CostModel(), prompt, out, out)
    for i in range(3):
        eng.deliver(None, i, 0)
    s = eng.step(0.0)
    # request 0 takes the whole budget; request 2 has no seq slot until one finishes
    assert s.scheduled.tolist() == [64]
    s = eng.step(1.0)
    assert s.scheduled.tolist() == [36 + 10]         # rest of 0's prompt + 1's prompt
    while eng.done < 3:
        assert isinstance(eng.step(2.0), sim.StepOut)
    assert np.isfinite(eng.finish_t).all()


def test_the_simulator_drives_the_engines_own_scheduler_and_gate():
    """No second implementation: every simulated rank is the live engine's RankStep."""
    from services.engine_worker.batch_gate import BatchGate as LiveGate
    from services.engine_worker.rank_step import RankStep
    from services.engine_worker.engine_scheduler import EngineScheduler
    eng = EngineGroup(2, EngineConfig(), CostModel(), np.array([10]), np.array([2]), np.array([100]))
    assert all(type(r) is RankStep and type(r.core) is EngineScheduler and type(r.gate) is LiveGate
               for r in eng.ranks)
    import services.simulator as pkg
    import pathlib
    src = "\n".join(p.read_text() for p in pathlib.Path(pkg.__file__).parent.glob("*.py"))
    for name in ("def schedule(", "def postprocess(", "def shared_budget(", "def after_exchange(",
                 "class BlockManager", "def allocate("):
        assert name not in src, f"the simulator has its own copy of {name}"


def test_batch_gate_waits_for_the_whole_batch_or_its_timeout():
    prompt = np.array([10, 10]); out = np.array([2, 2])
    eng = EngineGroup(2, EngineConfig(), CostModel(), prompt, out, out, gate_timeout_s=0.05)
    a0 = Assignment("0", 0, batch="scheduler-1", batch_counts=(1, 1), dispatcher="s", seq=1)
    eng.deliver(a0, 0)
    assert eng.step(0.0) is Action.HOLD               # rank 1's share has not arrived
    assert eng.recv[0] == {"s": 1}
    a1 = Assignment("1", 1, batch="scheduler-1", batch_counts=(1, 1), dispatcher="s", seq=1)
    eng.deliver(a1, 1)
    s = eng.step(0.01)
    assert s.prefill.tolist() == [10, 10]            # both ranks prefill in the same step
    eng2 = EngineGroup(2, EngineConfig(), CostModel(), prompt, out, out, gate_timeout_s=0.05)
    eng2.deliver(a0, 0)
    assert eng2.step(0.0) is Action.HOLD
    assert eng2.step(0.049) is Action.HOLD
    t = 0.05
    while (s := eng2.step(t)) is Action.HOLD:        # rank 0 decides the timeout, all ranks follow
        t += 0.002
        assert t < 0.06
    assert s.prefill.tolist() == [10, 0]


def test_no_policy_sees_the_true_output_length():
    tr = workload.generate("poisson", 40, 20.0, 2, api_servers=1)
    seen = []

    class Spy:
        def __init__(self, **kw):
            from shared.policy.dispatch import RoundRobin
            self.inner = RoundRobin(dispatcher_id="scheduler", ranks=[0, 1])

        def __getattr__(self, k):
            return getattr(self.inner, k)

        def choose(self, req, now):
            seen.append(req.max_tokens)
            return self.inner.choose(req, now)

    cfg = sim.SimConfig(ranks=2, api_servers=1)
    spec = sim.resolve_policies("round_robin", cfg)[0]
    import dataclasses
    r = sim.run_policy(tr, dataclasses.replace(spec, factory=lambda **kw: Spy()), cfg)
    assert r.completed == 40
    assert seen == (cfg.engine.max_model_len - tr.prompt).tolist()   # the client's cap, never the truth
    assert r.output.tolist() == tr.output.tolist()                    # yet each ends at its true length


def test_engines_echo_dispatch_seq_in_stats():
    tr = workload.generate("poisson", 50, 20.0, 2, api_servers=2)
    cfg = sim.SimConfig(ranks=3, api_servers=2)
    spec = sim.resolve_policies("vllm", cfg)[0]
    r = sim.run_policy(tr, spec, cfg)
    assert r.completed == 50
    assert r.counters["aggregator"]["published"] > 0


def _simulate_cli(args):
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps typer in sub-command mode
        pass

    return CliRunner().invoke(app, ["simulate", *args])


def test_cli_json_is_one_object(tmp_path):
    png = tmp_path / "p.png"
    res = _simulate_cli(["--ranks", "2", "--api-servers", "2", "--requests", "60", "--rate", "10",
                         "--policies", "least_score,vllm", "--json", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) >= {"config", "policies"}
    for p in doc["policies"].values():
        assert set(p) >= {"balance_ratio", "idle_forward_fraction", "ttft_p50_ms", "ttft_p99_ms",
                          "itl_p50_ms", "throughput_tok_s", "efficiency_vs_ideal", "completed"}
    assert png.stat().st_size > 1000


def test_a_sweep_runs_on_the_given_cost_model(tmp_path):
    # (the sweep once ignored --cost-model and ran the profile's cost silently)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"fixed_ms": 16.0, "token_ms": 0.12, "ctx_ms_per_1k": 0.1, "idle_ms": 16.0}))
    args = ["--ranks", "2", "--requests", "40", "--workload", "poisson", "--sweep", "0.5",
            "--policies", "least_score", "--json"]
    base, slowed = _simulate_cli(args), _simulate_cli([*args, "--cost-model", str(slow)])
    assert base.exit_code == 0 and slowed.exit_code == 0, (base.output, slowed.output)
    cap = json.loads(base.stdout)["capacity"]["requests_per_s"]
    doc = json.loads(slowed.stdout)
    # every step takes twice as long: half the capacity
    assert doc["capacity"]["requests_per_s"] == pytest.approx(cap / 2, rel=0.05)
    assert doc["config"]["cost_model"] == str(slow)


def test_a_sweep_refuses_a_trace_it_would_not_replay(tmp_path):
    trace = _trace(tmp_path, [{"t": 0.0, "prompt_tokens": 10, "output_tokens": 2}])
    res = _simulate_cli(["--sweep", "0.5", "--trace", str(trace)])
    assert res.exit_code == 2 and "--sweep" in res.output and "--trace" in res.output


def test_fixed_in_out_sets_both_lengths():
    """`--workload fixed:IN:OUT` (benchmark_serving's --random-input-len / --random-output-len):
    every request those lengths, Poisson arrivals as `fixed`; `fixed` stays 1,024 / 128."""
    tr = workload.generate("fixed:4096:256", 200, 20.0, 1, api_servers=2, max_model_len=8192)
    assert set(tr.prompt.tolist()) == {4096} and set(tr.output.tolist()) == {256}
    assert workload.fixed_lengths("fixed") == (workload.FIXED_PROMPT, workload.FIXED_OUTPUT)
    assert workload.fixed_lengths("poisson") is None


@pytest.mark.parametrize("kind", ["fixed:4096", "fixed:0:128", "fixed:a:b", "fixed:1:2:3", "fixed:-1:5", "fixed:\u00b2:5", "fixd"])
def test_a_malformed_workload_is_refused_with_what_to_write(kind):
    with pytest.raises(ValueError, match="fixed:IN:OUT"):
        workload.generate(kind, 10, 1.0, 1)
    res = _simulate_cli(["--workload", kind, "--requests", "5", "--policies", "least_score"])
    assert res.exit_code == 2 and "fixed:IN:OUT" in res.output


def test_a_sweep_runs_a_fixed_shape():
    res = _simulate_cli(["--ranks", "2", "--requests", "40", "--workload", "fixed:512:16", "--sweep", "0.5",
                         "--policies", "least_score", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["config"]["workload"] == "fixed:512:16" and doc["points"][0]["policies"]["least_score"]["completed"] == 40


def test_cli_rejects_unknown_policy():
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def _noop() -> None:
        pass

    res = CliRunner().invoke(app, ["simulate", "--policies", "nope", "--requests", "5"])
    assert res.exit_code == 2


def test_a_policy_that_never_releases_at_its_deadline_fails_instead_of_hanging():
    tr = workload.generate("poisson", 5, 10.0, 1, api_servers=1)

    class Stuck:
        def __init__(self, **kw):
            pass

        def set_ranks(self, ranks):
            pass

        def on_snapshot(self, snap):
            pass

        def submit(self, req, now):
            return []

        def poll(self, now):
            return []

        def next_deadline(self):
            return 0.0

    cfg = sim.SimConfig(ranks=2, api_servers=1)
    import dataclasses
    spec = dataclasses.replace(sim.resolve_policies("round_robin", cfg)[0], factory=lambda **kw: Stuck())
    with pytest.raises(RuntimeError, match="released nothing at its own deadline"):
        sim.run_policy(tr, spec, cfg)


def test_the_ideal_run_in_a_forked_process_equals_the_one_in_line(monkeypatch):
    from services.simulator import runner as runner_mod
    kw = dict(ranks=4, api_servers=2, workload="bursty", requests=200, rate=20.0, seed=5, policies="least_score")
    monkeypatch.setattr(runner_mod._IdealRun, "MIN_REQUESTS", 10**9)
    inline, _ = runner_mod.run(**kw)
    monkeypatch.setattr(runner_mod._IdealRun, "MIN_REQUESTS", 1)
    forked, _ = runner_mod.run(**kw)
    strip = lambda d: {k: v for k, v in d.items() if k != "wall_s"}   # noqa: E731
    assert strip(forked["ideal"]) == strip(inline["ideal"])
    assert {k: strip(v) for k, v in forked["policies"].items()} == {k: strip(v) for k, v in inline["policies"].items()}


def test_the_ideal_pays_the_longest_context_in_full():
    """The ideal balances tokens over the ranks, not one sequence's attention: a lone
    8,192-token request decodes at step_ms(1 / ranks tokens, its whole context), as it would
    on any rank of a real group (the ideal once divided the context by the ranks too)."""
    cost = CostModel(fixed_ms=1.0, token_ms=0.0, ctx_ms_per_1k=10.0, idle_ms=1.0)
    tr = workload.Trace(t=np.zeros(1), prompt=np.array([8192]), output=np.array([4]),
                        api=np.zeros(1, dtype=np.int64), max_tokens=np.array([4]))
    cfg = sim.SimConfig(ranks=4, cost=cost, engine=EngineConfig(max_model_len=16384))
    ideal = sim.run_ideal(tr, cfg)
    decode_ms = ideal.step_dur[-1] * 1000.0            # the last step decodes at context 8,195
    assert decode_ms == pytest.approx(cost.step_ms(1, 8195), abs=0.5)   # 82.95 ms, not 21.5
    real = sim.run_policy(tr, sim.resolve_policies("least_score", cfg)[0], cfg)
    assert real.step_dur[-1] * 1000.0 == pytest.approx(decode_ms, abs=0.5)


@pytest.mark.timeout(120)
def test_a_request_no_rank_can_run_is_rejected_not_completed():
    # it was counted in 'done' (finish time = its rejection), and dispatchers that track
    # finishes never heard of it
    n = 12
    caps = np.full(n, 8, dtype=np.int64)
    caps[[3, 7]] = 40000                      # 100 + 40000 tokens: past max_model_len (32768)
    tr = workload.Trace(t=np.arange(n) * 0.01, prompt=np.full(n, 100, dtype=np.int64),
                        output=np.full(n, 8, dtype=np.int64), api=np.zeros(n, dtype=np.int64),
                        name="rej", max_tokens=caps)
    doc, _ = runner.run(ranks=2, api_servers=1, tr=tr, policies="all")
    for name, p in doc["policies"].items():
        assert p["completed"] == n - 2, name
        assert p["rejected"] == 2, name


def test_a_profile_whose_kv_cannot_hold_one_request_is_refused(tmp_path):
    doc = json.loads((profile_mod.PROFILE_DIR / "default.json").read_text())
    doc["engine"].update(num_kv_blocks=64, block_size=16, max_model_len=4096)
    bad = tmp_path / "small-kv.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="at least 256"):
        profile_mod.load(bad)


def test_generated_requests_cut_to_max_model_len_are_counted():
    tr = workload.generate("heavy-tail", 400, 10.0, 1, max_model_len=4096)
    assert tr.clipped > 0 and tr.describe()["clipped_requests"] == tr.clipped
    assert (tr.prompt + tr.output <= 4096).all()


def test_a_policy_named_twice_runs_once():
    doc, res = runner.run(ranks=2, api_servers=1, workload="poisson", requests=20, rate=5.0,
                          policies="least_score,least_score")
    assert list(doc["policies"]) == ["least_score"] and len(res) == 1


def test_python_m_simulator_help_shows_flags_without_a_type():
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "services.simulator", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "120"}).stdout
    assert "--json" in out and "<bool>" not in out


def test_a_trace_keeps_its_own_fields_and_whole_floats(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"t": 0.5, "prompt_tokens": 12.0, "output_tokens": 3, "id": "req-7", "model": "m"}\n')
    tr = workload.load_jsonl(p)
    assert (int(tr.prompt[0]), int(tr.output[0])) == (12, 3)
