"""`lockstep up`: a whole local cluster in one command.

Starts a private Redis-compatible server unless given a URL, then the scheduler, the
engine ranks and the api-server replicas as child processes; waits until they are ready;
prints where to reach them; and on Ctrl-C/SIGTERM stops them all (then the server), so
nothing is left behind. Children get PDEATHSIG, so even a SIGKILL of `up` takes them down.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.admin import local_state
from shared import keys as K
from shared import lease
from shared.bus import RedisUnreachable, check_reachable, connect, redact_url
from shared.redis_server import EmbeddedRedis, die_with_parent


@dataclass
class UpOptions:
    ranks: int = 4
    api_servers: int = 2
    port: int = 8000
    host: str = "127.0.0.1"
    backend: str = "torch"
    policy: str = "waterfill"
    dispatch: str = "scheduler"
    namespace: str = "ls"
    redis_url: str | None = None
    persist_dir: str | None = None
    time_scale: float = 1.0
    log_dir: str | None = None
    log_level: str = "info"
    ready_timeout_s: float = 180.0
    schedulers: int = 1
    spares: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)   # when it was restarted (recent ones)


MAX_RESTARTS_PER_MIN = 5


class LocalCluster:
    def __init__(self, opts: UpOptions, out: Any = print) -> None:
        self.o = opts
        self.out = out
        self.redis: EmbeddedRedis | None = None
        self.url = ""
        self.children: list[Child] = []
        self.spare_env: dict[str, str] = {}
        self.spares_started = 0
        self.log_dir = Path(opts.log_dir or (local_state.state_dir() / opts.namespace / "logs"))

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Start everything; a SIGTERM/SIGINT during start-up stops what was started."""
        def interrupted(signum: int, _: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum} during start-up")

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, interrupted)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        o = self.o
        check_options(o)   # refuse a combination the services would refuse, before starting any
        if o.redis_url:
            self.url = o.redis_url
        else:
            self.redis = EmbeddedRedis(persist_dir=o.persist_dir).start()
            self.url = self.redis.url
        try:
            asyncio.run(check_reachable(self.url))
        except RedisUnreachable:
            self.stop()
            raise
        asyncio.run(self._prepare_redis())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = self._env()
        # Metrics only if asked: LOCKSTEP_METRICS_PORT=N gives the scheduler N and rank i N+1+i.
        mport = int(env.pop("LOCKSTEP_METRICS_PORT", "") or 0)
        port_env = (lambda n: {"LOCKSTEP_METRICS_PORT": str(mport + n)} if mport else {})
        self._spawn("scheduler", ["scheduler"], {**env, **port_env(0)})
        for i in range(1, o.schedulers):   # standbys: take the lease when the leader dies
            self._spawn(f"scheduler-{i}", ["scheduler"], env)
        for i in range(o.ranks):
            self._spawn(f"engine-{i}", ["engine-worker"], {**env, "LOCKSTEP_RANK": str(i), **port_env(1 + i)})
        # Hot spares (they take only slots of a group that formed, never a starting rank's);
        # a spare serves metrics on base + the rank it takes.
        self.spare_env = {**env, "LOCKSTEP_SPARE": "1", **port_env(1)}
        for _ in range(o.spares):
            self._spawn_spare()
        for i in range(o.api_servers):
            self._spawn(f"api-{i}", ["api-server"], {**env, "LOCKSTEP_API_ID": f"api{i}"})
        self._wait_ready()
        local_state.write(o.namespace, {
            "redis_url": self.url, "pid": os.getpid(), "namespace": o.namespace,
            "api_url": self.api_url, "port": o.port, "ranks": o.ranks, "api_servers": o.api_servers,
            "log_dir": str(self.log_dir), "started": time.time()})

    @property
    def api_url(self) -> str:
        return f"http://{self.o.host}:{self.o.port}/v1"

    async def _prepare_redis(self) -> None:
        o = self.o
        k = K.Keys(o.namespace)
        r = connect(self.url)
        try:
            # A previous run in this namespace may have left coordination keys behind.
            await r.delete(k.dist, k.leader, k.drained, k.snapshot)
            await r.hset(k.cluster, mapping={
                "ranks": o.ranks, "api_servers": o.api_servers, "policy": o.policy, "dispatch": o.dispatch,
                "backend": o.backend, "port": o.port, "started": time.time()})
        finally:
            await r.aclose()

    def _env(self) -> dict[str, str]:
        o = self.o
        # The caller's LOCKSTEP_* settings that `up` does not set itself reach every child
        # (e.g. LOCKSTEP_NUM_KV_BLOCKS for the engines); the ones below always win, and a
        # per-process identity (rank, api id) is never inherited.
        env = {k: v for k, v in os.environ.items() if k not in ("LOCKSTEP_RANK", "LOCKSTEP_API_ID")}
        env.update({
            "LOCKSTEP_REDIS_URL": self.url, "LOCKSTEP_NAMESPACE": o.namespace, "LOCKSTEP_RANKS": str(o.ranks),
            "LOCKSTEP_BACKEND": o.backend, "LOCKSTEP_POLICY": o.policy, "LOCKSTEP_DISPATCH": o.dispatch,
            "LOCKSTEP_NUM_API_SERVERS": str(o.api_servers), "LOCKSTEP_PORT": str(o.port), "LOCKSTEP_HOST": o.host,
            "LOCKSTEP_TIME_SCALE": str(o.time_scale), "LOCKSTEP_LOG_LEVEL": o.log_level,
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
        })
        env.update(o.extra_env)
        return env

    def _spawn(self, role: str, args: list[str], env: dict[str, str]) -> None:
        log = self.log_dir / f"{role}.log"
        self.children.append(Child(role, self._popen(args, env, log), log, args, env))

    def _spawn_spare(self) -> None:
        self.spares_started += 1
        self._spawn(f"spare-{self.spares_started}", ["engine-worker"], self.spare_env)

    @staticmethod
    def _popen(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        fh = open(log, "ab")
        try:
            return subprocess.Popen([sys.executable, "-m", "services.admin.cli", *args], env=env,
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=die_with_parent)
        finally:
            fh.close()

    def _restart(self, c: Child, code: int) -> bool:
        """Replace a dead child; give up if it keeps dying. An engine process's slot is
        freed at once and announced, so a hot spare takes the rank over (the scheduler
        resumes the dead one's requests meanwhile); a fresh spare is started in its
        place. Without spares the process starts again for its own rank."""
        engine = c.role.startswith(("engine-", "spare-"))
        # An engine that exits 0 while the cluster runs left on purpose (SIGTERM: a rolling
        # restart of one rank); it handed its requests over and gave its slot back. Its
        # replacement is routine, not a crash: it does not count towards the limit.
        planned = engine and code == 0
        now = time.monotonic()
        if not planned:
            c.restarts = [t for t in c.restarts if now - t < 60] + [now]
        if len(c.restarts) > MAX_RESTARTS_PER_MIN:
            return False
        how = "left the group (planned)" if planned else f"exited with code {code}"
        rank = None
        if engine:
            try:
                rank = asyncio.run(self._release_rank(c.proc.pid))
            except Exception:  # noqa: BLE001 - the heartbeat TTL frees the slot anyway
                pass
        if engine and self.o.spares > 0:
            self.children.remove(c)
            self._spawn_spare()
            held = f"a hot spare takes rank {rank}; " if rank is not None else ""
            self.out(f"lockstep: {c.role} {how}; {held}started "
                     f"{self.children[-1].role} in its place. Log: {c.log}")
            self.children[-1].restarts = c.restarts
            return True
        c.proc = self._popen(c.args, c.env, c.log)
        self.out(f"lockstep: {c.role} {how}; restarted it. Log: {c.log}")
        return True

    async def _release_rank(self, dead_pid: int) -> int | None:
        """The supervisor saw an engine process die: free the slot it held now instead of
        waiting for its heartbeat to lapse, and announce it (a hot spare pops the list and
        claims the slot at once; the scheduler resumes the requests as the rank leaves).
        Returns the rank it held, if any (a spare holds none)."""
        k = K.Keys(self.o.namespace)
        r = connect(self.url, timeout_s=2.0)
        try:
            pipe = r.pipeline(transaction=False)
            for rank in range(self.o.ranks):
                pipe.hmget(k.rank_info(rank), ["pid", "token"])
                pipe.get(k.rank_alive(rank))
            res = await pipe.execute()
            for rank in range(self.o.ranks):
                (pid, token), alive = res[2 * rank], res[2 * rank + 1]
                if int(pid or 0) == dead_pid and token is not None and alive == token:
                    # Compare-and-delete: a spare may have taken the slot since the read.
                    if not await lease.release(r, k.rank_alive(rank), token.decode()):
                        return None
                    pipe = r.pipeline(transaction=True)
                    pipe.lpush(k.vacancies, rank)
                    pipe.ltrim(k.vacancies, 0, 63)
                    await pipe.execute()
                    return rank
            return None
        finally:
            await r.aclose()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.o.ready_timeout_s
        ranks_ready = api_ready = leader = False
        while time.monotonic() < deadline:
            self._check_children()
            if not (ranks_ready and leader):
                ranks_ready, leader = asyncio.run(self._probe_redis())
            if not api_ready:
                try:
                    api_ready = httpx.get(f"http://{self.o.host}:{self.o.port}/health", timeout=1.0).status_code == 200
                except httpx.HTTPError:
                    api_ready = False
            if ranks_ready and api_ready and leader:
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the cluster was not ready within {self.o.ready_timeout_s:g}s; "
                           f"see the logs in {self.log_dir}")

    async def _probe_redis(self) -> tuple[bool, bool]:
        k = K.Keys(self.o.namespace)
        r = connect(self.url)
        try:
            pipe = r.pipeline(transaction=False)
            for i in range(self.o.ranks):
                pipe.hget(k.rank_info(i), "ready")
            pipe.exists(k.leader)
            res = await pipe.execute()
            spares = [key async for key in r.scan_iter(match=k.spare("*"), count=1000)]
        finally:
            await r.aclose()
        # A rank is ready once its engine group formed; a spare once it waits for a slot.
        return all(res[:-1]) and len(spares) >= self.o.spares, bool(res[-1])

    def _check_children(self) -> None:
        for c in list(self.children):
            code = c.proc.poll()
            if code == 0:
                # Left on purpose, not a bad start: a scheduler whose lease lapsed on a
                # starved machine steps down, an engine told to leave. Replace it.
                if not self._restart(c, code):
                    raise RuntimeError(f"{c.role} keeps exiting during start-up. Log: {c.log}")
                continue
            if code is not None:
                tail = _tail(c.log)
                self.stop()
                raise RuntimeError(f"{c.role} exited with code {code} during start-up. Last log lines:\n{tail}")

    # ------------------------------------------------------------------ run / stop
    def wait(self) -> int:
        """Block until a signal or until a child dies; returns the exit code for `up`."""
        stop = {"sig": None}

        def on_signal(signum: int, _: Any) -> None:
            stop["sig"] = signum

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
        while stop["sig"] is None:
            if not self.supervise():
                return 1
            time.sleep(0.2)
        self.out("lockstep: stopping...")
        self.stop()
        return 0

    def supervise(self) -> bool:
        """One round of the supervisor: replace the children that exited. False (and the
        cluster stopped) when one keeps exiting. ``lockstep chaos`` drives it too."""
        for c in list(self.children):
            code = c.proc.poll()
            if code is None:
                continue
            if not self._restart(c, code):
                self.out(f"lockstep: {c.role} keeps exiting ({MAX_RESTARTS_PER_MIN} times in a minute); "
                         f"stopping the cluster. Log: {c.log}")
                self.stop()
                return False
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        # api-servers first (no new work), then the scheduler, then the engines (and their
        # spares), then Redis. Engines get SIGINT: the whole group stops together (SIGTERM
        # would make each rank leave alone, handing its requests to the others).
        order = [("api", signal.SIGTERM), ("scheduler", signal.SIGTERM), (("engine", "spare"), signal.SIGINT)]
        for prefix, sig in order:
            group = [c for c in self.children if c.role.startswith(prefix) and c.proc.poll() is None]
            for c in group:
                c.proc.send_signal(sig)
            deadline = time.monotonic() + timeout_s
            for c in group:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(5)
        self.children = [c for c in self.children if c.proc.poll() is None]
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        local_state.remove(self.o.namespace, os.getpid())


