"""Engine ranks on many hosts, on one machine (issue #18): `lockstep engine` processes as
"hosts", each advertising its own loopback address (Linux routes all of 127/8 to lo),
in its own process group, against a private Redis with a scheduler and an api-server
started as processes. Proves: the torch backend serves with the EP all-to-all crossing
the hosts, each rank's sockets listening on its host's address; a host SIGKILLed as a
whole mid-stream loses nothing; a third host of spares takes the dead host's slots and
the group serves again at full size."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import redis

from shared.keys import Keys
from shared.redis_server import free_port
from tests.helpers import poll_until
from tests.redis_topology import check_streams, stream_many

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
MODEL = "lockstep-moe"
WORLD = 4
HOST_A, HOST_B, HOST_C = "127.0.0.2", "127.0.0.3", "127.0.0.4"


class Hosts:
    """The processes of one test: scheduler, api-server and the `lockstep engine` hosts."""

    def __init__(self, redis_url: str, namespace: str, tmp: Path, backend: str) -> None:
        self.redis_url, self.namespace, self.tmp, self.backend = redis_url, namespace, tmp, backend
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/v1"
        self.procs: dict[str, subprocess.Popen] = {}
        self.r = redis.Redis.from_url(redis_url)
        self.k = Keys(namespace)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
        env.update({"LOCKSTEP_REDIS_URL": self.redis_url, "LOCKSTEP_NAMESPACE": self.namespace,
                    "LOCKSTEP_RANKS": str(WORLD), "LOCKSTEP_BACKEND": self.backend, "LOCKSTEP_NUM_API_SERVERS": "1",
                    "LOCKSTEP_PORT": str(self.port), "LOCKSTEP_HOST": "127.0.0.1", "LOCKSTEP_API_ID": "api0",
                    "LOCKSTEP_HEARTBEAT_MS": "300", "LOCKSTEP_COLLECTIVE_TIMEOUT_S": "10",
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        return env

    def start(self, name: str, *args: str, unset: tuple[str, ...] = ()) -> subprocess.Popen:
        # Its own session: a "host" is killed as a whole with killpg.
        env = {k: v for k, v in self.env().items() if k not in unset}
        with open(self.tmp / f"{name}.log", "ab") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", *args], env=env, cwd=ROOT,
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def engine_host(self, name: str, addr: str, *args: str) -> subprocess.Popen:
        return self.start(name, "engine", "--advertise-addr", addr, "--redis-url", self.redis_url,
                          "--namespace", self.namespace, "--backend", self.backend,
                          "--log-dir", str(self.tmp / name), *args)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def poll(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        """poll_until, and on a timeout the group's record and the tails of every host's and
        rank's log in the failure (a rare miss in CI could not be told apart without them)."""
        try:
            return poll_until(pred, timeout, what, interval=0.2)
        except AssertionError as exc:
            logs = [f"--- {p.relative_to(self.tmp)}\n{p.read_text(errors='replace')[-1500:]}"
                    for p in sorted(self.tmp.rglob("*.log"))]
            raise AssertionError(f"{exc}\ndist: {self.r.hgetall(self.k.dist)}\n" + "\n".join(logs)) from None

    def wait_serving(self, timeout: float = 150) -> None:
        def ready() -> bool:
            for name, p in self.procs.items():
                assert p.poll() is None, f"{name} exited with {p.returncode}:\n{self.log(name)}"
            if not all(self.r.hexists(self.k.rank_info(i), "ready") for i in range(WORLD)):
                return False
            if not self.r.exists(self.k.leader):
                return False
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        poll_until(ready, timeout, "every rank ready, a scheduler leading and the api-server healthy", interval=0.2)

    def rank_pid(self, rank: int) -> int:
        return int(self.r.hget(self.k.rank_info(rank), "pid") or 0)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.r.close()


@pytest.fixture()
def hosts(request, redis_url, namespace, tmp_path):
    made: list[Hosts] = []

    def make(backend: str) -> Hosts:
        made.append(Hosts(redis_url, namespace, tmp_path, backend))
        return made[-1]
    yield make
    for h in made:
        h.stop()


