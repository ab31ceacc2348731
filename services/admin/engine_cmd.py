"""`lockstep engine`: this host's ranks of an engine group that spans many hosts.

    lockstep engine --ranks 8-15 --redis-url URL [--advertise-addr IP] [--device cuda]

starts one engine-worker process per rank (and ``--spares`` hot spares), supervised as
``lockstep up`` supervises its own (services/admin/supervisor.py: a dead rank's slot is
freed at once and announced, so a spare on any host takes it). The ranks join the group
through Redis: rank 0 publishes where the group meets (``<ns>:dist``), every rank's
torch.distributed sockets listen on ``--advertise-addr``, the address the other hosts reach
this one at. The group's size is ``--world-size`` or, when not given, the ``ranks`` the
scheduler (or ``lockstep up``/``lockstep init``) published in ``<ns>:cluster``; the backend
is ``--backend`` (``LOCKSTEP_BACKEND``) or the record's, and a host whose backend the record
contradicts is refused (its ranks would break every collective of the group).

Ctrl-C or SIGTERM: this host's ranks leave the group (each hands its requests over to the
others and frees its slot, where a spare can take it), then the command exits.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from services.admin import local_state
from services.admin.cmd_common import log_level_known
from services.admin.supervisor import Supervisor, tail
from shared import keys as K
from shared.advertise import AddressUnknown, route_addr
from shared.bus import RedisUnreachable, check_reachable, connect, redact_url, url_with_known_nodes

# An engine that exits with 2 cannot do better on a restart: a setting it refuses, or
# Redis unreachable at its start. One that exits with 3 found its rank's slot held by
# another process: a spare (on any host) took the rank over while it restarted.
FATAL_CODE = 2
SLOT_TAKEN_CODE = 3
STOP_TIMEOUT_S = 30.0   # each rank hands its requests over within a step; then killed


class BadOption(ValueError):
    """A command line `lockstep engine` refuses, with what to use instead."""


def parse_ranks(spec: str) -> list[int]:
    """``8-15``, ``3`` or a comma list of those (``0-3,8-11``): sorted, no repeats."""
    ranks: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise BadOption(f"--ranks takes A-B, N or a comma list of them (e.g. 8-15), not {spec!r}") from None
        if a < 0 or b < a:
            raise BadOption(f"--ranks {part!r}: a range runs from a rank >= 0 up to a larger one")
        ranks.update(range(a, b + 1))
    return sorted(ranks)


def host_ranks(host_index: int, per_host: int) -> list[int]:
    """A StatefulSet's pod ``host_index`` of ``per_host`` ranks each: its contiguous block."""
    if host_index < 0 or per_host < 1:
        raise BadOption(f"--host-index must be >= 0 and --ranks-per-host >= 1, not {host_index} and {per_host}")
    return list(range(host_index * per_host, (host_index + 1) * per_host))


def ranks_text(ranks: list[int]) -> str:
    """The inverse of parse_ranks, for the banner: [0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r != start else str(r))
            start = None
    return ",".join(out)


def default_advertise_addr(url: str) -> str:
    """The address this host reaches Redis from (shared/advertise.py)."""
    try:
        return route_addr(url)
    except AddressUnknown as exc:
        raise BadOption(f"{exc}: pass --advertise-addr IP") from None


def interface_of(addr: str) -> str | None:
    """The network interface that carries ``addr`` (NCCL picks its sockets by interface)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None


async def cluster_record(url: str, namespace: str) -> dict[str, str]:
    """``<ns>:cluster``: what `up`, `init` or the scheduler published (empty: nothing yet)."""
    r = connect(url, timeout_s=5.0)
    try:
        rec = await r.hgetall(K.Keys(namespace).cluster)
    finally:
        await r.aclose()
    return {k.decode(): v.decode() for k, v in rec.items()}