def check_options(opts: UpOptions) -> list[Any]:
    """The settings every child of ``up`` would start with (from the environment it gets);
    raises ValueError, with a message saying what to use instead, for a combination the
    services refuse (e.g. ``--dispatch client --policy staggered``). Returns them."""
    from shared.settings import ApiServerSettings, EngineSettings, SchedulerSettings

    env = LocalCluster(opts, out=lambda _: None)._env()
    return [cls.from_env(env) for cls in (SchedulerSettings, ApiServerSettings, EngineSettings)]


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def served_model(o: UpOptions) -> str:
    """The name clients send: a checkpoint is served under its directory's name."""
    model = o.extra_env.get("LOCKSTEP_MODEL") or os.environ.get("LOCKSTEP_MODEL") or "lockstep-moe"
    return Path(model).name if Path(model).is_dir() else model


def banner(cluster: LocalCluster) -> str:
    o = cluster.o
    return "\n".join([
        f"lockstep is up: {o.ranks} ranks ({o.backend}) + {o.spares} hot spare{'s' * (o.spares != 1)}, "
        f"{o.api_servers} api-servers, policy {o.policy}",
        f"  API        {cluster.api_url}   (OpenAI-compatible; model '{served_model(o)}')",
        f"  Redis      {redact_url(cluster.url)}" + ("   (embedded, stops with this command)" if cluster.redis else ""),
        f"  Logs       {cluster.log_dir}",
        "  Inspect    lockstep status",
        "  Stop       Ctrl-C",
    ])
