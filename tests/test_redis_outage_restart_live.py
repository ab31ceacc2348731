"""A process started while Redis is down waits for it (LOCKSTEP_REDIS_WAIT_S), instead of
exiting 2 at once. `lockstep engine` treats exit 2 as fatal and stops the whole host, and
`lockstep up` stops the cluster after a child exits 5 times in a minute, so before this a
rank that died during a Redis outage took its host down with it and the group never
re-formed. Real Redis servers, real processes; the outage is a stopped server that comes
back on the same port with its data (an RDB snapshot)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import psutil
import pytest
import redis

from shared.bus import BadRedisUrlError, RedisUnreachable, wait_reachable
from shared.keys import Keys
from shared.redis_server import EmbeddedRedis, free_port
from tests.helpers import poll_until

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


@pytest.mark.timeout(60)
def test_wait_reachable_waits_for_a_server_that_starts_late(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    failures: list[int] = []
    first_failure = threading.Event()

    def on_wait(error: str, attempt: int) -> None:
        assert "cannot reach Redis" in error
        failures.append(attempt)
        first_failure.set()

    # The waiter runs in a thread; the server starts from this one (a child started from a
    # thread dies with the thread: PDEATHSIG).
    outcome: list[BaseException | None] = []

    def waiter() -> None:
        try:
            asyncio.run(asyncio.wait_for(wait_reachable(url, 30.0, on_wait=on_wait), 40))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    server = EmbeddedRedis(port=port)
    try:
        assert first_failure.wait(30), "wait_reachable never reported a failed attempt"
        server.start()
        thread.join(40)
        assert outcome == [None], outcome
        assert failures[0] == 1
    finally:
        thread.join(40)
        server.stop()


@pytest.mark.timeout(30)
def test_wait_reachable_gives_up_at_once_without_a_wait_or_when_stopped():
    url = f"redis://127.0.0.1:{free_port()}/0"

    async def main() -> None:
        with pytest.raises(RedisUnreachable, match="cannot reach Redis"):
            await wait_reachable(url, 0.0, on_wait=lambda *_: pytest.fail("no wait was asked for"))
        with pytest.raises(BadRedisUrlError, match="bad Redis URL"):   # waiting cannot fix a typo
            await wait_reachable("redis+nonsense://x", float("inf"))
        stop = asyncio.Event()
        task = asyncio.create_task(wait_reachable(url, float("inf"), stop=stop, on_wait=lambda *_: stop.set()))
        with pytest.raises(RedisUnreachable):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())


def _env(url: str, namespace: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    env.update({"LOCKSTEP_REDIS_URL": url, "LOCKSTEP_NAMESPACE": namespace, "LOCKSTEP_RANKS": str(WORLD),
                "LOCKSTEP_BACKEND": "sim", "LOCKSTEP_NUM_API_SERVERS": "1", "LOCKSTEP_PORT": str(port),
                "LOCKSTEP_API_ID": "api0", "LOCKSTEP_HEARTBEAT_MS": "300", "LOCKSTEP_COLLECTIVE_TIMEOUT_S": "10",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_during_a_redis_outage_comes_back_and_its_host_stays_up(namespace, tmp_path):
    """Redis stops; rank 1 of a `lockstep engine` host is SIGKILLed meanwhile. Its
    restart waits for Redis (it logs redis_waiting) instead of exiting 2, the host keeps
    running, and once Redis is back the group re-forms and serves every rank."""
    server = EmbeddedRedis(persist_dir=str(tmp_path / "rdb")).start()
    url, api_port = server.url, free_port()
    env = _env(url, namespace, api_port)
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *args: str) -> None:
        with open(tmp_path / f"{name}.log", "ab") as fh:
            procs[name] = subprocess.Popen([sys.executable, "-m", "services.admin.cli", *args], env=env, cwd=ROOT,
                                           stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:]

    def all_up() -> None:
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited with {p.returncode}:\n{log(name)}"

    k = Keys(namespace)
    r = redis.Redis.from_url(url)

    def rank_pids() -> list[int]:
        return [int(r.hget(k.rank_info(i), "pid") or 0) for i in range(WORLD)]

    try:
        start("scheduler", "scheduler")
        start("api", "api-server")
        start("host", "engine", "--ranks", f"0-{WORLD - 1}", "--advertise-addr", "127.0.0.1", "--backend", "sim",
              "--log-dir", str(tmp_path / "host"))

        def served() -> bool:
            all_up()
            return "joined the engine group" in log("host")
        poll_until(served, 150, "the host's ranks joined the group", interval=0.2)
        old = rank_pids()
        assert all(old), old
        served_by_rank = asyncio.run(_pinned(api_port, "before"))
        assert served_by_rank == {i: 8 for i in range(WORLD)}, served_by_rank
        r.close()

        server.stop()                                    # the outage begins (an RDB is saved)
        os.kill(old[1], signal.SIGKILL)
        rank_log = tmp_path / "host" / "engine-1.log"

        def restarted_and_waiting() -> bool:
            all_up()
            return "redis_waiting" in rank_log.read_text(errors="replace")
        poll_until(restarted_and_waiting, 60, "rank 1 restarted and waiting for Redis", interval=0.1)
        all_up()

        server.start()                                   # same port, same data
        r = redis.Redis.from_url(url)

        def reformed() -> bool:
            all_up()
            pids = rank_pids()
            return pids[1] not in (0, old[1]) and all(r.exists(k.rank_alive(i)) for i in range(WORLD))
        poll_until(reformed, 120, "the restarted rank 1 holds its slot again", interval=0.2)
        served_by_rank = asyncio.run(_pinned(api_port, "after"))
        assert served_by_rank == {i: 8 for i in range(WORLD)}, served_by_rank
        all_up()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        r.close()
        server.stop()


async def _pinned(port: int, tag: str) -> dict[int, int]:
    """One request pinned to each rank; its completion tokens, by rank."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=90)

    async def one(rank: int) -> int:
        res = await client.completions.create(model="lockstep-moe", prompt=f"{tag} {rank}", max_tokens=8,
                                              extra_body={"ignore_eos": True, "data_parallel_rank": rank})
        return res.usage.completion_tokens

    try:
        got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(WORLD))), 100)
    finally:
        await client.close()
    return dict(enumerate(got))