def resolve_backend(given: str | None, recorded: str | None, namespace: str) -> str:
    """This host's backend: ``--backend`` (or LOCKSTEP_BACKEND), else the cluster record's,
    else torch. Refused where the two disagree: the ranks of one group exchange the
    backend's tensors at every step, so a host of another backend hangs the whole group
    (it re-formed every few seconds, for ever, while /ready said ready)."""
    for name, value in (("--backend (or LOCKSTEP_BACKEND)", given),
                        (f"the cluster record's backend ({namespace}:cluster)", recorded)):
        if value and value not in ("sim", "torch"):
            raise BadOption(f"{name} must be 'sim' or 'torch', not {value!r}")
    if given and recorded and given != recorded:
        raise BadOption(
            f"this host's backend is {given} (--backend or LOCKSTEP_BACKEND) but the cluster in Redis runs "
            f"backend {recorded} ({namespace}:cluster, written by `lockstep init` or `lockstep up`): every rank "
            f"of a group must run one backend. Pass --backend {recorded} (or leave --backend and "
            f"LOCKSTEP_BACKEND out: the record's is used); to move the whole cluster to {given}, stop every "
            f"host, run `lockstep init` with LOCKSTEP_BACKEND={given} and start them again")
    return given or recorded or "torch"


def resolve_world(ranks: list[int], given: int | None, published: int | None) -> int:
    """The group's size, from ``--world-size`` or what the cluster published; refuses a
    size unknown, contradicted, or too small for this host's ranks."""
    if given is not None and published is not None and given != published:
        raise BadOption(f"--world-size {given} but the cluster in Redis has {published} ranks "
                        f"(its scheduler's LOCKSTEP_RANKS): every rank must agree on the group's size")
    world = given if given is not None else published
    if world is None:
        raise BadOption("the engine group's size is unknown: pass --world-size N (or LOCKSTEP_RANKS), or start "
                        "the scheduler first (it publishes its LOCKSTEP_RANKS in Redis)")
    if world < 1:
        raise BadOption(f"--world-size must be at least 1, not {world}")
    if ranks and ranks[-1] >= world:
        raise BadOption(f"--ranks {ranks_text(ranks)} does not fit a group of {world} ranks (0-{world - 1})")
    return world


@dataclass
class EngineHostOptions:
    ranks: list[int]
    redis_url: str
    advertise_addr: str
    world: int
    namespace: str = "ls"
    backend: str = "torch"
    device: str = "cpu"
    spares: int = 0
    log_dir: str | None = None
    log_level: str = "info"
    extra_env: dict[str, str] = field(default_factory=dict)


