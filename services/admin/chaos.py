"""`lockstep chaos`: steady load against a local cluster while processes die, then a
check of every request: completed exactly once with the right text and token count, or
failed with a clear error — never lost, never duplicated (issue #14).

Pure parts: ``fault_schedule`` (which fault when, from a seed) and ``classify`` (what a
request's outcome was). The shell starts a `lockstep up --backend sim` cluster in this
process (its supervisor replaces what dies, as `up` does), drives the load with httpx
(streaming and not), injects the faults, and prints a table (or ``--json``).

Faults: SIGKILL of a rank's process (rank 0 included; a hot spare takes the slot), a
rank leaving on SIGTERM (a rolling restart), SIGKILL of the leading scheduler (a standby
takes the lease), SIGKILL of an api-server (`up` restarts it; its clients' connections
drop: a retryable failure they see), and a restart of Redis itself (persistent: it saves
on the way down and loads on the way up).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import queue
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import orjson
import typer

from shared.policy.registry import DEFAULT_POLICY, policy_names

KINDS = ("rank_kill", "rank_leave", "scheduler", "api", "redis")
MODEL = "lockstep-moe"
OUTCOMES = ("completed", "failed", "lost", "duplicated", "corrupt")


@dataclass(frozen=True, slots=True)
class Fault:
    t: float        # seconds after the load started
    kind: str       # one of KINDS
    target: int     # the rank (rank_kill, rank_leave) or api-server index (api); 0 otherwise


def fault_schedule(seed: int, duration_s: float, ranks: int, api_servers: int, every_s: float | None = None,
                   warmup_s: float = 3.0, cooldown_s: float | None = None,
                   kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of a run, a pure function of its arguments.

    Faults start after ``warmup_s`` and end ``cooldown_s`` before the load stops (the
    last one must have time to recover while requests still flow). They come every
    ``every_s`` (default: at most 10 s, and close enough that every kind fits once), each
    late by a seeded jitter of up to a quarter period. Kinds go round in seeded shuffles,
    so every kind comes once in each round; rank faults (kills and leaves together) go
    round the ranks the same way, so rank 0 is hit whenever there are as many rank
    faults as ranks."""
    rng = random.Random(seed)
    cooldown = min(15.0, max(6.0, duration_s * 0.2)) if cooldown_s is None else cooldown_s
    end = duration_s - cooldown
    if end <= warmup_s:
        return []
    every = every_s if every_s else min(10.0, (end - warmup_s) / len(kinds))
    rank_cycle: list[int] = []
    api_cycle: list[int] = []
    round_: list[str] = []
    out: list[Fault] = []
    k = 0
    while True:
        t = warmup_s + k * every + rng.uniform(0, every / 4)
        if t > end:
            return out
        if not round_:
            round_ = list(kinds)
            rng.shuffle(round_)
        kind = round_.pop()
        target = 0
        if kind in ("rank_kill", "rank_leave"):
            if not rank_cycle:
                rank_cycle = list(range(ranks))
                rng.shuffle(rank_cycle)
            target = rank_cycle.pop()
        elif kind == "api":
            if not api_cycle:
                api_cycle = list(range(api_servers))
                rng.shuffle(api_cycle)
            target = api_cycle.pop()
        out.append(Fault(round(t, 3), kind, target))
        k += 1


def classify(expected: str, max_tokens: int, text: str | None, tokens: int | None, error: str | None) -> str:
    """One request's outcome. ``error``: the clear failure the client got (then it failed,
    whatever it had received); ``text`` None: no answer within the bound (lost). A
    success must carry exactly the expected text and token count; more than expected
    is a duplicate, a prefix of it a loss, anything else corrupt."""
    if error is not None:
        return "failed"
    if text is None:
        return "lost"
    if text == expected and tokens == max_tokens:
        return "completed"
    if (tokens or 0) > max_tokens or len(text) > len(expected):
        return "duplicated"
    return "lost" if expected.startswith(text) else "corrupt"


