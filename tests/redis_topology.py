"""Real multi-server Redis deployments for the tests, from the binary shared/redis_server.py
finds: a Redis Cluster (primaries and replicas, slots assigned with CLUSTER commands) and a
Sentinel group (a primary, a replica and a sentinel). Loopback only, nothing on disk."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import redis

from shared.redis_server import EmbeddedRedis, free_ports
from shared.tokenizer import encode
from tests.helpers import sim_expected_text

MODEL = "lockstep-moe"

SLOTS = 16384


def _wait(what: str, check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not within {timeout_s}s")


@dataclass
class LocalCluster:
    """``primaries`` shards of one primary and ``replicas`` replicas each."""

    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    servers: list[EmbeddedRedis] = field(default_factory=list)
    bus_ports: list[int] = field(default_factory=list)    # the cluster bus of each server

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5, decode_responses=True)

    def start(self) -> "LocalCluster":
        try:
            for _ in range(self.primaries * (1 + self.replicas)):
                # chosen together: picked one after the other, the server's port could be the
                # bus port just released (seen in CI: "valkey-server exited at start")
                port, bus = free_ports(2)
                self.bus_ports.append(bus)
                self.servers.append(EmbeddedRedis(port=port, extra_args=(
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(self.bus_ports[-1]), "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--cluster-replica-validity-factor", "0")).start())
            self._assemble()
        except BaseException:
            self.stop()
            raise
        return self

    def _assemble(self) -> None:
        ports = [s.port for s in self.servers]
        prim, reps = ports[:self.primaries], ports[self.primaries:]
        per = SLOTS // self.primaries
        for i, port in enumerate(prim):
            hi = SLOTS - 1 if i == self.primaries - 1 else (i + 1) * per - 1
            self.client(port).execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)
        for port in ports[1:]:
            self.client(port).execute_command("CLUSTER", "MEET", "127.0.0.1", ports[0], self.bus_ports[0])
        _wait("every node knows every other",
              lambda: all(len(self._nodes(p)) == len(ports) for p in ports))
        ids = {p: self.client(p).execute_command("CLUSTER", "MYID") for p in prim}
        for j, port in enumerate(reps):
            self.client(port).execute_command("CLUSTER", "REPLICATE", ids[prim[j % self.primaries]])
        _wait("cluster state ok with replicas in sync", self.healthy)

    def _nodes(self, port: int) -> list[str]:
        return [ln for ln in self.client(port).execute_command("CLUSTER", "NODES").splitlines() if ln.strip()]

    def healthy(self) -> bool:
        for s in self.servers:
            if s.proc is None:
                continue
            c = self.client(s.port)
            if c.cluster("info").get("cluster_state") != "ok":
                return False
            info = c.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def primary_of(self, key: str) -> int:
        """Port of the primary serving ``key``'s slot now."""
        c = self.client(next(s.port for s in self.servers if s.proc is not None))
        slot = c.cluster("keyslot", key)
        for start, end, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(primary[1])
        raise LookupError(slot)

    def replica_of(self, primary_port: int) -> int:
        for s in self.servers:
            info = self.client(s.port).info("replication") if s.proc is not None else {}
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == primary_port:
                return s.port
        raise LookupError(primary_port)

    def failover(self, primary_port: int, timeout_s: float = 30.0) -> int:
        """A manual failover of ``primary_port``'s shard (CLUSTER FAILOVER on its replica:
        the primary stops writes until the replica caught up, then they swap). Returns
        the new primary's port once every node agrees."""
        replica = self.replica_of(primary_port)
        self.client(replica).execute_command("CLUSTER", "FAILOVER")
        _wait("replica promoted", lambda: self.client(replica).info("replication")["role"] == "master", timeout_s)
        # The old primary follows the new one (so the shard can fail over again).
        _wait("old primary turned replica", lambda: int(self.client(primary_port).info("replication")
                                                          .get("master_port", 0)) == replica, timeout_s)
        _wait("cluster healthy after the failover", self.healthy, timeout_s)
        # Gossip is not instant: until every node's slot map names the new primary,
        # primary_of (which asks one node) may still answer the old one.
        _wait("every node sees the new primary", lambda: self._everyone_says_primary(replica, primary_port),
              timeout_s)
        return replica

    def _everyone_says_primary(self, new: int, old: int) -> bool:
        for s in self.servers:
            if s.proc is None:
                continue
            primaries = {int(primary[1]) for _, _, primary, *_ in
                         self.client(s.port).execute_command("CLUSTER", "SLOTS")}
            if new not in primaries or old in primaries:
                return False
        return True

    def kill_primary(self, primary_port: int, timeout_s: float = 30.0) -> int:
        """SIGKILL ``primary_port``'s server (no hand-over: what it had not replicated yet
        is gone) and wait until its replica, promoted by the others' failure detection
        (node timeout), serves the shard and every live node says the cluster is ok.
        Returns the new primary's port."""
        replica = self.replica_of(primary_port)
        server = next(s for s in self.servers if s.port == primary_port)
        server.proc.kill()
        server.proc.wait(10)
        server.stop()   # proc None: the checks below skip it
        _wait("replica promoted", lambda: self.client(replica).info("replication")["role"] == "master", timeout_s)
        _wait("cluster healthy without the killed primary", self.healthy, timeout_s)
        return replica

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalSentinel:
    """A primary, one replica and one sentinel watching them as ``service``."""

    workdir: Path
    service: str = "lsprimary"
    down_after_ms: int = 1000
    primary: EmbeddedRedis | None = None
    replica: EmbeddedRedis | None = None
    sentinel: EmbeddedRedis | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.service}"

    def start(self) -> "LocalSentinel":
        try:
            self.primary = EmbeddedRedis().start()
            self.replica = EmbeddedRedis(extra_args=("--replicaof", "127.0.0.1", str(self.primary.port))).start()
            conf = self.workdir / "sentinel.conf"
            conf.write_text(
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 1\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} 10000\n")
            self.sentinel = EmbeddedRedis(config_file=str(conf), extra_args=("--sentinel",)).start()
            _wait("replica in sync and known to the sentinel", self._ready)
        except BaseException:
            self.stop()
            raise
        return self

    def _sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel.port, socket_timeout=5, decode_responses=True)

    def _ready(self) -> bool:
        info = redis.Redis(port=self.replica.port, decode_responses=True).info("replication")
        replicas = self._sentinel().execute_command("SENTINEL", "REPLICAS", self.service)
        return info.get("master_link_status") == "up" and len(replicas) == 1

    def primary_port(self) -> int:
        return int(self._sentinel().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)[1])

    def failover(self, timeout_s: float = 30.0) -> int:
        """SENTINEL FAILOVER: the replica is promoted and the old primary made its replica.
        Returns the new primary's port once it is in charge and the old one follows it."""
        old = self.primary_port()
        self._sentinel().execute_command("SENTINEL", "FAILOVER", self.service)
        _wait("sentinel names a new primary", lambda: self.primary_port() != old, timeout_s)
        new = self.primary_port()
        _wait("old primary follows the new one",
              lambda: redis.Redis(port=old, decode_responses=True).info("replication").get("master_port") == new,
              timeout_s)
        return new

    def stop(self) -> None:
        for s in (self.sentinel, self.replica, self.primary):
            if s is not None:
                s.stop()


