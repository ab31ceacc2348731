"""The cluster record ``<ns>:cluster`` (`lockstep init`/`up`) is what the services started
one by one agree on. A probe of a multi-host deployment found it ignored or overwritten:

- a host of another backend joined the group (`lockstep engine` without --backend ran
  torch beside sim ranks): the group re-formed every few seconds, for ever, every request
  hung while /ready said ready. Now refused (exit 2), by `lockstep engine` and by each
  engine-worker, with the fix in the message;
- `lockstep engine` ignored LOCKSTEP_BACKEND and LOCKSTEP_LOG_LEVEL (deploy/k8s runs it
  without --backend beside LOCKSTEP_BACKEND=sim): now the flag, else the variable, else the
  record's backend, else torch;
- a standby scheduler with another LOCKSTEP_RANKS rewrote the record as it took the lead
  (a healthy 4-rank cluster answered 503 "4 of 8 ranks"): now it refuses to lead (exit 2),
  and a leader writes back the whole record (backend, port) after Redis lost it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from shared.keys import Keys

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
RECORD = {"ranks": 4, "api_servers": 1, "policy": "waterfill", "dispatch": "scheduler", "backend": "sim",
          "port": 8123, "started": 1.5}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra})
    return env


def _run(args: list[str], env: dict[str, str], out: Path, timeout: float = 45) -> tuple[int, str]:
    """A lockstep command in its own session, to its exit; one that runs on past ``timeout``
    (what these commands did before the fixes) is killed with every process it started."""
    with open(out, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", *args], env=env, cwd=ROOT, stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise AssertionError(f"`lockstep {args[0]}` still ran after {timeout}s:\n{out.read_text()[-3000:]}") from None
    return code, out.read_text(errors="replace")


@pytest.fixture()
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_backend_comes_from_the_flag_or_the_record_and_must_agree():
    from services.admin.engine_cmd import BadOption, resolve_backend

    assert resolve_backend("sim", None, "ls") == "sim"
    assert resolve_backend(None, "sim", "ls") == "sim"       # no flag, no variable: the record's
    assert resolve_backend("torch", "torch", "ls") == "torch"
    assert resolve_backend(None, None, "ls") == "torch"       # neither: the default
    with pytest.raises(BadOption) as err:
        resolve_backend("torch", "sim", "prod")
    msg = str(err.value)
    assert "runs backend sim (prod:cluster" in msg and "Pass --backend sim" in msg, msg
    assert "LOCKSTEP_BACKEND=torch" in msg and "lockstep init" in msg, msg
    with pytest.raises(BadOption, match="must be 'sim' or 'torch', not 'gpu'"):
        resolve_backend("gpu", None, "ls")


def test_engine_refuses_a_backend_the_record_contradicts(redis_url, namespace, r, tmp_path):
    """The probe's host B, told torch (by the flag or by LOCKSTEP_BACKEND) in a sim cluster:
    refused before it starts a process; before, it joined and hung the group."""
    r.hset(Keys(namespace).cluster, mapping=RECORD)
    base = ["engine", "--ranks", "2-3", "--redis-url", redis_url, "--namespace", namespace,
            "--advertise-addr", "127.0.0.3", "--log-dir", str(tmp_path / "logs")]
    for args, env in ((["--backend", "torch"], _env()), ([], _env(LOCKSTEP_BACKEND="torch"))):
        code, out = _run(base + args, env, tmp_path / "engine.out")
        assert code == 2, out
        assert "the cluster in Redis runs backend sim" in out and "Pass --backend sim" in out, out
    # LOCKSTEP_LOG_LEVEL reaches the command too (it was overwritten with --log-level's default)
    code, out = _run(base, _env(LOCKSTEP_LOG_LEVEL="loud"), tmp_path / "engine.out")
    assert code == 2 and "--log-level must be" in out and "'loud'" in out, out


@pytest.mark.timeout(150)
def test_engine_without_backend_runs_the_records(redis_url, namespace, r, tmp_path):
    """deploy/k8s runs `lockstep engine` with no --backend: the ranks run the cluster's
    backend (the record's; here no LOCKSTEP_BACKEND either), not torch."""
    k = Keys(namespace)
    r.hset(k.cluster, mapping={**RECORD, "ranks": 1})
    out = tmp_path / "engine.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "engine", "--ranks", "0",
                                 "--redis-url", redis_url, "--namespace", namespace, "--advertise-addr", "127.0.0.5",
                                 "--log-dir", str(tmp_path / "logs")],
                                env=_env(LOCKSTEP_HEARTBEAT_MS="300"), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "joined the engine group" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        assert "ranks 0 of 1 (sim, cpu)" in out.read_text(), out.read_text()
        assert r.hget(k.rank_info(0), "backend") == b"sim"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_an_engine_worker_of_another_backend_does_not_join(redis_url, namespace, r, tmp_path):
    """Started without `lockstep engine` (compose, `up`, by hand): the rank itself refuses,
    exit 2 (what `lockstep engine` takes for a setting a restart cannot fix)."""
    r.hset(Keys(namespace).cluster, mapping={**RECORD, "ranks": 1})
    env = _env(LOCKSTEP_REDIS_URL=redis_url, LOCKSTEP_NAMESPACE=namespace, LOCKSTEP_RANKS="1", LOCKSTEP_RANK="0",
               LOCKSTEP_BACKEND="torch", LOCKSTEP_MODEL="random", LOCKSTEP_GROUP_HOST="127.0.0.1")
    code, out = _run(["engine-worker"], env, tmp_path / "worker.out")
    assert code == 2, out
    assert "runs backend sim" in out and "Set LOCKSTEP_BACKEND=sim" in out, out
    assert not r.exists(Keys(namespace).rank_alive(0))   # it never took the slot