def expected_text(prompt: str, max_tokens: int, seed: int) -> str:
    """What the sim backend answers with ``ignore_eos``: a pure function of (seed, prompt, position)."""
    from services.engine_worker.sim_backend import SimTokenStream
    from shared.tokenizer import EOS, StreamDecoder, encode

    stream = SimTokenStream(seed, encode(prompt))
    out = [ord(" ") if (tok := stream.token_at(pos)) == EOS else tok for pos in range(max_tokens)]
    dec = StreamDecoder()          # as the api-server decodes it: a character cut at the end is dropped
    return dec.feed(out) + dec.flush()


# ---------------------------------------------------------------------------- the load
@dataclass
class Outcome:
    i: int
    stream: bool
    max_tokens: int
    outcome: str
    error: str | None
    latency_s: float
    message: str = ""      # what the client was told (the first 200 characters)


async def _one(http: Any, url: str, i: int, run_seed: int, max_tokens: int, stream: bool, timeout_s: float) -> Outcome:
    import httpx

    prompt = f"chaos {run_seed} {i}"
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "seed": i,
                            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    text: str | None = None
    tokens: int | None = None
    error: str | None = None
    message = ""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            if stream:
                async with http.stream("POST", url + "/completions", json=body) as resp:
                    if resp.status_code != 200:
                        error, message = _http_error(resp.status_code, await resp.aread())
                    else:
                        got, done = "", False
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                done = True
                                break
                            doc = orjson.loads(line[6:])
                            if "error" in doc:
                                err = doc["error"] or {}
                                error = "stream_error:" + str(err.get("code") or err.get("type") or "none")
                                message = str(err.get("message"))
                                break
                            for ch in doc.get("choices") or ():
                                got += ch.get("text") or ""
                            if doc.get("usage"):
                                tokens = doc["usage"]["completion_tokens"]
                        if error is None:
                            if done:
                                text = got
                            else:
                                error = "connection:stream_cut"
            else:
                resp = await http.post(url + "/completions", json=body)
                if resp.status_code != 200:
                    error, message = _http_error(resp.status_code, resp.content)
                else:
                    doc = resp.json()
                    text, tokens = doc["choices"][0]["text"], doc["usage"]["completion_tokens"]
    except TimeoutError:
        text, error = None, None
    except httpx.TransportError as exc:
        error, message = f"connection:{exc.__class__.__name__}", str(exc)
    outcome = classify(expected_text(prompt, max_tokens, i), max_tokens, text, tokens, error)
    return Outcome(i, stream, max_tokens, outcome, error, round(time.monotonic() - t0, 3), message[:200])


def _http_error(status: int, raw: bytes) -> tuple[str, str]:
    """(``http_<status>:<code>``, message) for an OpenAI error body; ``http_<status>:unclear``
    for anything else (a traceback, an empty body)."""
    try:
        err = orjson.loads(raw).get("error") or {}
        code = err.get("code") or err.get("type") or "none"
        msg = err.get("message")
        return (f"http_{status}:{code}", str(msg)) if msg else (f"http_{status}:unclear", raw[:200].decode(errors="replace"))
    except (orjson.JSONDecodeError, AttributeError):
        return f"http_{status}:unclear", raw[:200].decode(errors="replace")


async def drive_load(url: str, run_seed: int, duration_s: float, concurrency: int, timeout_s: float,
                     results: list[Outcome]) -> None:
    """``concurrency`` closed-loop clients until ``duration_s``; every request bounded by
    ``timeout_s``. No keep-alive: a request never rides a connection to a dead replica."""
    import httpx

    counter = itertools.count()
    start = time.monotonic()
    limits = httpx.Limits(max_keepalive_connections=0, max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=limits) as http:
        async def client(w: int) -> None:
            rng = random.Random(run_seed * 7919 + w)
            while time.monotonic() - start < duration_s:
                i = next(counter)
                res = await _one(http, url, i, run_seed, rng.randint(8, 48), i % 2 == 0, timeout_s)
                results.append(res)
                if res.outcome == "failed":
                    await asyncio.sleep(0.2)   # a replica or Redis is down: do not spin on it
        await asyncio.gather(*(client(w) for w in range(concurrency)))