@dataclass
class StreamResult:
    i: int
    text: str = ""
    tokens: int | None = None       # completion tokens in the final usage chunk
    acked: bool = False             # the server answered 200 and the stream began
    error: BaseException | None = None


def stream_many(api_url: str, n: int, tokens: int, tag: str,
                started: threading.Event | None = None) -> list[StreamResult]:
    """``n`` concurrent streaming completions (prompt f"{tag} {i}", seed i, sim backend)."""
    client = openai.AsyncOpenAI(base_url=api_url, api_key="x", max_retries=0, timeout=120)

    async def one(i: int) -> StreamResult:
        res, parts = StreamResult(i), []
        try:
            stream = await client.completions.create(model=MODEL, prompt=f"{tag} {i}", max_tokens=tokens, seed=i,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            res.acked = True
            async for c in stream:
                if c.choices and c.choices[0].text:
                    parts.append(c.choices[0].text)
                    if started is not None:
                        started.set()
                if c.usage:
                    res.tokens = c.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - the caller judges each outcome
            res.error = exc
        res.text = "".join(parts)
        return res

    async def main() -> list[StreamResult]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 180)
        finally:
            await client.close()

    return asyncio.run(main())


def stream_through(api_url: str, n: int, tokens: int, tag: str, fault, join_s: float = 200) -> list[StreamResult]:
    """``stream_many`` in a thread; ``fault()`` runs once a first token has streamed (a
    failover, a kill, a stall). Returns the results once every stream ended."""
    started = threading.Event()
    results: list[StreamResult] = []
    worker = threading.Thread(target=lambda: results.extend(stream_many(api_url, n, tokens, tag, started)))
    worker.start()
    try:
        assert started.wait(60), "no token streamed before the fault"
        fault()
    finally:
        worker.join(join_s)
    assert not worker.is_alive(), "the streams did not finish"
    return results


def check_streams(results: list[StreamResult], n: int, tokens: int, tag: str) -> None:
    """Every stream completed with exactly its tokens: the sim text is a pure function of
    (seed, prompt, position), so a token lost or streamed twice anywhere shows here."""
    assert len(results) == n
    for r in results:
        assert r.error is None, (r.i, repr(r.error))
        assert r.tokens == tokens, (r.i, r.tokens)
        assert r.text == sim_expected_text(encode(f"{tag} {r.i}"), tokens, seed=r.i), r.i
