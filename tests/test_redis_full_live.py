"""A full Redis (maxmemory reached, noeviction) for a moment, under a streaming request: the
ranks back off and replay their writes, as through an outage, and the request completes on
the ranks that had it. Each rank raised on the refused write and died before: a second of
a full Redis took the whole engine group down (with spares, every request was resumed
elsewhere; without, the group re-formed from restarts). Real processes, real Redis."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from shared.tokenizer import encode
from tests.conftest import start_cluster
from tests.helpers import sim_expected_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _ranks(cluster) -> dict[int, int]:
    out = cluster.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    return {r["rank"]: r["pid"] for r in json.loads(out.stdout)["ranks"]}


def test_a_moment_of_full_redis_kills_no_rank_and_loses_no_token(tmp_path):
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim", "--spares", "0")
    admin = redis.Redis.from_url(cluster.redis_url)
    try:
        client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=120)
        client.completions.create(model="lockstep-moe", prompt="warm", max_tokens=2)
        before = _ranks(cluster)
        first, texts, errors = threading.Event(), [], []

        def stream() -> None:
            try:
                chunks = client.completions.create(model="lockstep-moe", prompt="a long one", max_tokens=400,
                                                   stream=True, extra_body={"ignore_eos": True},
                                                   stream_options={"include_usage": True})
                for c in chunks:
                    if c.choices:
                        texts.append(c.choices[0].text)
                        first.set()
                    if c.usage is not None:
                        texts.append(c.usage.completion_tokens)
            except Exception as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)
            finally:
                first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60), "no token streamed"
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        time.sleep(1.5)   # the fault's length: a second and a half of refused writes
        admin.config_set("maxmemory", "0")
        t.join(120)
        assert not t.is_alive() and not errors, errors
        assert texts[-1] == 400, texts[-1]             # usage: every token, none twice
        assert _ranks(cluster) == before               # no rank died and was replaced
        status = json.loads(cluster.cli("status", "--json").stdout)
        assert status["scheduler"]["counters"].get("resumed", 0) == 0   # (absent while none)
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
        cluster.stop()


class _Streams:
    """``n`` streamed completions of ``want`` tokens each (seeded, ignore_eos), started on
    ``cluster``; returns once every one has its first token. ``check`` waits for their ends
    and asserts each is exactly the sim's text."""

    def __init__(self, cluster, n: int, want: int = 600) -> None:
        self.n, self.want = n, want
        self.texts: dict[int, str] = {}
        self.errors: list[BaseException] = []
        client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=150)
        client.completions.create(model="lockstep-moe", prompt="warm", max_tokens=2)
        started = threading.Barrier(n + 1, timeout=60)

        def stream(i: int) -> None:
            out, first = [], True
            try:
                for c in client.completions.create(model="lockstep-moe", prompt=f"stream {i}", max_tokens=want,
                                                   seed=i, stream=True, extra_body={"ignore_eos": True}):
                    if c.choices:
                        out.append(c.choices[0].text)
                        if first:
                            first = False
                            started.wait()
                self.texts[i] = "".join(out)
            except BaseException as exc:  # noqa: BLE001 - asserted in check()
                self.errors.append(exc)
                if first:
                    started.abort()

        self.threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()
        started.wait()

    def check(self) -> None:
        for t in self.threads:
            t.join(150)
        assert not any(t.is_alive() for t in self.threads), "a stream hung"
        assert not self.errors, self.errors
        for i in range(self.n):
            assert self.texts[i] == sim_expected_text(encode(f"stream {i}"), self.want, seed=i), i


@pytest.mark.parametrize("fault", ["full", "write_pause"])
def test_a_full_redis_that_outlasts_every_heartbeat_loses_no_stream(tmp_path, fault):
    """Ten seconds of refused writes (``full``: maxmemory) or blocked ones (``write_pause``:
    CLIENT PAUSE WRITE, as a FAILOVER does), reads still answered: longer than the
    api-servers' alive keys and the ranks' heartbeats live. Every rank took the live
    api-servers for dead and aborted their requests (the abort's delta then waited for a
    write), the api-server resumed them as newer copies on the same ranks, and those were
    dropped as duplicates: streams hung with half their text. Each must end with exactly
    the sim's text."""
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim", "--spares", "0")
    admin = redis.Redis.from_url(cluster.redis_url)
    try:
        streams = _Streams(cluster, 6)                  # every stream has tokens
        if fault == "full":
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", "1")
            readiness = set()                           # (a full Redis answers PING: /ready said "ready")
            until = time.monotonic() + 10.0             # the fault's length
            while time.monotonic() < until:
                ready = httpx.get(cluster.api_url.removesuffix("/v1") + "/ready", timeout=5)
                readiness.add((ready.status_code, ready.json().get("reason")))
                time.sleep(0.5)
            admin.config_set("maxmemory", "0")
            assert (503, "redis_unavailable") in readiness, readiness
        else:
            admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
            time.sleep(10.0)
            admin.execute_command("CLIENT", "UNPAUSE")
        streams.check()
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")     # first: a paused server would hold the next write
        admin.config_set("maxmemory", "0")
        admin.close()
        cluster.stop()


def test_a_rank_waiting_in_the_collective_through_a_full_redis_aborts_nothing(tmp_path):
    """A full Redis while one rank's step loop waits in the collective for its peer (CI:
    the peer's write of the step was refused just after this rank's went through). That
    rank made no round trip of its own, so it saw no Redis trouble, took the api-server's
    lapsed alive key for a dead api-server and aborted its streams: clients read "the
    api-server serving it stopped answering". Its refused heartbeats now say Redis is at
    fault. Here the peer is frozen (SIGSTOP) a moment before the fault, which puts the
    other rank in the collective for certain."""
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim", "--spares", "0")
    admin = redis.Redis.from_url(cluster.redis_url)
    frozen = _ranks(cluster)[0]
    try:
        streams = _Streams(cluster, 4)                  # every stream has tokens, on both ranks
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(1.0)                                 # rank 1 ends its step and waits in the collective
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        time.sleep(10.0)                                # the fault's length: longer than the alive keys live
        admin.config_set("maxmemory", "0")
        os.kill(frozen, signal.SIGCONT)
        streams.check()
        # (the api-server may resume an aborted request before the abort's error reaches it:
        # the rank's log says whether it took the live api-server for dead)
        log = (Path(cluster.state_dir) / cluster.namespace / "logs" / "engine-1.log").read_text()
        assert "aborted_requests_of_dead_api_server" not in log
    finally:
        os.kill(frozen, signal.SIGCONT)
        admin.config_set("maxmemory", "0")
        admin.close()
        cluster.stop()