# ---------------------------------------------------------------------------- the faults
class Injector:
    """Applies faults to a LocalCluster (blocking; run on the cluster's owner thread)."""

    def __init__(self, cluster: Any) -> None:
        from shared.keys import Keys

        self.c = cluster
        self.keys = Keys(cluster.o.namespace)

    def apply(self, f: Fault) -> str:
        """Inject one fault; returns '' or why it was skipped."""
        import redis

        from shared.bus import connect_sync

        if f.kind == "api":
            procs = [c.proc for c in list(self.c.children) if c.role == f"api-{f.target}" and c.proc.poll() is None]
            if not procs:
                return "api-server not running"
            procs[0].kill()
            return ""
        if f.kind == "redis":
            return self._restart_redis()
        r = connect_sync(self.c.url, timeout_s=2, connect_timeout_s=2)
        try:
            if f.kind == "scheduler":
                pid, sig = r.hget(self.keys.scheduler, "pid"), signal.SIGKILL
            else:
                pid = r.hget(self.keys.rank_info(f.target), "pid")
                sig = signal.SIGKILL if f.kind == "rank_kill" else signal.SIGTERM
        except redis.RedisError as exc:
            return f"redis: {exc.__class__.__name__}"
        finally:
            r.close()
        mine = {c.proc.pid for c in list(self.c.children) if c.proc.poll() is None}
        if pid is None or int(pid) not in mine:   # never signal a process this run did not start
            return "no such process of this cluster"
        os.kill(int(pid), sig)
        return ""

    def _restart_redis(self, down_s: float = 1.0) -> str:
        from shared.redis_server import EmbeddedRedis

        old = self.c.redis
        if old is None:
            return "Redis is not embedded"
        port, persist = old.port, old.persist_dir
        old.stop()      # SIGTERM: a persistent server saves its data set on the way down
        time.sleep(down_s)
        self.c.redis = EmbeddedRedis(port=port, persist_dir=persist).start()
        return ""


class ClusterOwner(threading.Thread):
    """The one thread that starts processes once the cluster runs (the supervisor's
    restarts, the injector's Redis restart) and stops the cluster before it ends. A child
    gets its parent-death signal (shared/redis_server.py ``die_with_parent``) when the
    *thread* that started it exits: respawned from short-lived worker threads, Redis and
    restarted ranks were killed as the load ended, before the cluster's orderly stop, and
    every run's logs filled with the tracebacks of that."""

    def __init__(self, cluster: Any, poll_s: float = 0.2) -> None:
        super().__init__(name="chaos-owner", daemon=True)
        self.cluster, self.poll_s = cluster, poll_s
        self.jobs: queue.Queue = queue.Queue()
        self.finish = threading.Event()

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((fut, fn, args))
        return fut

    def run(self) -> None:
        supervising = True
        try:
            while not self.finish.is_set():
                try:
                    fut, fn, args = self.jobs.get(timeout=self.poll_s)
                except queue.Empty:
                    supervising = supervising and self.cluster.supervise()   # False: it gave up
                    continue
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                        fut.set_exception(exc)
        finally:
            while not self.jobs.empty():
                self.jobs.get_nowait()[0].cancel()
            self.cluster.stop()


async def _inject_all(owner: ClusterOwner, injector: Injector, faults: list[Fault], start: float,
                      log: list[dict[str, Any]]) -> None:
    for f in faults:
        await asyncio.sleep(max(0.0, start + f.t - time.monotonic()))
        skipped = await asyncio.wrap_future(owner.submit(injector.apply, f))
        log.append({**asdict(f), "at": round(time.monotonic() - start, 3), "skipped": skipped})


