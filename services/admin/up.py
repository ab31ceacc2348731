"""`lockstep up`: a whole local cluster in one command.

Starts a private Redis-compatible server unless given a URL, then the scheduler, the
engine ranks and the api-server replicas as child processes; waits until they are ready;
prints where to reach them; and on Ctrl-C/SIGTERM stops them all (then the server), so
nothing is left behind. Children get PDEATHSIG, so even a SIGKILL of `up` takes them down.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.admin import local_state
from services.admin.supervisor import MAX_RESTARTS_PER_MIN, STOP_FLOOR_S, Child, Supervisor, tail
from shared import keys as K
from shared.bus import RedisUnreachable, check_reachable, connect, redact_url, url_with_known_nodes
from shared.redis_server import EmbeddedRedis

__all__ = ["Child", "ClusterRunning", "LocalCluster", "MAX_RESTARTS_PER_MIN", "UpOptions", "banner", "check_options", "served_model"]


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


class ClusterRunning(RuntimeError):
    """Another cluster serves the namespace on the Redis given with --redis-url."""


async def live_cluster(r: Any, k: K.Keys, ranks: int) -> str:
    """What of a cluster in ``k``'s namespace is alive on ``r`` (a leading scheduler, ranks
    with a heartbeat), in words; "" when nothing is."""
    recorded = await r.hget(k.cluster, "ranks")
    n = max(ranks, int(recorded) if recorded and recorded.isdigit() else 0)
    pipe = r.pipeline(transaction=False)
    pipe.exists(k.leader)
    for rank in range(n):   # one key each: their slots differ on Redis Cluster
        pipe.exists(k.rank_alive(rank))
    leader, *alive = await pipe.execute()
    live = [rank for rank, a in enumerate(alive) if a]
    parts = (["a scheduler holds its lead"] if leader else []) + (
        [f"rank{'s' if len(live) > 1 else ''} {', '.join(map(str, live))} with a heartbeat"] if live else [])
    return " and ".join(parts)


class LocalCluster(Supervisor):
    """Everything on this machine; the children's supervision is services/admin/supervisor.py."""

    def __init__(self, opts: UpOptions, out: Any = print) -> None:
        super().__init__(Path(opts.log_dir or (local_state.state_dir() / opts.namespace / "logs")), out)
        self.o = opts
        self.redis: EmbeddedRedis | None = None
        self.url = ""
        self.started = time.time()
        self._redis_restarts: list[float] = []     # when the embedded Redis was started again
        self._api_grace_s = 5.0                     # the api-servers' shutdown_grace_s

    @property
    def namespace(self) -> str:
        return self.o.namespace

    @property
    def world(self) -> int:
        return self.o.ranks

    @property
    def spares(self) -> int:
        return self.o.spares

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
        # refuse a combination the services would refuse, before starting any
        self._api_grace_s = check_options(o)[1].shutdown_grace_s
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
        # (said once Redis answers: a wrong --redis-url said "starting" before its error)
        self.out(f"lockstep: starting {o.ranks} {o.backend} rank{'s' * (o.ranks != 1)} and {o.api_servers} "
                 f"api-server{'s' * (o.api_servers != 1)}...")
        self.url = url_with_known_nodes(self.url)   # a cluster URL naming one node: every node
        asyncio.run(self._prepare_redis())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Recorded before anything serves: the API answers a few seconds before every spare
        # is up, and the admin commands (status, bench) find the cluster by this record
        # (stop() removes it, on a failed start too).
        local_state.write(o.namespace, {
            "redis_url": self.url, "pid": os.getpid(), "namespace": o.namespace,
            "api_url": self.api_url, "port": o.port, "ranks": o.ranks, "api_servers": o.api_servers,
            "log_dir": str(self.log_dir), "started": time.time()})
        env = self._env()
        # Metrics only if asked: LOCKSTEP_METRICS_PORT=N gives the scheduler N and rank i N+1+i.
        # They listen on up's --host, as the API does (LOCKSTEP_METRICS_HOST overrides it).
        mport = int(env.pop("LOCKSTEP_METRICS_PORT", "") or 0)
        mhost = env.pop("LOCKSTEP_METRICS_HOST", "") or o.host
        port_env = (lambda n: {"LOCKSTEP_METRICS_PORT": str(mport + n), "LOCKSTEP_METRICS_HOST": mhost}
                    if mport else {})
        self._spawn("scheduler", ["scheduler"], {**env, **port_env(0)})
        for i in range(1, o.schedulers):   # standbys: take the lease (and the metrics port) when the leader dies
            self._spawn(f"scheduler-{i}", ["scheduler"], {**env, **port_env(0)})
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

    @property
    def base_url(self) -> str:
        host = self.o.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.o.port}"   # an IPv6 address in brackets

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    async def _prepare_redis(self) -> None:
        o = self.o
        k = K.Keys(o.namespace)
        r = connect(self.url)
        try:
            if o.redis_url:
                # Another `up` (another host, user or state directory: the local record does
                # not see it) may serve this namespace on this Redis; starting beside it took
                # its lead and dist keys and crash-looped these ranks for want of a free slot.
                live = await live_cluster(r, k, o.ranks)
                if live:
                    raise ClusterRunning(
                        f"a cluster already runs in namespace {o.namespace!r} at {redact_url(self.url)} ({live}); "
                        "stop it first, or use another --namespace (a killed cluster's heartbeats lapse within "
                        "a few seconds)")
            # A previous run in this namespace may have left coordination keys behind.
            await r.delete(k.dist, k.leader, k.drained, k.snapshot)
        finally:
            await r.aclose()
        await self._publish_cluster()

    async def _publish_cluster(self) -> None:
        """What this cluster is, in ``<ns>:cluster`` (status, the engine-down check)."""
        o = self.o
        r = connect(self.url)
        try:
            await r.hset(K.Keys(o.namespace).cluster, mapping={
                "ranks": o.ranks, "api_servers": o.api_servers, "policy": o.policy, "dispatch": o.dispatch,
                "backend": o.backend, "port": o.port, "started": self.started})
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
        # `up` checked the URL: a child restarted during a Redis outage waits it out
        # (exiting at once would count towards the restart limit and stop the cluster).
        env.setdefault("LOCKSTEP_REDIS_WAIT_S", "inf")
        env.update(o.extra_env)
        return env

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.o.ready_timeout_s
        ranks_ready = api_ready = leader = False
        while time.monotonic() < deadline:
            self._check_children()
            if not (ranks_ready and leader):
                ranks_ready, leader = asyncio.run(self._probe_redis())
            if not api_ready:
                try:
                    api_ready = httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200
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
            pipe.hmget(k.scheduler, "live", "drained")
            res = await pipe.execute()
            spares = [key async for key in r.scan_iter(match=k.spare("*"), count=1000)]
        finally:
            await r.aclose()
        # A rank is ready once its engine group formed; a spare once it waits for a slot; the
        # leader once it counts every rank live (it learns them from their heartbeats, a few
        # hundred ms after the group forms: requests sent before then all went to the ranks it
        # knew, and stayed there)
        ranks, (has_leader, (live, drained)) = res[:self.o.ranks], res[self.o.ranks:]
        known = set(_json_list(live)) | set(_json_list(drained))
        leader = bool(has_leader) and known >= set(range(self.o.ranks))
        return all(ranks) and len(spares) >= self.o.spares, leader

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
                last = tail(c.log)
                self.stop()
                raise RuntimeError(f"{c.role} exited with code {code} during start-up. Last log lines:\n{last}")

    # ------------------------------------------------------------------ run / stop
    def supervise(self) -> bool:
        """The children's round (services/admin/supervisor.py), and the embedded Redis's:
        a server that died is started again on its port, or every service would retry
        against nothing for ever."""
        if self.redis is not None and (self.redis.proc is None or self.redis.proc.poll() is not None):
            if not self._restart_redis():
                self.stop()
                return False
        return super().supervise()

    def _restart_redis(self) -> bool:
        """Start the embedded Redis that exited again, same port and data directory (with
        ``--persist`` its last snapshot comes back; without it the data set is new, which
        the api-servers notice and answer each request in flight with a retryable error).
        False once it keeps dying (5 times in a minute)."""
        old = self.redis
        assert old is not None
        code = old.proc.returncode if old.proc is not None else "(a failed restart)"
        now = time.monotonic()
        self._redis_restarts = [t for t in self._redis_restarts if now - t < 60] + [now]
        if len(self._redis_restarts) > MAX_RESTARTS_PER_MIN:
            self.say(f"the embedded Redis keeps exiting (more than {MAX_RESTARTS_PER_MIN} times in a minute); "
                     "stopping.")
            return False
        old.stop()
        snapshot = bool(old.persist_dir) and (Path(old.persist_dir) / "dump.rdb").exists()
        try:
            self.redis = EmbeddedRedis(port=old.port, persist_dir=old.persist_dir).start()
        except (RuntimeError, TimeoutError) as exc:
            self.say(f"the embedded Redis exited with code {code} and did not start again: {exc}")
            self.redis = old   # proc None: tried again next round
            return True
        data = (f"its data from {old.persist_dir}'s last snapshot" if snapshot else
                f"its data lost: {old.persist_dir} had no snapshot yet (requests in flight fail with a retryable "
                "error)" if old.persist_dir else
                "its data lost (requests in flight fail with a retryable error; --persist keeps it)")
        self.say(f"the embedded Redis exited with code {code}; started it again on port {old.port}, {data}")
        try:
            asyncio.run(self._publish_cluster())
        except Exception:  # noqa: BLE001 - the services work without it; status shows less
            pass
        return True

    def wait(self) -> int:
        """Block until a signal or until a child keeps dying; returns the exit code for `up`."""
        return self.wait_for_signal()

    def stop(self, timeout_s: float = 10.0) -> None:
        # api-servers first (no new work), then the scheduler, then the engines (and their
        # spares), then Redis. Engines get SIGINT: the whole group stops together (SIGTERM
        # would make each rank leave alone, handing its requests to the others). The
        # api-servers' grace for the requests in flight (+ their own close) comes first.
        timeout_s = max(timeout_s, self._api_grace_s + 3 + 2 * STOP_FLOOR_S)
        self._stop_children([("api", signal.SIGTERM), ("scheduler", signal.SIGTERM),
                             (("engine", "spare"), signal.SIGINT)], timeout_s)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        local_state.remove(self.o.namespace, os.getpid())
        from services.api_server import metrics_dir
        metrics_dir.remove_runs(self.o.namespace, self.o.port)   # (they piled up: one per run, in /tmp)


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served by a new cluster, or None. The api-servers bind
    with SO_REUSEPORT (the replicas share the port), so a second cluster's would bind beside
    another's and the kernel would split the clients between the two: bound here without it,
    any listener there makes the bind fail."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"unknown host ({exc}); give a --host this machine resolves (e.g. 127.0.0.1 or 0.0.0.0)"
    family, kind, proto, _, addr = infos[0]   # the address the api-servers bind (main.py)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a closed one's TIME_WAIT is no owner
        sock.bind(addr)
        sock.listen(1)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            return (f"{why}. Another process listens there (another lockstep cluster's api-servers would share "
                    "the port and split its clients with this one): stop it, or pick another --port")
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"{why}: {host} is not an address of this machine; give one it has (or 0.0.0.0 for all)"
        return f"{why}; pick another --host or --port"
    finally:
        sock.close()
    return None


