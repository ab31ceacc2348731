"""The operator commands (services/admin/*_cmd.py, watch.py) and the Prometheus metrics,
against one live `lockstep up --ranks 2 --api-servers 1 --backend sim` cluster."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.helpers import poll_until

from shared.keys import Keys
from shared.redis_server import free_port, free_ports
from tests.conftest import ROOT, Cluster, start_cluster

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"


def poll(pred, timeout: float = 15.0, interval: float = 0.1):
    """Call ``pred`` until it returns a truthy value; fail after ``timeout`` seconds."""
    return poll_until(pred, timeout, "condition", interval)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("ops")
    metrics_base = free_ports(4, consecutive=True)[0]    # the scheduler's port, then each engine's (+1 + rank) and the spare's
    saved = os.environ.get("LOCKSTEP_METRICS_PORT")
    os.environ["LOCKSTEP_METRICS_PORT"] = str(metrics_base)   # `up` passes LOCKSTEP_* through to its children
    try:
        c = start_cluster(tmp, "--ranks", "2", "--api-servers", "1", "--backend", "sim",
                          namespace=f"ops{os.getpid()}")
    finally:
        if saved is None:
            os.environ.pop("LOCKSTEP_METRICS_PORT", None)
        else:
            os.environ["LOCKSTEP_METRICS_PORT"] = saved
    c.metrics_base = metrics_base  # type: ignore[attr-defined]
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)


def cli_json(cluster: Cluster, *args: str, timeout: float = 30) -> object:
    res = cluster.cli(*args, "--json", timeout=timeout)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def redis_get(cluster: Cluster, op):
    """Run one async redis operation against the cluster (a fresh client per call)."""
    from shared.bus import connect

    async def go():
        r = connect(cluster.redis_url, timeout_s=5.0)
        try:
            return await op(r)
        finally:
            await r.aclose()
    return asyncio.run(go())


def complete(client: openai.OpenAI, max_tokens: int = 8, **extra) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt="ops test", max_tokens=max_tokens,
                                     extra_body={"ignore_eos": True, **extra})


# --------------------------------------------------------------------------- steps
def test_steps_lists_finalized_steps_per_rank(cluster, client):
    complete(client, 12)
    data = poll(lambda: (d := cli_json(cluster, "steps", "-c", "5")) and d["steps"] and d)
    assert 1 <= len(data["steps"]) <= 5
    for snap in data["steps"]:
        assert set(snap["ranks"]) == {"0", "1"}
        assert {"scheduled", "waiting", "running", "kv_used", "idle"} <= set(snap["ranks"]["0"])
    keys = [(s["wave"], s["step"]) for s in data["steps"]]
    assert keys == sorted(keys)                       # oldest first, never out of order
    one = cli_json(cluster, "steps", "-c", "3", "--rank", "1")
    assert all(set(s["ranks"]) == {"1"} for s in one["steps"])
    table = cluster.cli("steps", "-c", "2")
    assert table.returncode == 0 and "finalized steps" in table.stdout and "wave" in table.stdout
    # a rank the cluster does not have was an empty table, as if it had no steps
    missing = cluster.cli("steps", "-c", "2", "--rank", "7")
    assert missing.returncode == 2 and "--rank 7" in missing.stderr and "ranks 0, 1" in missing.stderr


def test_steps_marks_the_step_at_which_the_group_paused():
    from services.admin.steps_cmd import steps_rows
    snap = {"wave": 3, "step": 7, "t": 0.0, "ranks": {
        "0": {"step": 7, "scheduled": 0, "dur_ms": 0.0, "extra": {"pause": True}},
        "1": {"step": 7, "scheduled": 12, "dur_ms": 9.5, "extra": {}}}}
    rows = steps_rows([snap])
    assert [r["pause"] for r in rows] == [True, False] and rows[1]["dur_ms"] == 9.5


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["watch", "--once"], ["watch", "--json"],
                                     ["steps"], ["drain", "0"]])
def test_an_empty_namespace_has_no_cluster_and_exits_2(cluster, command):
    # status printed "? ranks" and an empty table, then "no cluster" with exit 0; watch, steps
    # and drain exited 0 too (drain wrote <ns>:drained for a cluster that is not there)
    env = {**os.environ, "LOCKSTEP_STATE_DIR": cluster.state_dir}
    res = subprocess.run([sys.executable, "-m", "services.admin.cli", *command, "--namespace", "nobody-here",
                          "--redis-url", cluster.redis_url], capture_output=True, text=True, timeout=30, env=env,
                         cwd=ROOT)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "no cluster in namespace 'nobody-here'" in res.stderr and "lockstep up -n nobody-here" in res.stderr
    assert not redis_get(cluster, lambda r: r.exists(Keys("nobody-here").drained))


# ------------------------------------------------------------------------- request
def test_request_shows_rank_and_timeline(cluster, client):
    r = complete(client, 16)
    info = poll(lambda: (d := cli_json(cluster, "request", r.id)) and d["state"] == "finished" and d)
    assert info["found"] and info["record"]["rank"] in (0, 1) and info["record"]["tokens"] == 16
    events = [e["event"] for e in info["timeline"]]
    assert events == ["arrival", "dispatched", "first_token", "finished"]
    ts = [e["t"] for e in info["timeline"]]
    assert ts == sorted(ts)
    text = cluster.cli("request", r.id)
    assert text.returncode == 0 and "first token emitted" in text.stdout and f"rank {info['record']['rank']}" in text.stdout
    missing = cluster.cli("request", "cmpl-does-not-exist")
    assert missing.returncode == 1 and "no record of request" in missing.stderr


# --------------------------------------------------------------------- drain/resume
def test_request_record_lives_request_record_ttl_s(cluster, client):
    """The request record's TTL is the setting's (default 600 s), not a fixed hour:
    at 1.1 k req/s an hour is ~4 M hashes (docs/operations.md, Redis memory)."""
    from shared.settings import EngineSettings, SchedulerSettings
    assert SchedulerSettings().request_record_ttl_s == EngineSettings().request_record_ttl_s == 600
    r = complete(client, 4)
    keys = Keys(cluster.namespace)
    state = poll(lambda: redis_get(cluster, lambda c: c.hget(keys.req(r.id), "state")) == b"finished")
    assert state
    ttl = redis_get(cluster, lambda c: c.ttl(keys.req(r.id)))
    assert 0 < ttl <= 600


def test_drain_keeps_new_work_off_a_rank_that_finishes_its_own(cluster, client):
    keys = Keys(cluster.namespace)
    # A long request pinned to rank 1, streaming while the rank is drained.
    result: dict = {}

    def long_request() -> None:
        stream = client.completions.create(model=MODEL, prompt="long one", max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True, "data_parallel_rank": 1})
        chunks = list(stream)
        result["id"] = chunks[0].id
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
        result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    th = threading.Thread(target=long_request, daemon=True)
    th.start()

    def rank1_running():
        stats = redis_get(cluster, lambda r: r.hget(keys.rank_info(1), "stats"))
        return stats and json.loads(stats)["running"] > 0
    poll(rank1_running, timeout=20)

    res = cli_json(cluster, "drain", "1")
    assert res["drained_ranks"] == [1] and res["changed"]
    # The scheduler reads the set every 250 ms and records what it applied in <ns>:scheduler.
    poll(lambda: redis_get(cluster, lambda r: r.hget(keys.scheduler, "drained")) == b"[1]", timeout=10)

    ranks = []
    for _ in range(6):
        rid = complete(client, 4).id
        rec = redis_get(cluster, lambda r: r.hget(keys.req(rid), "rank"))
        ranks.append(int(rec))
    assert ranks == [0] * 6, ranks                    # nothing new reaches the drained rank
    th.join(60)
    assert not th.is_alive(), "the drained rank did not finish its running request"
    assert result["finish"] == ["length"] and len(result["text"].encode("utf-8", "surrogatepass")) >= 1
    done = cli_json(cluster, "request", result["id"])
    assert done["record"]["rank"] == 1 and done["record"]["tokens"] == 300 and done["state"] == "finished"

    waited = cli_json(cluster, "drain", "1", "--wait", "--timeout", "20")
    assert waited["idle"] and not waited["changed"]
    # Draining the last rank that takes work is refused: with every rank drained the
    # scheduler places on all of them again, so it was accepted and did nothing.
    last = cluster.cli("drain", "0")
    assert last.returncode == 2 and "last rank taking new work" in last.stderr, last.stderr
    again = cluster.cli("drain", "1", "--redis-url", cluster.redis_url)
    assert again.returncode == 0, again.stderr
    # the undo hint reaches the Redis the command named, not the default cluster's
    assert f"Undo: lockstep resume -n {cluster.namespace} --redis-url {cluster.redis_url} 1" in again.stdout

    res = cli_json(cluster, "resume", "1")
    assert res["drained_ranks"] == [] and res["changed"]
    poll(lambda: redis_get(cluster, lambda r: r.hget(keys.scheduler, "drained")) == b"[]", timeout=10)
    again = set()
    for _ in range(10):
        rid = complete(client, 2).id
        again.add(int(redis_get(cluster, lambda r: r.hget(keys.req(rid), "rank"))))
        if 1 in again:
            break
    assert 1 in again, "a resumed rank gets work again"

    bad = cluster.cli("drain", "7")
    assert bad.returncode == 2 and "not in this cluster" in bad.stderr


def test_a_long_request_does_not_keep_the_entries_finished_behind_it(cluster, client):
    # The trim stops at the oldest entry in flight: one long request kept every entry placed
    # on its rank after it (an inbox of 140 entries with 1 pending); each is deleted as acked.
    keys = Keys(cluster.namespace)
    stream = client.completions.create(model=MODEL, prompt="long one", max_tokens=600, stream=True,
                                       extra_body={"ignore_eos": True, "data_parallel_rank": 1})
    try:
        next(iter(stream))                            # it runs on rank 1
        for _ in range(12):
            complete(client, 2, data_parallel_rank=1)
        inbox, pending = redis_get(cluster, lambda r: asyncio.gather(
            r.xlen(keys.inbox(1)), r.xpending(keys.inbox(1), "engine")))
        assert pending["pending"] >= 1, pending       # the long one, still in flight
        assert inbox <= pending["pending"] + 1, (inbox, pending)
    finally:
        stream.close()


# --------------------------------------------------------------------------- config
def test_config_shows_every_service_with_cluster_values(cluster):
    cfg = cli_json(cluster, "config")
    assert {"api-server", "scheduler", "engine-worker"} <= set(cfg)
    assert cfg["scheduler"]["ranks"] == 2 and cfg["engine-worker"]["ranks"] == 2
    assert cfg["engine-worker"]["backend"] == "sim"
    assert cfg["scheduler"]["namespace"] == cluster.namespace
    assert cfg["_sources"]["scheduler"]["ranks"] == "cluster"
    only = cli_json(cluster, "config", "--service", "engine-worker")
    assert set(only) == {"engine-worker", "_sources"}
    table = cluster.cli("config")
    assert table.returncode == 0 and "grace_ms" in table.stdout and "metrics_port" in table.stdout


def test_config_redacts_secrets():
    from services.admin.config_cmd import effective_config

    cfg = effective_config({"LOCKSTEP_API_KEYS": "sk-one,sk-two"}, {"ranks": "3"}, "x",
                           "redis://user:hunter2@db:6379/0")
    text = json.dumps(cfg)
    assert "hunter2" not in text and "sk-one" not in text
    assert cfg["api-server"]["api_keys"]["value"] == ["***", "***"]
    assert cfg["scheduler"]["redis_url"]["value"] == "redis://user:***@db:6379/0"
    assert cfg["engine-worker"]["ranks"] == {"value": 3, "source": "cluster"}


# ---------------------------------------------------------------------------- watch
def test_watch_once_renders_a_frame(cluster, client):
    complete(client, 20)
    res = cluster.cli("watch", "--once", "--window", "30")
    assert res.returncode == 0, res.stderr
    flat = " ".join(res.stdout.split())
    for needle in ("balance ratio", "idle-forward fraction", "step rate", "TTFT ms p50", "queues", "tok/step",
                   "unplaced in the scheduler 0"):
        assert needle in flat, (needle, res.stdout)
    frame = cli_json(cluster, "watch", "--window", "30")
    m = frame["measures"]
    assert m["steps"] > 0 and 0 < m["balance_ratio"] <= 1 and 0 <= m["idle_forward_fraction"] <= 1
    assert frame["ttft_ms"]["n"] >= 1 and frame["ttft_ms"]["p50"] > 0
    assert [r["rank"] for r in frame["ranks"]] == [0, 1]


def test_watch_into_a_pipe_prints_each_frame(cluster):
    # `watch | tee`, a CI log: the live view wrote nothing until it ended (nothing at all on SIGTERM)
    import signal

    env = {**os.environ, "LOCKSTEP_STATE_DIR": cluster.state_dir}
    env.pop("LOCKSTEP_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "watch", "--interval", "0.2",
                             "--namespace", cluster.namespace], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=ROOT, text=True)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        poll_until(lambda: sum("balance ratio" in line for line in seen) >= 2, 30, "two frames written to the pipe")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            raise AssertionError("watch did not stop within 10 s of SIGINT") from None
    assert proc.returncode == 0, proc.stderr.read()


def test_watch_render_recorded(cluster):
    from rich.console import Console

    from services.admin.watch import collect_frame, render_frame

    frame = asyncio.run(collect_frame(cluster.redis_url, cluster.namespace, 60.0))
    console = Console(record=True, width=120)
    console.print(render_frame(frame))
    text = console.export_text()
    assert f"lockstep [{cluster.namespace}]" in text and "balance ratio" in text and "█" in text


def test_measures_match_shared_definitions():
    from services.admin.watch import measures_of
    from shared.measures import balance_ratio, idle_forward_fraction

    snaps = [{"ranks": {"0": {"scheduled": 10, "idle": False}, "1": {"scheduled": 0, "idle": True}}},
             {"ranks": {"0": {"scheduled": 4, "idle": False}, "1": {"scheduled": 4, "idle": False}}},
             {"ranks": {"0": {"scheduled": 0, "idle": False}, "1": {"scheduled": 0, "idle": False}}}]
    m = measures_of(snaps, 10.0)
    sched = [[10, 0], [4, 4], [0, 0]]
    assert m["balance_ratio"] == round(balance_ratio(sched), 4)
    assert m["idle_forward_fraction"] == round(idle_forward_fraction(sched, [[False, True], [False, False],
                                                                             [False, False]]), 4)
    assert m["work_steps"] == 2 and m["step_rate"] == 0.3
    assert m["scheduled_mean_per_rank"] == {0: round(14 / 3, 2), 1: round(4 / 3, 2)}


# ---------------------------------------------------------------------- unreachable
def test_unreachable_cluster_is_one_line_and_exit_2(cluster, tmp_path):
    for cmd in (["steps"], ["request", "x"], ["drain", "0"], ["resume", "0"], ["watch", "--once"]):
        res = cluster.cli(*cmd, "--redis-url", "redis://127.0.0.1:1")
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        assert res.stderr.count("\n") == 1 and "cannot reach Redis" in res.stderr
    env = {**os.environ, "LOCKSTEP_STATE_DIR": str(tmp_path)}
    env.pop("LOCKSTEP_REDIS_URL", None)
    res = subprocess.run([sys.executable, "-m", "services.admin.cli", "steps", "-n", "nobody-here"],
                         capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    assert res.returncode == 2 and "no running local cluster" in res.stderr
    # `up` on a Redis it cannot reach says so, and only that (it said "starting 4 ranks" first)
    res = subprocess.run([sys.executable, "-m", "services.admin.cli", "up", "-n", "nobody-up", "--backend", "sim",
                          "--port", str(free_port()), "--redis-url", "redis://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.count("\n") == 1 and "cannot reach Redis" in res.stderr and "starting" not in res.stderr


# ----------------------------------------------------------------------------- init
def test_init_writes_the_cluster_record(cluster, tmp_path):
    ns = f"init{os.getpid()}"
    env = {**os.environ, "LOCKSTEP_STATE_DIR": str(tmp_path), "LOCKSTEP_RANKS": "3",
           "LOCKSTEP_NUM_API_SERVERS": "2", "LOCKSTEP_POLICY": "staggered"}
    res = subprocess.run([sys.executable, "-m", "services.admin.cli", "init", "-n", ns,
                          "--redis-url", cluster.redis_url, "--json"],
                         capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    rec = redis_get(cluster, lambda r: r.hgetall(Keys(ns).cluster))
    assert rec[b"ranks"] == b"3" and rec[b"api_servers"] == b"2" and rec[b"policy"] == b"staggered"
    redis_get(cluster, lambda r: r.delete(Keys(ns).cluster))
    # over a running cluster's record: what it changed is said, and the start time (which
    # names the api-servers' shared /metrics directory) is kept
    before = redis_get(cluster, lambda r: r.hgetall(Keys(cluster.namespace).cluster))
    res = subprocess.run([sys.executable, "-m", "services.admin.cli", "init", "-n", cluster.namespace,
                          "--redis-url", cluster.redis_url], capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    after = redis_get(cluster, lambda r: r.hgetall(Keys(cluster.namespace).cluster))
    redis_get(cluster, lambda r: r.hset(Keys(cluster.namespace).cluster, mapping=before))
    assert res.returncode == 0 and "runs, and its services read this record" in res.stderr, res.stderr
    assert "ranks " in res.stderr and after[b"started"] == before[b"started"]


# -------------------------------------------------------------------------- metrics
def _scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    raise AssertionError(f"{series} not in metrics:\n{text[:2000]}")


def test_metrics_served_by_scheduler_and_engines(cluster, client):
    base = cluster.metrics_base
    complete(client, 8)
    sched = poll(lambda: (t := _scrape(base)) and "lockstep_scheduler_dispatched_total" in t and t)
    assert _value(sched, "lockstep_scheduler_dispatched_total") >= 1
    assert _value(sched, "lockstep_scheduler_snapshots_published_total") >= 1
    assert 'lockstep_scheduler_aggregator_total{kind="finalized"}' in sched
    assert "lockstep_scheduler_dispatch_decisions_total{rank=" in sched
    assert "lockstep_scheduler_queue_seconds_count" in sched
    assert 'lockstep_snapshot_rank_scheduled{rank="0"}' in sched
    for rank in (0, 1):
        eng = _scrape(base + 1 + rank)
        assert _value(eng, f'lockstep_engine_steps_total{{rank="{rank}"}}') >= 1
        for name in ("idle_forwards_total", "scheduled_tokens_total", "waiting", "running", "kv_used_blocks"):
            assert f'lockstep_engine_{name}{{rank="{rank}"}}' in eng


def test_metrics_hooks_without_a_cluster():
    from prometheus_client import generate_latest

    from services.engine_worker.metrics import EngineMetrics
    from services.scheduler.metrics import SchedulerMetrics
    from shared.policy.aggregator import StepAggregator
    from shared.policy.base import Assignment
    from shared.policy.registry import make_policy
    from shared.stats import RankStats, Snapshot

    em = EngineMetrics(3)
    em.on_step(RankStats(3, 0, 0, waiting=2, running=1, scheduled=40, prefill=32, decode=8, kv_used=5,
                         kv_total=100, idle=False, dur_ms=9.0, extra={"gate_full": 2, "preemptions": 1}))
    em.on_step(RankStats(3, 0, 1, idle=True, dur_ms=8.0))
    text = generate_latest(em.registry).decode()
    assert 'lockstep_engine_steps_total{rank="3"} 2.0' in text
    assert 'lockstep_engine_idle_forwards_total{rank="3"} 1.0' in text
    assert 'lockstep_engine_scheduled_tokens_total{rank="3"} 40.0' in text

    class FakeService:
        ranks = [0, 1]
        counters = {"dispatched": 3, "snapshots": 1, "duplicates": 2}
        agg = StepAggregator([0, 1], grace_s=0.05)
        policy = make_policy("staggered", dispatcher_id="scheduler", num_api_servers=1, ranks=[0, 1])
        live, drained = [0, 1], {1}
        last_snapshot = Snapshot(0, 5, 1.0, {0: RankStats(0, 0, 5, scheduled=7), 1: RankStats(1, 0, 5, idle=True)})

        class s:  # noqa: N801 - mimics SchedulerSettings
            policy = "staggered"

    sm = SchedulerMetrics(FakeService())

    class Req:
        arrival = time.time() - 0.02
    sm.on_dispatch(Assignment("a", 0, batch="b1", batch_counts=(1, 1), reason="full"), Req(), time.time())
    sm.on_dispatch(Assignment("b", 1, batch="b1", batch_counts=(1, 1), reason="full"), Req(), time.time())
    sm.on_dispatch(Assignment("c", 0), Req(), time.time())
    text = generate_latest(sm.registry).decode()
    assert 'lockstep_scheduler_batch_releases_total{reason="full"} 1.0' in text
    assert 'lockstep_scheduler_dispatch_decisions_total{rank="0",reason="full"} 1.0' in text
    assert 'lockstep_scheduler_batch_hold_seconds_count{reason="full"} 2.0' in text
    assert "lockstep_scheduler_dispatched_total 3.0" in text
    # the counters `lockstep status` shows are exported too (duplicates was only in status)
    assert "lockstep_scheduler_duplicate_submissions_total 2.0" in text
    assert "lockstep_scheduler_resumed_total 0.0" in text and "lockstep_scheduler_deferred_total 0.0" in text
    assert 'lockstep_scheduler_rank_drained{rank="1"} 1.0' in text
    assert 'lockstep_snapshot_rank_scheduled{rank="0"} 7.0' in text
    assert 'lockstep_scheduler_policy_batches_total{reason="full"}' in text


# ---------------------------------------------------------------------- healthcheck
def test_container_healthchecks_pass_on_a_live_cluster(cluster):
    env = {**os.environ, "LOCKSTEP_REDIS_URL": cluster.redis_url, "LOCKSTEP_NAMESPACE": cluster.namespace,
           "LOCKSTEP_RANKS": "2"}
    for role in ("scheduler", "engine"):
        res = subprocess.run([sys.executable, "-m", "services.admin.healthcheck", role],
                             capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
        assert res.returncode == 0, (role, res.stderr)
    res = subprocess.run([sys.executable, "-m", "services.admin.healthcheck", "engine"], capture_output=True,
                         text=True, timeout=30, env={**env, "LOCKSTEP_NAMESPACE": "nobody"}, cwd=ROOT)
    assert res.returncode == 1 and "no live rank slot" in res.stderr


def test_api_server_output_streams_keep_their_ttl(cluster, client):
    """Engines refresh an output stream's TTL once a second, not every step
    (services/engine_worker/ttl_refresh.py): every stream still carries the hour."""
    from shared.keys import OUT_STREAM_TTL_S
    complete(client, 4)
    async def stream_ttls(c):
        return [await c.ttl(k) async for k in c.scan_iter(match=Keys(cluster.namespace).out("*"))]

    ttls = redis_get(cluster, stream_ttls)
    assert ttls and all(0 < t <= OUT_STREAM_TTL_S for t in ttls), ttls


def test_status_says_how_many_dispatches_were_resumed_requests():
    # (a resumed request is placed again and counted in dispatched: read as new work before)
    from rich.console import Console

    from services.admin.status import render
    data = {"namespace": "ls", "redis_url": "redis://x", "cluster": {"ranks": 1}, "ranks": [],
            "scheduler": {"leader": "s", "counters": {"dispatched": 12, "resumed": 3}},
            "queues": {"requests": 0, "requests_unread": 0, "requests_unacked": 0},
            "drained": [], "spares": [], "snapshot": None}
    con = Console(width=300, record=True)
    con.print(render(data))
    assert "dispatched 12 (of which 3 placed again after their rank died)" in con.export_text()