# ---------------------------------------------------------------------------- the run
def summarize(faults: list[dict[str, Any]], results: list[Outcome]) -> dict[str, Any]:
    by = Counter(r.outcome for r in results)
    return {
        "faults": dict(Counter(f["kind"] for f in faults if not f["skipped"])),
        "faults_skipped": [f for f in faults if f["skipped"]],
        "sent": len(results),
        **{o: by.get(o, 0) for o in OUTCOMES},
        "failed_by_kind": dict(Counter(r.error for r in results if r.outcome == "failed")),
        "failed_examples": {r.error: r.message for r in results if r.outcome == "failed"},
        "not_exact": [asdict(r) for r in results if r.outcome in ("lost", "duplicated", "corrupt")][:50],
    }


def render(res: dict[str, Any]) -> str:
    lines = ["faults injected", *(f"  {k:<12}{res['faults'].get(k, 0):>8}" for k in KINDS)]
    if res["faults_skipped"]:
        lines.append(f"  (skipped {len(res['faults_skipped'])}: "
                     + "; ".join(f"{f['kind']} {f['skipped']}" for f in res["faults_skipped"]) + ")")
    lines += ["requests",
              f"  {'sent':<12}{res['sent']:>8}", f"  {'completed':<12}{res['completed']:>8}",
              f"  {'failed':<12}{res['failed']:>8}",
              *(f"    {k:<26}{v:>8}" for k, v in sorted(res["failed_by_kind"].items())),
              f"  {'lost':<12}{res['lost']:>8}", f"  {'duplicated':<12}{res['duplicated']:>8}",
              f"  {'corrupt':<12}{res['corrupt']:>8}"]
    if res.get("run"):
        lines.append("run: " + ", ".join(f"{k}={v}" for k, v in res["run"].items()))
    return "\n".join(lines)


def chaos_options(seed: int, ranks: int, api_servers: int, work: Path, policy: str = DEFAULT_POLICY,
                  dispatch: str = "scheduler", spares: int = 1, schedulers: int = 2) -> Any:
    """The chaos cluster's `up` options; ValueError (what to use instead) for a combination
    the services refuse."""
    from services.admin.up import UpOptions, check_options
    from shared.redis_server import free_port

    opts = UpOptions(ranks=ranks, api_servers=api_servers, port=free_port(), backend="sim", namespace=f"chaos{seed}",
                     persist_dir=str(work / "redis"), log_dir=str(work / "logs"), schedulers=schedulers,
                     spares=spares, policy=policy, dispatch=dispatch)
    check_options(opts)
    return opts


def run_chaos(duration_s: float, seed: int, ranks: int = 2, api_servers: int = 2, concurrency: int = 8,
              every_s: float | None = None, timeout_s: float = 90.0, work_dir: str | None = None,
              out: Any = print, policy: str = DEFAULT_POLICY, dispatch: str = "scheduler", spares: int = 1,
              schedulers: int = 2) -> dict[str, Any]:
    from services.admin.up import LocalCluster

    work = Path(work_dir or tempfile.mkdtemp(prefix="lockstep-chaos-"))
    opts = chaos_options(seed, ranks, api_servers, work, policy, dispatch, spares, schedulers)
    cluster = LocalCluster(opts, out=out)
    faults = fault_schedule(seed, duration_s, ranks, api_servers, every_s)
    out(f"lockstep chaos: {len(faults)} faults over {duration_s:g}s (seed {seed}); logs in {work / 'logs'}")
    cluster.start()
    injector = Injector(cluster)
    owner = ClusterOwner(cluster)
    owner.start()
    results: list[Outcome] = []
    log: list[dict[str, Any]] = []

    async def main() -> None:
        start = time.monotonic()
        await asyncio.gather(drive_load(cluster.api_url, seed, duration_s, concurrency, timeout_s, results),
                             _inject_all(owner, injector, faults, start, log))
    t0 = time.monotonic()
    try:
        asyncio.run(main())
    finally:
        owner.finish.set()
        owner.join(120)
        if owner.is_alive():   # stuck in a fault: stop from here (its children may be gone already)
            cluster.stop()
    res = summarize(log, results)
    res["run"] = {"duration_s": duration_s, "seed": seed, "ranks": ranks, "api_servers": api_servers,
                  "policy": policy, "dispatch": dispatch, "spares": spares, "schedulers": schedulers,
                  "concurrency": concurrency, "wall_s": round(time.monotonic() - t0, 1), "logs": str(work / "logs")}
    return res