def check_options(opts: UpOptions) -> list[Any]:
    """The settings every child of ``up`` would start with (from the environment it gets);
    raises ValueError, with a message saying what to use instead, for a combination the
    services refuse (e.g. ``--dispatch client --policy staggered``). Returns them."""
    from shared.settings import ApiServerSettings, EngineSettings, SchedulerSettings, SettingsError

    env = LocalCluster(opts, out=lambda _: None)._env()
    try:
        settings = [cls.from_env(env) for cls in (SchedulerSettings, ApiServerSettings, EngineSettings)]
    except SettingsError as exc:   # name the flag a value came from, not the variable `up` passed it in
        msg = str(exc)
        for var, flag in FLAG_OF_VARIABLE.items():
            msg = msg.replace(f"{var}=", f"{flag} ")
        raise ValueError(msg) from None
    check_device(settings[-1].backend, settings[-1].device)
    return settings


# the children's variables that `up` sets from its own options (LocalCluster._env)
FLAG_OF_VARIABLE = {"LOCKSTEP_NAMESPACE": "--namespace", "LOCKSTEP_RANKS": "--ranks", "LOCKSTEP_BACKEND": "--backend",
                    "LOCKSTEP_POLICY": "--policy", "LOCKSTEP_DISPATCH": "--dispatch",
                    "LOCKSTEP_NUM_API_SERVERS": "--api-servers", "LOCKSTEP_PORT": "--port", "LOCKSTEP_HOST": "--host",
                    "LOCKSTEP_TIME_SCALE": "--time-scale", "LOCKSTEP_LOG_LEVEL": "--log-level"}