def _pinned(api_url: str, tokens: int, tag: str) -> dict[int, list[int]]:
    """Two requests pinned to each rank through the openai client; completion tokens per rank."""
    client = openai.AsyncOpenAI(base_url=api_url, api_key="x", max_retries=0, timeout=120)

    async def one(rank: int, i: int) -> int:
        r = await client.completions.create(model=MODEL, prompt=f"{tag} {rank} {i}", max_tokens=tokens, seed=i,
                                            extra_body={"ignore_eos": True, "data_parallel_rank": rank})
        return r.usage.completion_tokens

    async def main() -> dict[int, list[int]]:
        try:
            got = await asyncio.wait_for(asyncio.gather(*(one(r, i) for r in range(WORLD) for i in range(2))), 150)
        finally:
            await client.close()
        return {r: got[2 * r:2 * r + 2] for r in range(WORLD)}

    return asyncio.run(main())


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def _connected_to(pid: int) -> set[tuple[str, int]]:
    return {(c.raddr.ip, c.raddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.raddr and c.status == psutil.CONN_ESTABLISHED}


def _engine_pids(proc: subprocess.Popen) -> set[int]:
    return {c.pid for c in psutil.Process(proc.pid).children()}


def test_torch_ranks_on_two_hosts_serve_across_them(hosts):
    """(a) torch backend: ranks 0-1 on 127.0.0.2, 2-3 on 127.0.0.3; the group's EP
    all-to-all crosses the hosts, and every rank listens on its own host's address."""
    h = hosts("torch")
    h.start("scheduler", "scheduler")
    h.start("api", "api-server")
    a = h.engine_host("host-a", HOST_A, "--ranks", "0-1", "--world-size", str(WORLD))
    b = h.engine_host("host-b", HOST_B, "--ranks", "2-3")   # the size from Redis (the scheduler's)
    h.wait_serving()
    assert h.r.hget(h.k.dist, "addr") == HOST_A.encode()   # rank 0 publishes where the group meets
    got = _pinned(h.api_url, 6, "two hosts")
    assert got == {r: [6, 6] for r in range(WORLD)}, got
    pids = {r: h.rank_pid(r) for r in range(WORLD)}
    assert {pids[0], pids[1]} == _engine_pids(a) and {pids[2], pids[3]} == _engine_pids(b)
    host = {0: HOST_A, 1: HOST_A, 2: HOST_B, 3: HOST_B}
    listen = {r: _listening(pids[r]) for r in range(WORLD)}
    dials = {r: _connected_to(pids[r]) for r in range(WORLD)}
    for r in range(WORLD):   # gloo listens on the rank's own host address, not another's
        assert any(ip == host[r] for ip, _ in listen[r]), (r, listen[r])
        assert not any(ip in (HOST_A, HOST_B) and ip != host[r] for ip, _ in listen[r]), (r, listen[r])
    for i in (0, 1):         # every pair across the hosts is wired: one dialled the other's listener there
        for j in (2, 3):
            assert (dials[j] & {x for x in listen[i] if x[0] == HOST_A}
                    or dials[i] & {x for x in listen[j] if x[0] == HOST_B}), (i, j, listen, dials)
    assert f"Advertised {HOST_A}" in h.log("host-a")
    # the command notices the join on its own probe (once a second): wait for its line
    poll_until(lambda: "joined the engine group" in h.log("host-a"), 30, "host-a reports the join", 0.2)


def test_a_host_killed_mid_stream_is_replaced_by_a_host_of_spares(hosts):
    """(b) sim backend: the host of ranks 0-1 (rank 0 among them: it publishes the
    rendezvous) is SIGKILLed as a whole while 24 streams run; (c) a third host started
    with --spares 2 takes both slots, the group re-forms at full size, every stream
    completes with exactly its tokens, and the group serves every rank again."""
    h = hosts("sim")
    h.start("scheduler", "scheduler")
    h.start("api", "api-server")
    a = h.engine_host("host-a", HOST_A, "--ranks", "0-1", "--world-size", str(WORLD))
    b = h.engine_host("host-b", HOST_B, "--ranks", "2-3", "--world-size", str(WORLD))
    h.wait_serving()
    b_pids = {h.rank_pid(2), h.rank_pid(3)}
    gen = int(h.r.hget(h.k.dist, "gen"))

    n, tokens = 24, 150
    started = threading.Event()
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(stream_many(h.api_url, n, tokens, "hosts", started)))
    worker.start()
    try:
        assert started.wait(60), "no token streamed before the kill"
        os.killpg(a.pid, signal.SIGKILL)   # the host as a whole: its command and every rank
        a.wait(10)
        c = h.engine_host("host-c", HOST_C, "--spares", "2", "--world-size", str(WORLD))
        del h.procs["host-a"]

        def re_formed() -> bool:
            d = h.r.hgetall(h.k.dist)
            return (int(d.get(b"gen", 0)) > gen and d.get(b"formed") == b"1"
                    and {h.rank_pid(0), h.rank_pid(1)} <= _engine_pids(c))
        h.poll(re_formed, 120, "the spares' host took ranks 0-1 and the group re-formed")
    finally:
        worker.join(200)
    assert not worker.is_alive(), "the streams did not finish"
    check_streams(results, n, tokens, "hosts")
    # Full size again: host B's ranks are the same processes, host C runs 0-1 and, holding
    # rank 0, publishes the rendezvous on its own address.
    assert {h.rank_pid(2), h.rank_pid(3)} == b_pids
    assert h.r.hget(h.k.dist, "addr") == HOST_C.encode()
    got = _pinned(h.api_url, 5, "after")
    assert got == {r: [5, 5] for r in range(WORLD)}, got
    assert b.poll() is None and c.poll() is None

    # (d) host C started two fresh spares for the two that took slots, so the next host
    # lost is replaced too: host B SIGKILLed, C's new spares take ranks 2-3.
    def topped_up() -> bool:
        return h.log("host-c").count("to keep 2 hot spares waiting") >= 2
    h.poll(topped_up, 60, "host C started 2 fresh spares")
    gen = int(h.r.hget(h.k.dist, "gen"))
    first = {h.rank_pid(0), h.rank_pid(1)}
    os.killpg(b.pid, signal.SIGKILL)
    b.wait(10)
    del h.procs["host-b"]

    def all_on_c() -> bool:
        d = h.r.hgetall(h.k.dist)
        pids = {h.rank_pid(r) for r in range(WORLD)}
        return int(d.get(b"gen", 0)) > gen and d.get(b"formed") == b"1" and pids <= _engine_pids(c) and first <= pids
    h.poll(all_on_c, 120, "host C's fresh spares took ranks 2-3")
    got = _pinned(h.api_url, 4, "after-b")
    assert got == {r: [4, 4] for r in range(WORLD)}, got
    assert c.poll() is None


