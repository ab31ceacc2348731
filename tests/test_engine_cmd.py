"""`lockstep engine` (issue #18): its command line (pure parsing, clear refusals against a
real Redis) and a clean stop: on SIGTERM this host's ranks leave and free their slots."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from services.admin.engine_cmd import (BadOption, EngineHost, EngineHostOptions, host_ranks, parse_ranks, ranks_text,
                                       resolve_world)
from shared.keys import Keys

ROOT = Path(__file__).resolve().parent.parent


def test_rank_specs():
    assert parse_ranks("8-15") == list(range(8, 16))
    assert parse_ranks("3") == [3]
    assert parse_ranks("0-3,8-11") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_ranks("2-3,0-2") == [0, 1, 2, 3]
    for bad in ("", "a-b", "5-2", "-1", "1-", "1,,2"):
        with pytest.raises(BadOption, match="--ranks"):
            parse_ranks(bad)
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert host_ranks(1, 8) == list(range(8, 16)) and host_ranks(0, 2) == [0, 1]
    with pytest.raises(BadOption, match="--host-index"):
        host_ranks(-1, 8)
    assert ranks_text([]) == ""


def test_group_size_comes_from_the_flag_or_redis_and_must_agree():
    assert resolve_world([0, 1], 4, None) == 4
    assert resolve_world([2, 3], None, 4) == 4
    assert resolve_world([], 8, 8) == 8
    with pytest.raises(BadOption, match="size is unknown: pass --world-size N"):
        resolve_world([0, 1], None, None)
    with pytest.raises(BadOption, match="--world-size 4 but the cluster in Redis has 8 ranks"):
        resolve_world([0], 4, 8)
    with pytest.raises(BadOption, match="does not fit a group of 4 ranks"):
        resolve_world([2, 3, 4], 4, None)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    return subprocess.run([sys.executable, "-m", "services.admin.cli", "engine", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def test_refusals_are_clear(redis_url, namespace):
    res = _cli("--ranks", "0-1", "--redis-url", redis_url, "--namespace", namespace)
    assert res.returncode == 2 and "the engine group's size is unknown" in res.stderr, res.stderr
    res = _cli("--ranks", "0-1")
    assert res.returncode == 2 and "pass --redis-url URL" in res.stderr, res.stderr
    res = _cli("--redis-url", redis_url)
    assert res.returncode == 2 and "--spares K" in res.stderr, res.stderr
    res = _cli("--ranks", "0-1", "--host-index", "1", "--ranks-per-host", "2", "--redis-url", redis_url)
    assert res.returncode == 2 and "not both ways" in res.stderr, res.stderr
    res = _cli("--host-index", "2", "--ranks-per-host", "2", "--redis-url", redis_url, "--namespace", namespace,
               "--world-size", "4")
    assert res.returncode == 2 and "--ranks 4-5 does not fit a group of 4 ranks" in res.stderr, res.stderr
    res = _cli("--ranks", "0-1", "--redis-url", "redis://127.0.0.1:1", "--world-size", "2")
    assert res.returncode == 2 and "cannot reach Redis" in res.stderr, res.stderr
    # The size the scheduler published is taken, and a contradicting flag refused.
    redis.Redis.from_url(redis_url).hset(Keys(namespace).cluster, "ranks", 2)
    res = _cli("--ranks", "0-2", "--redis-url", redis_url, "--namespace", namespace)
    assert res.returncode == 2 and "does not fit a group of 2 ranks" in res.stderr, res.stderr
    res = _cli("--ranks", "0", "--redis-url", redis_url, "--namespace", namespace, "--world-size", "3")
    assert res.returncode == 2 and "--world-size 3 but the cluster in Redis has 2" in res.stderr, res.stderr


@pytest.mark.timeout(120)
def test_sigterm_stops_the_host_and_frees_its_slot(redis_url, namespace, tmp_path):
    """A one-rank group on this "host": the banner names ranks, address and Redis; once
    the rank joined, SIGTERM makes it leave (its slot freed) and the command exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    env.update({"LOCKSTEP_HEARTBEAT_MS": "300", "PYTHONUNBUFFERED": "1"})
    out = tmp_path / "engine.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "engine", "--ranks", "0",
                                 "--world-size", "1", "--backend", "sim", "--redis-url", redis_url,
                                 "--namespace", namespace, "--advertise-addr", "127.0.0.5",
                                 "--log-dir", str(tmp_path / "logs")],
                                env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    try:
        deadline = time.monotonic() + 90
        while "joined the engine group" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        text = out.read_text()
        assert "ranks 0 of 1 (sim, cpu)" in text and "Advertised 127.0.0.5" in text, text
        assert redis_url.split("//")[1] in text, text
        assert r.exists(k.rank_alive(0))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, out.read_text()
        assert not r.exists(k.rank_alive(0))
        assert "stopping" in out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        r.close()