@pytest.mark.timeout(60)
def test_a_server_that_cannot_start_says_why():
    """The embedded server's own words reach the error (a port taken: the server prints
    it on stdout, which went nowhere, so `up`'s restart of its Redis said "exited at
    start (code 1):" and nothing more)."""
    import socket

    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(RuntimeError, match="Address already in use"):
            EmbeddedRedis(port=port).start()


@pytest.mark.timeout(90)
def test_an_api_server_started_during_an_outage_answers_503_until_redis_is_back(tmp_path):
    """It used to bind its port only once Redis was back: its clients got "connection
    refused" (nothing there) instead of a retryable 503 that says why."""
    import httpx

    redis_port, api_port = free_port(), free_port()
    env = {**os.environ, "LOCKSTEP_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", "LOCKSTEP_REDIS_WAIT_S": "60",
           "LOCKSTEP_PORT": str(api_port), "LOCKSTEP_HOST": "127.0.0.1", "LOCKSTEP_NAMESPACE": "waitroom"}
    api = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "api-server"], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{api_port}"
    server = EmbeddedRedis(port=redis_port)
    try:
        def answered() -> httpx.Response | None:
            try:
                return httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=5)
            except httpx.TransportError:
                return None
        r = poll_until(answered, 30, "the api-server's port answering during the outage")
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert r.json()["error"]["code"] == "redis_unavailable" and "retry" in r.json()["error"]["message"]
        assert httpx.get(base + "/health", timeout=5).status_code == 503
        server.start()

        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=5).json().get("status") == "ok"
            except (httpx.TransportError, ValueError):
                return False
        poll_until(healthy, 40, "the api-server serving once Redis is back")
        assert api.poll() is None
    finally:
        api.terminate()
        api.wait(20)
        server.stop()


def test_the_waiting_rooms_answer_shows_the_url_without_its_password():
    from services.api_server.waiting_room import unavailable_response
    answer = unavailable_response("redis://user:s3cret@10.0.0.5:6379/0").decode()
    assert answer.startswith("HTTP/1.1 503 ") and "s3cret" not in answer and "10.0.0.5:6379" in answer