class EngineHost(Supervisor):
    """This host's rank processes and spares (see the module docstring)."""

    def __init__(self, opts: EngineHostOptions, out: Callable[[str], Any] = print) -> None:
        log_dir = Path(opts.log_dir or (local_state.state_dir() / opts.namespace / "logs" / f"engine-{opts.advertise_addr}"))
        super().__init__(log_dir, out)
        self.o = opts
        self.url = opts.redis_url
        self.joined = False

    @property
    def namespace(self) -> str:
        return self.o.namespace

    @property
    def world(self) -> int:
        return self.o.world

    @property
    def spares(self) -> int:
        return self.o.spares

    def env(self) -> dict[str, str]:
        """What every process here starts with: the caller's LOCKSTEP_* settings (e.g.
        LOCKSTEP_NUM_KV_BLOCKS), then the ones this command sets; no inherited identity."""
        o = self.o
        env = {k: v for k, v in os.environ.items() if k not in ("LOCKSTEP_RANK", "LOCKSTEP_SPARE", "LOCKSTEP_API_ID")}
        env.update({
            "LOCKSTEP_REDIS_URL": o.redis_url, "LOCKSTEP_NAMESPACE": o.namespace, "LOCKSTEP_RANKS": str(o.world),
            "LOCKSTEP_BACKEND": o.backend, "LOCKSTEP_DEVICE": o.device, "LOCKSTEP_GROUP_HOST": o.advertise_addr,
            "LOCKSTEP_LOG_LEVEL": o.log_level, "PYTHONUNBUFFERED": "1",
        })
        if o.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        else:
            # NCCL's bootstrap and socket transport choose by interface name: the one that
            # carries the advertised address (an operator's own setting wins).
            iface = interface_of(o.advertise_addr)
            if iface and "NCCL_SOCKET_IFNAME" not in env:
                env["NCCL_SOCKET_IFNAME"] = iface
        # The URL was checked here: a rank restarted during a Redis outage waits it out
        # instead of exiting 2, which stops this whole host (check_fatal).
        env.setdefault("LOCKSTEP_REDIS_WAIT_S", "inf")
        env.update(o.extra_env)
        return env

    def start(self) -> None:
        from shared.settings import EngineSettings

        env = self.env()
        EngineSettings.from_env({**env, "LOCKSTEP_RANK": str(self.o.ranks[0] if self.o.ranks else -1)})   # refuse first
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base = int(env.pop("LOCKSTEP_METRICS_PORT", "") or 0)
        port = (lambda n: {"LOCKSTEP_METRICS_PORT": str(base + n)} if base else {})
        for rank in self.o.ranks:   # metrics (if asked): rank r on base + r
            self._spawn(f"engine-{rank}", ["engine-worker"], {**env, "LOCKSTEP_RANK": str(rank), **port(rank)})
        self.spare_env = {**env, "LOCKSTEP_SPARE": "1", **port(0)}   # a spare adds the rank it takes
        for _ in range(self.o.spares):
            self._spawn_spare()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        super().stop(timeout_s)

    def check_fatal(self) -> str | None:
        """A child that exited with a code a restart cannot fix: what to tell the operator.
        A rank whose slot another process holds now is served there: not restarted."""
        for c in list(self.children):
            code = c.proc.poll()
            if code == FATAL_CODE:
                return f"{c.role} exited with code {code}. Last log lines:\n{tail(c.log)}"
            if code == SLOT_TAKEN_CODE and c.role.startswith("engine-"):
                self.children.remove(c)
                why = ("a spare took the rank over" if self.joined else
                       "it was already served when this host started: by another `lockstep engine` "
                       "with the same rank, or by a spare")
                self.out(f"lockstep engine: {c.role}'s slot is held by another process ({why}); "
                         f"not restarting it. Log: {c.log}")
                if not self.spares and not any(x.proc.poll() is None for x in self.children):
                    # (it idled on, supervising nothing, as if it served a rank)
                    return ("every rank of this host is served by another process, and it keeps no spare: "
                            "nothing left to run here. Start it with other --ranks "
                            f"(`{K.admin_command('status', self.namespace)}` shows who holds which), "
                            "or with --spares N to stand by")
        return None

    async def joined_gen(self) -> int | None:
        """The group's generation once every rank of this host has joined it (from a
        process of this host: a spare elsewhere holding the slot is not this host's rank
        joining), else None."""
        k = K.Keys(self.o.namespace)
        r = connect(self.url, timeout_s=2.0)
        try:
            pipe = r.pipeline(transaction=False)
            for rank in self.o.ranks:
                pipe.hmget(k.rank_info(rank), ["ready", "pid"])
            pipe.hget(k.dist, "gen")
            res = await pipe.execute()
        finally:
            await r.aclose()
        mine = {c.proc.pid for c in self.children if c.proc.poll() is None}
        joined = all(ready and int(pid or 0) in mine for ready, pid in res[:-1])
        return int(res[-1] or 0) if joined else None

    def run(self, poll_s: float = 0.2) -> int:
        """Supervise until a signal (0, after the ranks left) or a fatal exit (1)."""
        import signal

        stop = {"sig": None}

        def on_signal(signum: int, _: Any) -> None:
            stop["sig"] = signum

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
        next_probe = 0.0
        while stop["sig"] is None:
            fatal = self.check_fatal()
            if fatal:
                self.out(f"lockstep: {fatal}")
                self.stop()
                return 1
            if not self.supervise():
                return 1
            if self.o.ranks and not self.joined and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + 1.0
                try:
                    gen = asyncio.run(self.joined_gen())
                except Exception:  # noqa: BLE001 - Redis blip: asked again in a second
                    gen = None
                if gen is not None:
                    self.joined = True
                    self.out(f"lockstep engine: ranks {ranks_text(self.o.ranks)} joined the engine group "
                             f"(generation {gen})")
            time.sleep(poll_s)
        self.out("lockstep engine: stopping (this host's ranks leave the group)...")
        self.stop()
        return 0