def test_a_scheduler_with_other_ranks_does_not_lead(redis_url, namespace, r, tmp_path):
    """The probe's standby with LOCKSTEP_RANKS=8 beside a 4-rank cluster: it exits 2 with
    both numbers, never holds the lease, and the record keeps its 4 ranks."""
    k = Keys(namespace)
    r.hset(k.cluster, mapping=RECORD)
    env = _env(LOCKSTEP_REDIS_URL=redis_url, LOCKSTEP_NAMESPACE=namespace, LOCKSTEP_RANKS="8",
               LOCKSTEP_LEASE_MS="300")
    code, out = _run(["scheduler"], env, tmp_path / "scheduler.out")
    assert code == 2, out
    assert "LOCKSTEP_RANKS is 8" in out and "says 4 ranks" in out and "LOCKSTEP_RANKS=4" in out, out
    assert r.hget(k.cluster, "ranks") == b"4" and not r.exists(k.leader)


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _note(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    def bind(self, **_: Any) -> "_Log":
        return self

    info = warning = error = debug = _note


def test_the_leader_keeps_the_record_and_writes_it_back_whole(redis_url, namespace, r):
    """A leader whose policy differs from the record's leads (the policy is its own to run)
    with a warning, and leaves the record as `init` wrote it; after Redis lost the record
    (restarted empty) it writes back all of it, backend and port too (it wrote back only
    ranks, policy, dispatch and api_servers)."""
    from services.scheduler.service import SchedulerService
    from shared.bus import connect
    from shared.settings import SchedulerSettings

    k = Keys(namespace)
    r.hset(k.cluster, mapping=RECORD)
    written = {key.decode(): v.decode() for key, v in r.hgetall(k.cluster).items()}

    async def go() -> None:
        svc = SchedulerService(SchedulerSettings(redis_url=redis_url, namespace=namespace, lease_ms=300, ranks=4,
                                                 policy="round_robin"))
        svc.log = log = _Log()
        svc.attach(connect(redis_url))
        try:
            assert await asyncio.wait_for(svc.leadership.become_leader(), 10) is True
            assert any(e == "cluster_record_differs" and "round_robin" in kw.get("policy", "")
                       for e, kw in log.events), log.events
            assert {key.decode(): v.decode() for key, v in r.hgetall(k.cluster).items()} == written
            r.delete(k.cluster, k.leader)             # what a Redis restarted empty holds of them
            await asyncio.wait_for(svc.leadership.renew_lease(), 10)
            assert any(e == "lease_reacquired" for e, _ in log.events), log.events
            assert {key.decode(): v.decode() for key, v in r.hgetall(k.cluster).items()} == written
        finally:
            await svc.r.aclose()

    asyncio.run(go())


def test_a_first_scheduler_writes_its_settings_where_there_is_no_record(redis_url, namespace, r):
    # nothing to contradict (no `lockstep init`): it leads and the record is its settings
    from services.scheduler.service import SchedulerService
    from shared.bus import connect
    from shared.settings import SchedulerSettings

    async def go() -> None:
        svc = SchedulerService(SchedulerSettings(redis_url=redis_url, namespace=namespace, lease_ms=300, ranks=3))
        svc.log = _Log()
        svc.attach(connect(redis_url))
        try:
            assert await asyncio.wait_for(svc.leadership.become_leader(), 10) is True
        finally:
            await svc.r.aclose()

    asyncio.run(go())
    rec = r.hgetall(Keys(namespace).cluster)
    assert rec[b"ranks"] == b"3" and rec[b"policy"] == b"waterfill" and rec[b"api_servers"] == b"1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_up_persist_restarts_with_another_rank_count(tmp_path):
    """`lockstep up --persist` brings back the last run's record (2 ranks) with its data;
    `up` writes the new one (1 rank) before it starts the scheduler, which therefore leads
    (it must not take the snapshot's record for a contradiction), and the cluster serves."""
    from tests.conftest import start_cluster
    from tests.redis_topology import check_streams, stream_many

    persist = str(tmp_path / "rdb")
    for run, ranks in enumerate((2, 1)):
        tmp = tmp_path / f"run{run}"
        tmp.mkdir()
        cluster = start_cluster(tmp, "--ranks", str(ranks), "--api-servers", "1", "--backend", "sim",
                                "--persist", persist, namespace="lsp")
        try:
            check_streams(stream_many(cluster.api_url, 2, 4, f"run{run}"), 2, 4, f"run{run}")
            client = redis.Redis.from_url(cluster.redis_url)
            assert client.hget(Keys("lsp").cluster, "ranks") == str(ranks).encode()
            assert client.exists(Keys("lsp").leader)
            client.close()
        finally:
            assert cluster.stop() == 0, (tmp / "up.out").read_text()