def persist_problem(path: str) -> str | None:
    """Why the embedded Redis cannot keep its data in ``path`` (None: it can; a missing
    directory is created). It failed in the middle of the start, with a traceback."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        return f"--persist {path} is a file; give a directory (created if missing) for the embedded Redis's data"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--persist {path}: cannot create that directory ({exc.strerror}); give one you can write to"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"--persist {path}: this user cannot write there; give a directory you can write to"
    return None


def check_device(backend: str, device: str, *, has_flag: bool = False) -> None:
    """Refuse ``cuda`` for torch ranks on a machine with no GPU they can see: each rank
    would retry its start for ever while `up` waited out its ready timeout. ``has_flag``:
    the command has ``--device`` (`lockstep engine`; `up` reads LOCKSTEP_DEVICE only)."""
    if backend != "torch" or device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        given, instead = (("--device cuda or LOCKSTEP_DEVICE=cuda", "unset LOCKSTEP_DEVICE, or --device cpu")
                          if has_flag else ("LOCKSTEP_DEVICE=cuda", "unset LOCKSTEP_DEVICE"))
        raise ValueError(f"device cuda ({given}), but no CUDA device is visible on this machine: check "
                         f"CUDA_VISIBLE_DEVICES and the driver (nvidia-smi), or run on the CPU ({instead})")


def served_model(o: UpOptions) -> str:
    """The name clients send: a checkpoint is served under its directory's name."""
    model = o.extra_env.get("LOCKSTEP_MODEL") or os.environ.get("LOCKSTEP_MODEL") or "lockstep-moe"
    return Path(model).name if Path(model).is_dir() else model


def banner(cluster: LocalCluster) -> str:
    o = cluster.o
    return "\n".join([
        f"lockstep is up: {o.ranks} rank{'s' * (o.ranks != 1)} ({o.backend}) + {o.spares} hot "
        f"spare{'s' * (o.spares != 1)}, {o.api_servers} api-server{'s' * (o.api_servers != 1)}, policy {o.policy}",
        f"  API        {cluster.api_url}   (OpenAI-compatible; model '{served_model(o)}')",
        f"  Redis      {redact_url(cluster.url)}" + ("   (embedded, stops with this command)" if cluster.redis else ""),
        f"  Logs       {cluster.log_dir}",
        f"  Inspect    {K.admin_command('status', o.namespace)}",
        "  Stop       Ctrl-C",
    ])


def _json_list(raw: bytes | str | None) -> list:
    try:
        value = json.loads(raw) if raw else []
    except ValueError:
        return []
    return value if isinstance(value, list) else []
