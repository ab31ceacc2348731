"""Every option a `lockstep` command accepts is honored, or the combination that would make
it moot is refused at once with what to use instead (exit 2, no traceback): the rule of
`lockstep up` ("every combination up accepts works"), for every command. Each case here was
an option silently ignored, or a crash, on some path.

Nothing here starts a cluster: `up` and `chaos` get a stand-in that fails loudly if they
get as far as starting one (what they did before the refusals)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.admin import bench_cmd, chaos
from services.admin.cli import app
from services.admin.up import port_taken as PORT_TAKEN


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture()
def no_start(monkeypatch, tmp_path):
    """`lockstep up` that gets past its checks reports 'would start' (exit 1), starting nothing."""
    from services.admin import up as up_mod

    class NoCluster(up_mod.LocalCluster):
        def start(self) -> None:
            raise RuntimeError("would start a cluster")

        def stop(self, timeout_s: float = 10.0) -> None:
            pass

    monkeypatch.setattr(up_mod, "LocalCluster", NoCluster)
    monkeypatch.setattr(up_mod, "port_taken", lambda host, port: None)   # whatever holds :8000 on this machine
    monkeypatch.setenv("LOCKSTEP_STATE_DIR", str(tmp_path / "state"))
    for var in ("LOCKSTEP_REDIS_URL", "LOCKSTEP_MODEL", "LOCKSTEP_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)


def _refused(res, *needles: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


# ---------------------------------------------------------------------------- up
def test_up_refuses_persist_with_an_external_redis(no_start, tmp_path):
    # --persist only reaches the embedded server; with a URL it was dropped silently
    res = _cli("up", "--backend", "sim", "--redis-url", "redis://127.0.0.1:1/0", "--persist", str(tmp_path / "d"))
    _refused(res, "--persist", "drop --redis-url")
    assert not (tmp_path / "d").exists()     # refused before it made the directory


def test_up_refuses_max_wait_ms_without_staggered(no_start):
    # only the staggered policy reads LOCKSTEP_MAX_WAIT_MS (services/scheduler/service.py)
    res = _cli("up", "--backend", "sim", "--max-wait-ms", "50")
    _refused(res, "--max-wait-ms", "policy 'waterfill'", "--policy staggered")
    res = _cli("up", "--backend", "sim", "--policy", "least_score", "--max-wait-ms", "50")
    _refused(res, "policy 'least_score'")
    res = _cli("up", "--backend", "sim", "--policy", "staggered", "--max-wait-ms", "50")
    assert res.exit_code == 1 and "would start a cluster" in res.stderr, res.output   # accepted


def test_up_reads_the_variables_it_sets_for_its_children(no_start, monkeypatch):
    """`LOCKSTEP_BACKEND=sim LOCKSTEP_POLICY=staggered lockstep up` started torch and
    waterfill without a word (the flags' defaults overwrote the variables for every child),
    and LOCKSTEP_ALIGN_TOKENS=0 was turned into 1; LOCKSTEP_MAX_WAIT_MS beside a policy that
    does not read it went unrefused. A flag given still wins."""
    from services.admin import up as up_mod
    seen: list = []
    real = up_mod.LocalCluster

    class Capture(real):  # type: ignore[misc, valid-type]
        def __init__(self, opts, out):
            seen.append(opts)
            super().__init__(opts, out)

    monkeypatch.setattr(up_mod, "LocalCluster", Capture)
    for k, v in {"LOCKSTEP_BACKEND": "sim", "LOCKSTEP_POLICY": "staggered", "LOCKSTEP_ALIGN_TOKENS": "0",
                 "LOCKSTEP_RANKS": "3", "LOCKSTEP_MAX_WAIT_MS": "40"}.items():
        monkeypatch.setenv(k, v)
    res = _cli("up")
    assert res.exit_code == 1 and "would start a cluster" in res.stderr, res.output
    o = seen[-1]
    assert (o.backend, o.policy, o.ranks) == ("sim", "staggered", 3)
    assert o.extra_env["LOCKSTEP_ALIGN_TOKENS"] == "0" and o.extra_env["LOCKSTEP_MAX_WAIT_MS"] == "40"
    _refused(_cli("up", "--policy", "waterfill"), "LOCKSTEP_MAX_WAIT_MS")   # a variable made moot is named
    monkeypatch.delenv("LOCKSTEP_MAX_WAIT_MS")
    res = _cli("up", "--policy", "waterfill", "--ranks", "2")
    assert res.exit_code == 1 and (seen[-1].policy, seen[-1].ranks) == ("waterfill", 2)   # a flag given wins


def test_up_refuses_time_scale_on_torch_and_a_negative_one(no_start):
    # the torch backend reads no time_scale (only the sim forward and wait_scale do)
    res = _cli("up", "--backend", "torch", "--time-scale", "3")
    _refused(res, "--time-scale", "--backend sim")
    res = _cli("up", "--backend", "sim", "--time-scale", "-1")
    _refused(res, "--time-scale", "finite number >= 0", "not -1.0")
    assert "inf" not in res.stderr
    res = _cli("up", "--backend", "sim", "--time-scale", "inf")   # was up and "ready", and no step ever ended
    _refused(res, "--time-scale", "finite", "no step would ever end")
    res = _cli("up", "--backend", "sim", "--time-scale", "nan")   # typer's bound said it must be >= 0
    _refused(res, "--time-scale", "finite number >= 0", "not nan")
    assert "inf" not in res.stderr
    for ok in (["--backend", "torch", "--time-scale", "1"], ["--backend", "sim", "--time-scale", "0"]):
        res = _cli("up", *ok)
        assert res.exit_code == 1 and "would start a cluster" in res.stderr, (ok, res.output)


@pytest.mark.parametrize("namespace, needle", [
    ("x y", "' '"), ("", "empty"), ("../elsewhere", ".. part"), ("/etc/x", "begin with /"), ("a{b}", "{ }")])
def test_up_refuses_a_namespace_that_is_no_key_prefix_or_file_name(no_start, namespace, needle):
    # a space or an empty one was served; ../ put the state file and logs outside the state directory
    res = _cli("up", "--backend", "sim", "--namespace", namespace)
    _refused(res, f"--namespace {namespace!r}", needle)    # the flag it came from, not up's variable
    assert "LOCKSTEP_NAMESPACE" not in res.stderr


def test_up_and_engine_refuse_a_dtype_the_ranks_would_ignore_or_fail_on(no_start):
    # --dtype reached the ranks only with a checkpoint; a bad value failed there, after start
    res = _cli("up", "--dtype", "bfloat16")
    _refused(res, "--dtype bfloat16 applies to a checkpoint", "float32")
    res = _cli("up", "--model", "random", "--dtype", "float32")
    _refused(res, "--dtype float32 applies to a checkpoint")
    res = _cli("up", "--dtype", "fp16")
    _refused(res, "--dtype must be auto, bfloat16 or float32")
    res = _cli("engine", "--ranks", "0", "--redis-url", "redis://127.0.0.1:1/0", "--dtype", "bfloat16")
    _refused(res, "--dtype bfloat16 applies to a checkpoint")


def test_up_refuses_a_port_another_listener_holds(no_start, monkeypatch):
    # the api-servers bind with SO_REUSEPORT, so a second cluster on a busy port started
    # beside the first one's and the kernel split the clients between the two clusters
    import socket

    from services.admin import up as up_mod

    monkeypatch.setattr(up_mod, "port_taken", PORT_TAKEN)   # the real check, not the fixture's
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)   # as another cluster's api-server
    other.bind(("127.0.0.1", 0))
    other.listen(1)
    try:
        port = other.getsockname()[1]
        _refused(_cli("up", "--backend", "sim", "--port", str(port)), f"127.0.0.1:{port}", "another --port")
    finally:
        other.close()
    res = _cli("up", "--backend", "sim", "--port", str(port))   # free again
    assert res.exit_code == 1 and "would start a cluster" in res.stderr, res.output
    # an address this machine does not have is not "another process listens there"
    res = _cli("up", "--backend", "sim", "--port", str(port), "--host", "192.0.2.1")
    _refused(res, "192.0.2.1 is not an address of this machine")
    assert "Another process" not in res.stderr


def test_up_and_engine_refuse_a_model_the_sim_backend_would_ignore(no_start):
    # the sim backend runs no model: --model random was accepted and did nothing
    res = _cli("up", "--backend", "sim", "--model", "random")
    _refused(res, "--model random needs --backend torch", "drop --model")
    res = _cli("engine", "--ranks", "0", "--redis-url", "redis://127.0.0.1:1/0", "--backend", "sim", "--model", "random")
    _refused(res, "--model random needs --backend torch")
    for ok in (["--backend", "sim", "--model", "lockstep-moe"], ["--backend", "torch", "--model", "random"]):
        res = _cli("up", *ok)
        assert res.exit_code == 1 and "would start a cluster" in res.stderr, (ok, res.output)


def test_up_interrupted_during_start_up_exits_130(no_start, monkeypatch):
    from services.admin import up as up_mod

    class Interrupted(up_mod.LocalCluster):
        def start(self) -> None:
            raise KeyboardInterrupt("signal 2 during start-up")

        def stop(self, timeout_s: float = 10.0) -> None:
            stopped.append(True)

    stopped: list[bool] = []
    monkeypatch.setattr(up_mod, "LocalCluster", Interrupted)
    res = _cli("up", "--backend", "sim")
    assert res.exit_code == 130 and "interrupted during start-up" in res.stderr and stopped, res.output


def test_up_refuses_a_port_out_of_range(no_start):
    # 70000 failed in the api-servers (OverflowError) after everything started; 0 made each
    # replica listen on a random port of its own while `up` waited for :0
    for port in ("0", "70000"):
        res = _cli("up", "--backend", "sim", "--port", port)
        assert res.exit_code == 2 and "--port" in res.output, (port, res.output)


def test_up_refuses_ranks_the_bundled_models_experts_do_not_split_over(no_start):
    # the bundled model's 8 experts over 3 ranks: every process started, then rank 0 failed
    _refused(_cli("up", "--ranks", "3"), "8 experts do not split over 3 ranks", "--ranks 1, 2, 4, 8")
    _refused(_cli("up", "--ranks", "16", "--model", "random"), "do not split over 16 ranks")
    for ok in (["--ranks", "3", "--backend", "sim"], ["--ranks", "4"]):
        res = _cli("up", *ok)
        assert res.exit_code == 1 and "would start a cluster" in res.stderr, (ok, res.output)


def test_up_and_engine_refuse_an_unknown_log_level(no_start):
    # an unknown level made every service log at info without a word
    _refused(_cli("up", "--backend", "sim", "--log-level", "verbose"), "--log-level", "'verbose'")
    _refused(_cli("engine", "--ranks", "0", "--redis-url", "redis://127.0.0.1:1/0", "--log-level", "loud"),
             "--log-level")
    res = _cli("up", "--backend", "sim", "--log-level", "WARNING")
    assert res.exit_code == 1 and "would start a cluster" in res.stderr, res.output


def test_up_reaches_an_ipv6_listen_address(monkeypatch, tmp_path):
    # the api-servers bind an IPv6 --host (AF_INET6), but `up` probed http://::1:8000/health:
    # httpx.InvalidURL, not an HTTPError, so `up --host ::1` ended in a traceback
    import httpx

    from services.admin import up as up_mod

    monkeypatch.setenv("LOCKSTEP_STATE_DIR", str(tmp_path / "state"))
    seen = []

    class Ok:
        status_code = 200

    def get(url, timeout):
        httpx.URL(url)                      # raises InvalidURL on a bare IPv6 address
        seen.append(url)
        return Ok()

    monkeypatch.setattr(up_mod.httpx, "get", get)
    cluster = up_mod.LocalCluster(up_mod.UpOptions(host="::1", port=8123, ranks=1))

    async def probe():
        return True, True

    monkeypatch.setattr(cluster, "_probe_redis", probe)
    cluster._wait_ready()
    assert seen == ["http://[::1]:8123/health"]
    assert cluster.api_url == "http://[::1]:8123/v1"
    assert up_mod.LocalCluster(up_mod.UpOptions(host="127.0.0.1", port=8000)).api_url == "http://127.0.0.1:8000/v1"


# ---------------------------------------------------------------------------- bench
@pytest.fixture()
def fake_bench(monkeypatch):
    calls = []

    async def fake_run_bench(url, redis_url, namespace, workload, requests, rate, seed, trace, *a,
                             at_once=False, **kw):
        calls.append((workload, requests, rate, trace, at_once))
        return {"url": url, "namespace": namespace, "model": "m", "trace": workload, "requests": requests,
                "completed": requests, "failed": 0, "duration_s": 2.0, "throughput_tok_s": 1.0,
                "balance_ratio": 0.9, "idle_forward_fraction": 0.0}

    monkeypatch.setattr(bench_cmd, "run_bench", fake_run_bench)
    return calls


BENCH = ("bench", "--url", "http://x", "--redis-url", "redis://h:1/0", "--json")


def test_bench_says_when_it_cannot_read_the_step_stats(monkeypatch):
    # an unreachable --redis-url (the API reachable) ended in a redis traceback
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def unreachable(*a, **kw):
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    monkeypatch.setattr(bench_cmd, "run_bench", unreachable)
    res = _cli(*BENCH)
    assert res.exit_code == 2 and "cannot read the step stats from Redis at redis://h:1/0" in res.output, res.output


def test_bench_refuses_generator_options_with_a_trace(fake_bench, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "prompt_tokens": 8, "output_tokens": 2}\n')
    for extra in (["--rate", "20"], ["--workload", "bursty"], ["--requests", "5"]):
        _refused(_cli(*BENCH, "--trace", str(trace), *extra), "--trace", extra[0])
    assert fake_bench == []
    res = _cli(*BENCH, "--trace", str(trace), "--seed", "3")
    assert res.exit_code == 0 and len(fake_bench) == 1, res.output


def test_bench_refuses_a_rate_that_would_not_apply(fake_bench):
    # offline/blog send everything at once: --load and --rate used to be dropped silently
    _refused(_cli(*BENCH, "--workload", "offline", "--load", "0.5", "--capacity", "4"), "offline", "--load")
    _refused(_cli(*BENCH, "--workload", "blog", "--rate", "2"), "blog", "--rate")
    # --load sets the rate: an explicit --rate beside it was overwritten
    _refused(_cli(*BENCH, "--load", "0.5", "--capacity", "4", "--rate", "3"), "drop --rate")
    # a zero capacity gave rate 0 and the generator's "rate must be > 0"
    _refused(_cli(*BENCH, "--load", "0.5", "--capacity", "0"), "--capacity must be > 0")
    assert fake_bench == []
    res = _cli(*BENCH, "--workload", "offline", "--requests", "4")
    assert res.exit_code == 0 and fake_bench == [("offline", 4, bench_cmd.DEFAULT_RATE, None, False)], res.output


def test_bench_warns_that_a_small_capacity_probe_reads_low(fake_bench):
    # 200 requests read 13.9 requests/s where 1,300 read 20.6: "--load 1.5" ran below capacity
    res = _cli(*BENCH, "--load", "1.5", "--requests", "200")
    assert res.exit_code == 0 and "capacity probe of 200 requests reads low" in res.stderr, res.output
    res = _cli(*BENCH, "--load", "1.5", "--requests", str(bench_cmd.PROBE_MIN_REQUESTS))
    assert res.exit_code == 0 and "reads low" not in res.stderr
    assert "reads low" not in _cli(*BENCH, "--load", "1.5", "--requests", "200", "--capacity", "5").stderr


def test_bench_replays_a_trace_that_names_api_servers(tmp_path):
    # load_jsonl's default of one api-server refused any line with api_server >= 1, naming
    # an --api-servers flag bench does not have
    from services.admin.bench_trace import build_trace

    trace = tmp_path / "t.jsonl"
    lines = [{"t": i * 0.5, "prompt_tokens": 8, "output_tokens": 2, "api_server": i} for i in range(4)]
    lines.append({"t": 2.0, "prompt_tokens": 8, "output_tokens": 2})   # none recorded: 0, not a random index
    trace.write_text("\n".join(json.dumps(d) for d in lines) + "\n")
    name, items, clipped = build_trace("poisson", 100, 8.0, 0, trace)
    assert [(it.t, it.prompt_tokens, it.output_tokens, it.api) for it in items] == [
        (i * 0.5, 8, 2, i) for i in range(4)] + [(2.0, 8, 2, 0)]


# ---------------------------------------------------------------------------- simulate
def test_simulate_refuses_options_its_path_does_not_read(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "prompt_tokens": 8, "output_tokens": 2}\n')
    small = ("simulate", "--ranks", "2", "--requests", "5", "--policies", "least_score", "--json")
    # the view period applies to client dispatch only; each system's own otherwise
    res = _cli(*small, "--view-interval-ms", "50")
    assert res.exit_code == 2 and "--view-interval-ms" in res.output and "--dispatch client" in res.output
    res = _cli(*small, "--dispatch", "scheduler", "--view-interval-ms", "50")
    assert res.exit_code == 2 and "--view-interval-ms" in res.output
    res = _cli("simulate", "--ranks", "2", "--policies", "least_score", "--trace", str(trace), "--rate", "9")
    assert res.exit_code == 2 and "--trace" in res.output and "--rate" in res.output
    res = _cli(*small, "--workload", "offline", "--rate", "9")
    assert res.exit_code == 2 and "offline" in res.output and "--rate" in res.output
    res = _cli(*small, "--sweep", "0.5", "--rate", "9")    # the sweep sets the rate at each load
    assert res.exit_code == 2 and "--sweep" in res.output and "--rate" in res.output
    res = _cli(*small, "--dispatch", "client", "--view-interval-ms", "50")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["dispatch"] == "client"


@pytest.mark.parametrize("args, needle", [
    # each was a traceback (exit 1) or a run on nonsense (NaN / Infinity in the JSON)
    (["--rate", "nan"], "finite"), (["--rate", "inf"], "finite"),
    (["--sweep", "nan"], "--sweep"), (["--sweep", "0.5,abc"], "--sweep"), (["--sweep", "inf"], "--sweep"),
    (["--param", "least_score.nosuch=1"], "--param least_score.nosuch=1"),
    (["--policies", "default", "--param", "default.level_tokens=abc"], "--param default.level_tokens"),
    (["--policies", "default", "--param", "default.budget.nosuch=1"], "no such budget setting"),
    (["--policies", "default", "--param", "default.budget.min_balance=abc"], "--param default.budget"),
    (["--policies", " , "], "--policies"),
    (["--plot", "/nonexistent-dir/p.png"], "--plot"),
    (["--plot", "/tmp/p.txt"], ".png"),    # (matplotlib refused it after the whole run: a traceback)
    (["--dispatch", "client", "--view-interval-ms", "-10"], "--view-interval-ms"),
    # figures for a cluster `up` refuses (staggered needs the one scheduler); with "all" it is left out
    (["--dispatch", "client", "--policies", "staggered_aligned"], "dispatch scheduler only"),
])
def test_simulate_refuses_bad_values_with_the_option_named(args, needle):
    base = ["simulate", "--ranks", "2", "--requests", "5", "--policies", "least_score"]
    if "--policies" in args:
        base = base[:-2]
    res = _cli(*base, *args)
    assert res.exit_code == 2 and needle in res.output, (args, res.exit_code, res.output, res.exception)


@pytest.mark.parametrize("text, needle", [
    ('{"t": NaN, "prompt_tokens": 8, "output_tokens": 2}', "finite"),
    ('{"t": Infinity, "prompt_tokens": 8, "output_tokens": 2}', "finite"),
    ('{"t": 0, "prompt_tokens": 8, "output_tokens": 2, "api_server": -3}', "api_server"),
    # an OverflowError traceback, and a cap of 0 or less read as "no cap" (the simulate probe)
    ('{"t": 0, "prompt_tokens": 8, "output_tokens": 2, "max_tokens": 1e400}', "bad trace line"),
    ('{"t": 0, "prompt_tokens": 1e30, "output_tokens": 2}', "below 2^40"),
    ('{"t": 0, "prompt_tokens": 1000000000000000000000000, "output_tokens": 2}', "below 2^40"),
    ('{"t": 0, "prompt_tokens": 8, "output_tokens": 2, "max_tokens": -5}', "max_tokens must be >= 1"),
    # each read as something else without a word: cut, coerced, or a typo's value ignored
    ('{"t": 0, "prompt_tokens": 10.7, "output_tokens": 3}', "prompt_tokens must be a whole number"),
    ('{"t": 0, "prompt_tokens": "12", "output_tokens": 3}', "prompt_tokens must be a number"),
    ('{"t": 0, "prompt_tokens": true, "output_tokens": 3}', "prompt_tokens must be a number"),
    ('{"t": "0", "prompt_tokens": 12, "output_tokens": 3}', "t must be a number"),
    ('{"t": 0, "prompt_tokens": 12, "output_tokens": 3, "max_token": 2}', "did you mean 'max_tokens'"),
    ('[0, 12, 3]', "a JSON object per line"),
])
def test_simulate_refuses_a_trace_line_it_cannot_replay(tmp_path, text, needle):
    trace = tmp_path / "t.jsonl"
    trace.write_text(text + "\n")
    res = _cli("simulate", "--ranks", "2", "--policies", "least_score", "--trace", str(trace))
    assert res.exit_code == 2 and needle in res.output and "t.jsonl:1" in res.output, res.output


def test_simulate_says_when_it_cut_a_trace_to_fit(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "prompt_tokens": 100000, "output_tokens": 5}\n{"t": 0.1, "prompt_tokens": 8, "output_tokens": 2}\n')
    res = _cli("simulate", "--ranks", "2", "--policies", "least_score", "--trace", str(trace), "--json")
    assert res.exit_code == 0, res.output
    assert "1 of 2 requests" in res.stderr and "max_model_len" in res.stderr
    assert json.loads(res.stdout)["config"]["trace"]["clipped_requests"] == 1


@pytest.mark.parametrize("doc, needle", [
    ('{"fixed_ms": "x"}', "fixed_ms='x'"), ('{"token_ms": -5}', "token_ms=-5"), ("nope", "not JSON"),
    ('[1]', "JSON object"),
])
def test_simulate_refuses_a_cost_model_that_is_no_device(tmp_path, doc, needle):
    # a string crashed mid-run; a negative cost ran, with negative step times in the report
    cm = tmp_path / "cm.json"
    cm.write_text(doc)
    res = _cli("simulate", "--ranks", "2", "--requests", "5", "--policies", "least_score", "--cost-model", str(cm))
    assert res.exit_code == 2 and needle in res.output and "cm.json" in res.output, res.output


# ---------------------------------------------------------------------------- the rest
def test_drain_refuses_timeout_without_wait():
    res = _cli("drain", "1", "--timeout", "5", "--redis-url", "redis://127.0.0.1:1/0")
    _refused(res, "--timeout", "--wait")


def test_init_and_config_refuse_bad_settings_without_a_traceback(redis_url, namespace, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCKSTEP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("LOCKSTEP_REDIS_URL", raising=False)
    monkeypatch.setenv("LOCKSTEP_POLICY", "staggered")
    monkeypatch.setenv("LOCKSTEP_DISPATCH", "client")
    _refused(_cli("init", "--redis-url", redis_url, "-n", namespace), "needs dispatch 'scheduler'")
    _refused(_cli("config", "-n", namespace), "needs dispatch 'scheduler'")
    monkeypatch.delenv("LOCKSTEP_DISPATCH")
    monkeypatch.setenv("LOCKSTEP_NUM_KV_BLOCKS", "many")
    _refused(_cli("init", "--redis-url", redis_url, "-n", namespace), "LOCKSTEP_NUM_KV_BLOCKS")
    _refused(_cli("config", "--redis-url", redis_url, "-n", namespace), "LOCKSTEP_NUM_KV_BLOCKS")
    monkeypatch.delenv("LOCKSTEP_NUM_KV_BLOCKS")
    monkeypatch.setenv("LOCKSTEP_LOG_LEVEL", "loud")    # every service logged at info without a word
    _refused(_cli("init", "--redis-url", redis_url, "-n", namespace), "LOCKSTEP_LOG_LEVEL='loud'", "warning")


def test_chaos_refuses_a_run_with_no_fault(monkeypatch):
    # --duration 5..9 (min 5) injected nothing and passed
    def started(*a, **kw):
        raise RuntimeError("would start a cluster")

    monkeypatch.setattr(chaos, "run_chaos", started)
    res = _cli("chaos", "--duration", "8")      # below the option's minimum now: its help says why
    assert res.exit_code == 2 and "greater than or equal to 10" in res.output, res.output
    _refused(_cli("chaos", "--duration", "12", "--every", "60"), "no time for a fault", "--every")
    res = _cli("chaos", "--duration", "30")
    assert res.exit_code == 2 and "would start a cluster" in res.stderr, res.output


# ---------------------------------------------------------------------------- help
def test_help_shows_no_value_beside_a_flag_and_up_names_its_default_policy(monkeypatch):
    # typer 0.2x printed `--help <bool>` and `--align-tokens/--no-align-tokens <bool>`
    monkeypatch.setenv("COLUMNS", "160")
    for args in ([], ["up"], ["bench"], ["simulate"]):
        res = _cli(*args, "--help")
        assert res.exit_code == 0 and "--help" in res.output, res.output
        assert "<bool>" not in res.output, res.output
    up_help = _cli("up", "--help").output
    assert "<int range>" in up_help or "INTEGER" in up_help      # options that take a value still say what
    assert "waterfill: the default" in up_help and "[default: waterfill]" in up_help


# ---------------------------------------------------------------------------- status
def _status_text(alive: list[bool]) -> str:
    from rich.console import Console

    from services.admin.status import render
    ranks = [{"rank": i, "alive": a, "pid": 100 + i, "wave": 1, "step": 5, "waiting": 0, "running": 0, "kv_used": 0,
              "kv_total": 10, "idle_forwards": 0, "inbox_pending": 0} for i, a in enumerate(alive)]
    data = {"namespace": "ls", "redis_url": "redis://h:1/0", "cluster": {"ranks": len(alive)}, "ranks": ranks,
            "scheduler": {"leader": "s", "counters": {}}, "queues": {"requests": 0}, "snapshot": None,
            "drained": [], "spares": []}
    console = Console(width=200, record=True)
    console.print(render(data))
    return console.export_text()


def test_status_says_when_the_engine_group_is_short_of_a_rank():
    # the group steps only with every rank: a dead one stops all serving, which the table alone hid
    text = _status_text([True, False])
    assert "engine group: 1 of 2 ranks live (down: 1)" in text and "--spares" in text, text
    assert "engine group" not in _status_text([True, True])


def test_up_refuses_what_its_children_could_never_run(no_start, monkeypatch, tmp_path):
    # each of these started, then crash-looped, hung or failed every request (the flags probe, 2026-12-05)
    monkeypatch.setenv("LOCKSTEP_MAX_MODEL_LEN", "5000")   # past the bundled model's positions: ranks died
    _refused(_cli("up", "--ranks", "2"), "exceeds the bundled model's 4096 positions", "LOCKSTEP_MAX_MODEL_LEN=4096")
    res = _cli("up", "--ranks", "2", "--backend", "sim")   # the sim runs no model: no positions to pass
    assert res.exit_code == 1 and "would start a cluster" in res.stderr, res.output
    monkeypatch.delenv("LOCKSTEP_MAX_MODEL_LEN")
    monkeypatch.setenv("LOCKSTEP_NUM_KV_BLOCKS", "4")       # every request over 64 tokens: a 503 "retry it"
    _refused(_cli("up", "--backend", "sim"), "LOCKSTEP_NUM_KV_BLOCKS to 256 or more")
    monkeypatch.delenv("LOCKSTEP_NUM_KV_BLOCKS")
    _refused(_cli("up", "--backend", "sim", "--namespace", "pf[1]"), "must not contain [ ]")   # `up` hung
    a_file = tmp_path / "afile"
    a_file.write_text("")
    _refused(_cli("up", "--backend", "sim", "--persist", str(a_file)), "is a file; give a directory")  # traceback
    monkeypatch.setenv("LOCKSTEP_DEVICE", "gpu")
    _refused(_cli("up", "--ranks", "2"), "LOCKSTEP_DEVICE")
    import torch
    if not torch.cuda.is_available():                        # ranks retried for ever, `up` waited 180 s
        monkeypatch.setenv("LOCKSTEP_DEVICE", "cuda")
        refused = _cli("up", "--ranks", "2")
        _refused(refused, "no CUDA device is visible", "unset LOCKSTEP_DEVICE")
        assert "--device" not in refused.output                      # `up` has no such option
        monkeypatch.delenv("LOCKSTEP_DEVICE")
        _refused(_cli("engine", "--ranks", "0", "--redis-url", "redis://127.0.0.1:1/0", "--device", "cuda"),
                 "no CUDA device is visible", "--device cpu")


def test_the_up_banner_inspects_its_own_namespace():
    # (it said "lockstep status", which shows the default cluster, not one in -n prod)
    from types import SimpleNamespace

    from services.admin.up import UpOptions, banner
    c = SimpleNamespace(o=UpOptions(namespace="prod"), api_url="http://127.0.0.1:8000", url="redis://127.0.0.1:1",
                        redis=None, log_dir="/tmp/x")
    assert "Inspect    lockstep status -n prod" in banner(c)
    c.o = UpOptions()
    assert "Inspect    lockstep status\n" in banner(c)


def test_bench_takes_a_fixed_shape_and_refuses_a_malformed_one(fake_bench):
    _refused(_cli(*BENCH, "--workload", "fixed:4096"), "--workload", "fixed:IN:OUT")
    _refused(_cli(*BENCH, "--workload", "fixd"), "--workload", "fixed:IN:OUT")
    assert fake_bench == []
    res = _cli(*BENCH, "--workload", "fixed:4096:256", "--requests", "4")
    assert res.exit_code == 0 and fake_bench[0][:2] == ("fixed:4096:256", 4), res.output


def test_bench_says_when_the_shape_asked_for_does_not_fit(monkeypatch):
    # fixed:8192:64 on a 4,096-token model was cut to 4,095 + 1 tokens without a word
    from services.admin.bench_trace import build_trace

    name, items, clipped = build_trace("fixed:8192:64", 5, 4.0, 0, None, max_model_len=4096)
    assert clipped == 5 and all(it.prompt_tokens + it.output_tokens <= 4096 for it in items)
    assert build_trace("fixed:1024:64", 5, 4.0, 0, None, max_model_len=4096)[2] == 0

    async def cut(url, redis_url, namespace, workload, requests, *a, **kw):
        return {"url": url, "namespace": namespace, "model": "m", "trace": workload, "requests": requests,
                "completed": requests, "failed": 0, "duration_s": 2.0, "throughput_tok_s": 1.0,
                "balance_ratio": 0.9, "idle_forward_fraction": 0.0, "clipped_requests": 3, "max_model_len": 4096}

    monkeypatch.setattr(bench_cmd, "run_bench", cut)
    res = _cli(*BENCH, "--workload", "fixed:8192:64", "--requests", "5")
    assert res.exit_code == 0 and "3 of 5 requests do not fit" in res.stderr and "4096" in res.stderr, res.output
    assert json.loads(res.stdout)["clipped_requests"] == 3


def test_drain_wait_timeout_says_what_is_left_in_words(redis_url, namespace):
    # it printed the load as a Python dict ({'waiting': 1, 'running': 2, 'inbox_pending': 0})
    import redis as redis_sync
    from shared.keys import Keys
    keys = Keys(namespace)
    r = redis_sync.Redis.from_url(redis_url)
    r.hset(keys.cluster, "ranks", 2)
    r.hset(keys.rank_info(1), "stats", json.dumps({"running": 2, "waiting": 1}))
    res = _cli("drain", "1", "--wait", "--timeout", "0.2", "--redis-url", redis_url, "-n", namespace)
    assert res.exit_code == 1, res.output
    assert "rank 1 still has work after 0.2s: 2 running, 1 waiting; its requests keep running there" in res.output
    assert "{" not in res.output.split("still has work")[1]


def test_every_command_help_reads_as_reflowed_paragraphs():
    # typer's rich help keeps a docstring's source line breaks: `config --help` printed
    # "...no local cluster) it" and then "shows what..." on a line of its own
    from services.admin.cli import app as cli_app
    import re
    for cmd in cli_app.registered_commands:
        doc = cmd.help or (cmd.callback.__doc__ if cmd.callback else "") or ""
        for paragraph in doc.strip().split("\n\n"):
            assert paragraph.startswith(("-", "\b")) or "\n" not in paragraph, (cmd.callback, paragraph)
    res = _cli("config", "--help")
    assert res.exit_code == 0 and "shows what the services" in res.output
    assert not re.search(r"cluster\) it\s*\n", res.output), res.output


@pytest.mark.parametrize("param,needle", [
    # a string for a number was accepted and crashed mid-run ("can't multiply sequence")
    ("vllm.kv_penalty=abc", "vllm.kv_penalty takes a finite number"),
    ("vllm.kv_penalty=nan", "vllm.kv_penalty takes a finite number"),
    ("waterfill.budget.min_balance=nan", "min_balance must be in [0, 1)"),   # was a str-vs-float TypeError
    ("vllm.bogus=1", "vllm cannot take it"),
])
def test_simulate_refuses_a_param_of_the_wrong_kind_before_the_run(param, needle):
    res = _cli("simulate", "--ranks", "2", "--requests", "5", "--policies", param.split(".")[0], "--param", param)
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output