def test_supervised_processes_wait_out_a_redis_outage(tmp_path, monkeypatch):
    """`lockstep engine` and `lockstep up` checked the URL, so the processes they start
    (and restart) wait for Redis instead of exiting 2: tests/test_redis_outage_restart_live.py
    shows what an exit 2 cost. A caller's own LOCKSTEP_REDIS_WAIT_S wins."""
    from services.admin.up import LocalCluster, UpOptions
    from shared.settings import EngineSettings

    monkeypatch.delenv("LOCKSTEP_REDIS_WAIT_S", raising=False)
    host = EngineHost(EngineHostOptions(ranks=[0], redis_url="redis://h:1/0", advertise_addr="127.0.0.1", world=1,
                                        log_dir=str(tmp_path)), out=lambda _: None)
    up = LocalCluster(UpOptions(log_dir=str(tmp_path)), out=lambda _: None)
    for env in (host.env(), up._env()):
        assert EngineSettings.from_env(env).redis_wait_s == float("inf")
    assert EngineSettings.from_env({}).redis_wait_s == 0     # run by hand: a wrong URL fails fast
    monkeypatch.setenv("LOCKSTEP_REDIS_WAIT_S", "20")
    assert EngineSettings.from_env(host.env()).redis_wait_s == 20


@pytest.mark.timeout(60)
def test_a_rank_counts_as_joined_only_from_a_process_of_this_host(redis_url, namespace, tmp_path):
    """`lockstep engine` says its ranks joined once each is ready *in a process of its
    own*: a spare on another host holding the slot (this host's rank process found it
    taken and exited) is not this host joining. It said so before."""
    import asyncio

    from services.admin.supervisor import Child

    k = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = EngineHost(EngineHostOptions(ranks=[0, 1], redis_url=redis_url, advertise_addr="127.0.0.1", world=2,
                                            namespace=namespace, log_dir=str(tmp_path)), out=lambda _: None)
        host.children.append(Child("engine-0", mine, tmp_path / "engine-0.log"))
        r.hset(k.dist, "gen", 3)
        r.hset(k.rank_info(0), mapping={"ready": 1, "pid": mine.pid})
        r.hset(k.rank_info(1), mapping={"ready": 1, "pid": 999_999_999})   # a spare elsewhere
        assert asyncio.run(host.joined_gen()) is None
        r.hset(k.rank_info(1), "pid", mine.pid)
        assert asyncio.run(host.joined_gen()) == 3
    finally:
        mine.kill()
        mine.wait(10)
        r.close()


def test_a_host_whose_every_rank_is_served_elsewhere_exits_with_why(tmp_path):
    # `lockstep engine --ranks 1` beside a live rank 1 said "a spare took the rank" and then
    # idled, supervising nothing
    from services.admin.engine_cmd import SLOT_TAKEN_CODE
    from services.admin.supervisor import Child

    said: list[str] = []
    host = EngineHost(EngineHostOptions(ranks=[1], redis_url="redis://h:1/0", advertise_addr="127.0.0.1", world=2,
                                        namespace="prod", log_dir=str(tmp_path)), out=said.append)
    taken = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({SLOT_TAKEN_CODE})"])
    taken.wait(30)
    host.children.append(Child("engine-1", taken, tmp_path / "engine-1.log"))
    fatal = host.check_fatal()
    assert fatal is not None and "nothing left to run here" in fatal and "lockstep status -n prod" in fatal
    assert "already served when this host started" in said[0]