def chaos_cmd(
    duration: float = typer.Option(300.0, "--duration", min=10.0,
                                   help="Seconds of load (10 or more: a 3 s warm-up, the faults, then a cooldown of "
                                        "at least 6 s with no fault)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the fault schedule and the requests."),
    ranks: int = typer.Option(2, "--ranks", min=2, help="DP ranks of the local sim cluster."),
    api_servers: int = typer.Option(2, "--api-servers", min=1, help="api-server replicas."),
    concurrency: int = typer.Option(8, "--concurrency", min=1, help="Closed-loop clients."),
    every: Optional[float] = typer.Option(None, "--every", min=1.0, help="Seconds between faults (default: <= 10, every kind at least once)."),
    timeout: float = typer.Option(90.0, "--timeout", min=5.0, help="A request unanswered this long counts as lost."),
    work_dir: Optional[str] = typer.Option(None, "--work-dir", help="Where Redis data and logs go (default: a temp dir)."),
    policy: str = typer.Option(DEFAULT_POLICY, "--policy", help=f"Dispatch policy: {', '.join(policy_names())}."),
    dispatch: str = typer.Option("scheduler", "--dispatch", help="scheduler (one decision maker) or client (api-servers pick)."),
    spares: int = typer.Option(1, "--spares", min=0, help="Hot-spare engine processes (0: a dead rank's process is started again)."),
    schedulers: int = typer.Option(2, "--schedulers", min=1, help="Scheduler processes (1: a killed leader is restarted, no standby takes over)."),
    json: bool = typer.Option(False, "--json", help="One JSON object instead of the table."),
) -> None:
    """Kill and restart ranks (rank 0 too), the leading scheduler, an api-server and Redis
    under steady load; check every request: exact, or failed with a clear error. Exit 1
    if any was lost, duplicated or corrupt."""
    from shared.redis_server import ServerNotFound

    if policy not in policy_names():
        typer.echo(f"lockstep chaos: unknown --policy {policy!r}; choose one of: {', '.join(policy_names())}", err=True)
        raise typer.Exit(2)
    if dispatch not in ("scheduler", "client"):
        typer.echo(f"lockstep chaos: --dispatch must be 'scheduler' or 'client', not {dispatch!r}", err=True)
        raise typer.Exit(2)
    try:
        chaos_options(seed, ranks, api_servers, Path(tempfile.gettempdir()), policy, dispatch, spares, schedulers)
    except ValueError as exc:
        typer.echo(f"lockstep chaos: {exc}", err=True)
        raise typer.Exit(2) from None
    if not fault_schedule(seed, duration, ranks, api_servers, every):   # a run that would test nothing
        typer.echo(f"lockstep chaos: --duration {duration:g}{f' with --every {every:g}' if every else ''} leaves no "
                   "time for a fault between the 3 s warm-up and the cooldown; use --duration 10 or more"
                   + (" or a smaller --every" if every else ""), err=True)
        raise typer.Exit(2)
    try:
        res = run_chaos(duration, seed, ranks, api_servers, concurrency, every, timeout, work_dir,
                        out=lambda m: typer.echo(m, err=True), policy=policy, dispatch=dispatch, spares=spares,
                        schedulers=schedulers)
    except (ServerNotFound, RuntimeError, TimeoutError) as exc:   # the cluster did not start
        typer.echo(f"lockstep chaos: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode() if json else render(res))
    raise typer.Exit(1 if res["lost"] or res["duplicated"] or res["corrupt"] else 0)


def register(app: typer.Typer) -> None:
    app.command("chaos")(chaos_cmd)