def test_a_host_takes_the_clusters_backend_and_one_of_another_is_refused(hosts):
    """The probe's deployment: `lockstep init` (sim, 4 ranks), host A with --backend sim,
    host B with neither --backend nor LOCKSTEP_BACKEND. B ran torch (the flag's default)
    and the group re-formed every few seconds for ever; now it runs the record's sim and
    the group serves. A host told torch is refused (exit 2) with the fix, before it starts
    a rank, and the group it would have joined serves on."""
    h = hosts("sim")
    init = h.start("init", "init")
    assert init.wait(30) == 0, h.log("init")
    del h.procs["init"]
    assert h.r.hget(h.k.cluster, "backend") == b"sim"
    h.start("scheduler", "scheduler")
    h.start("api", "api-server")
    h.engine_host("host-a", HOST_A, "--ranks", "0-1")
    b = h.start("host-b", "engine", "--advertise-addr", HOST_B, "--redis-url", h.redis_url, "--namespace",
                h.namespace, "--log-dir", str(h.tmp / "host-b"), "--ranks", "2-3", unset=("LOCKSTEP_BACKEND",))
    h.wait_serving()
    assert "ranks 2-3 of 4 (sim, cpu)" in h.log("host-b")
    assert [h.r.hget(h.k.rank_info(i), "backend") for i in range(WORLD)] == [b"sim"] * WORLD
    torch_host = h.start("host-t", "engine", "--advertise-addr", HOST_C, "--redis-url", h.redis_url,
                         "--namespace", h.namespace, "--log-dir", str(h.tmp / "host-t"), "--spares", "1",
                         "--backend", "torch")
    assert torch_host.wait(30) == 2, h.log("host-t")
    del h.procs["host-t"]
    assert "runs backend sim" in h.log("host-t") and "Pass --backend sim" in h.log("host-t"), h.log("host-t")
    got = _pinned(h.api_url, 4, "one backend")
    assert got == {r: [4, 4] for r in range(WORLD)}, got
    assert b.poll() is None