def banner(host: EngineHost) -> str:
    o = host.o
    spares = f"{o.spares} hot spare{'s' * (o.spares != 1)} (take any dead rank's slot)"
    return "\n".join([
        f"lockstep engine: ranks {ranks_text(o.ranks) or 'none (spares only)'} of {o.world} "
        f"({o.backend}, {o.device}) on this host",
        f"  Advertised {o.advertise_addr}   (the other hosts reach these ranks here)",
        f"  Redis      {redact_url(o.redis_url)}   namespace {o.namespace}",
        f"  Spares     {spares}",
        f"  Logs       {host.log_dir}",
        "  Stop       Ctrl-C (the ranks leave the group; their requests resume on the others)",
    ])


def register(app: typer.Typer) -> None:
    @app.command("engine")
    def engine(
        ranks: Optional[str] = typer.Option(None, "--ranks", help="This host's ranks: A-B (e.g. 8-15), N, or a comma "
                                                                   "list. None: a host of --spares only."),
        ranks_per_host: Optional[int] = typer.Option(None, "--ranks-per-host",
                                                     help="With --host-index instead of --ranks: host I runs ranks "
                                                          "I*R .. I*R+R-1 (a StatefulSet's pods)."),
        host_index: Optional[int] = typer.Option(None, "--host-index",
                                                 help="This host's index (a StatefulSet pod's ordinal)."),
        redis_url: Optional[str] = typer.Option(None, "--redis-url", envvar="LOCKSTEP_REDIS_URL",
                                                help="The group's Redis: redis://, rediss://, redis+cluster://, "
                                                     "redis+sentinel://."),
        advertise_addr: Optional[str] = typer.Option(None, "--advertise-addr", envvar="LOCKSTEP_GROUP_HOST",
                                                     help="Address the other hosts reach this host's ranks at (its "
                                                          "torch.distributed sockets listen there). Default: the "
                                                          "address this host reaches Redis from."),
        device: str = typer.Option("cpu", "--device", envvar="LOCKSTEP_DEVICE",
                                   help="cpu (gloo) or cuda (NCCL; rank r on GPU r modulo this host's GPUs)."),
        backend: Optional[str] = typer.Option(None, "--backend", envvar="LOCKSTEP_BACKEND",
                                              help="torch (a real MoE) or sim (device cost model); every host of "
                                                   "the group runs the same. Default: the cluster record's "
                                                   "(`lockstep init`/`up` wrote it), else torch."),
        spares: int = typer.Option(0, "--spares", min=0,
                                   help="Hot-spare engine processes on this host: each takes a dead rank's slot "
                                        "(any host's) at once."),
        world_size: Optional[int] = typer.Option(None, "--world-size", envvar="LOCKSTEP_RANKS",
                                                 help="Ranks in the whole group. Default: what the scheduler "
                                                      "published in Redis (its LOCKSTEP_RANKS)."),
        namespace: str = typer.Option("ls", "--namespace", "-n", envvar="LOCKSTEP_NAMESPACE",
                                      help="Key prefix of the cluster."),
        model: Optional[str] = typer.Option(None, "--model", envvar="LOCKSTEP_MODEL",
                                            help="A local checkpoint directory (the same on every host), 'random', "
                                                 "or the bundled model (default)."),
        dtype: str = typer.Option("auto", "--dtype", help="With --model: auto, bfloat16 or float32."),
        log_dir: Optional[str] = typer.Option(None, "--log-dir", help="Where the rank processes log."),
        log_level: str = typer.Option("info", "--log-level", envvar="LOCKSTEP_LOG_LEVEL",
                                      help="debug, info, warning, error."),
    ) -> None:
        """Start this host's engine ranks of a group that spans many hosts; they join it through Redis."""
        def fail(msg: str, code: int = 2) -> None:
            typer.secho(f"lockstep: {msg}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code)

        if device not in ("cpu", "cuda"):
            fail(f"--device must be 'cpu' or 'cuda', not {device!r}")
        if not log_level_known(log_level):
            fail(f"--log-level must be debug, info, warning or error, not {log_level!r}")
        if not redis_url:
            fail("lockstep engine joins its group through Redis: pass --redis-url URL (or set LOCKSTEP_REDIS_URL)")
        if (ranks_per_host is None) != (host_index is None) or (ranks and host_index is not None):
            fail("give --ranks A-B, or both --ranks-per-host R and --host-index I (not both ways)")
        if not ranks and host_index is None and spares < 1:
            fail("say what runs here: --ranks A-B (this host's ranks), --spares K (hot spares), or both")
        from services.admin.up import check_device
        from services.engine_worker.model.factory import (check_backend, check_bundled, check_checkpoint,
                                                          check_dtype, is_checkpoint)
        try:   # what can be refused before Redis is asked (with no --backend: as torch, checked again below)
            resolve_backend(backend, None, namespace)
            check_backend(model or "", backend or "torch")
            check_dtype(model or "", dtype)
            check_device(backend or "torch", device, has_flag=True)
        except (BadOption, ValueError) as exc:
            fail(str(exc))
        try:
            wanted = (parse_ranks(ranks) if ranks else host_ranks(host_index, ranks_per_host)
                      if host_index is not None else [])
            asyncio.run(check_reachable(redis_url))
            redis_url = url_with_known_nodes(redis_url)   # a cluster URL naming one node: every node
            record = asyncio.run(cluster_record(redis_url, namespace))
            world = resolve_world(wanted, world_size, int(record["ranks"]) if record.get("ranks") else None)
            backend = resolve_backend(backend, record.get("backend"), namespace)
            check_backend(model or "", backend)
            addr = advertise_addr or default_advertise_addr(redis_url)
        except (BadOption, RedisUnreachable, ValueError) as exc:
            fail(str(exc))
        if backend == "torch" and not (model and is_checkpoint(model)):
            try:
                check_bundled(world, int(os.environ.get("LOCKSTEP_MAX_MODEL_LEN", "4096")))
            except ValueError as exc:
                fail(str(exc))
        extra = {}
        if model:
            extra["LOCKSTEP_MODEL"] = model
            if is_checkpoint(model):
                try:
                    check_checkpoint(model, world, int(os.environ.get("LOCKSTEP_MAX_MODEL_LEN", "4096")))
                except (OSError, ValueError) as exc:
                    fail(str(exc))
                extra.update({"LOCKSTEP_MODEL": os.path.abspath(model), "LOCKSTEP_DTYPE": dtype})
        host = EngineHost(EngineHostOptions(ranks=wanted, redis_url=redis_url, advertise_addr=addr, world=world,
                                            namespace=namespace, backend=backend, device=device, spares=spares,
                                            log_dir=log_dir, log_level=log_level, extra_env=extra),
                          out=lambda m: typer.echo(m, err=True))
        try:
            host.start()
        except ValueError as exc:
            host.stop()
            fail(str(exc))
        typer.echo(banner(host))
        sys.stdout.flush()
        raise typer.Exit(host.run())
