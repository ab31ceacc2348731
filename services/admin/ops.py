"""Operator commands that read and steer a running cluster through Redis alone:
``lockstep steps``, ``request``, ``drain``, ``resume``, ``config`` and ``init``.

Every command takes ``--json``, ``--namespace/-n`` and ``--redis-url``; an unreachable
cluster is one red line and exit code 2. The live dashboard (``lockstep watch``) lives in
services/admin/watch.py. Wire with ``register(app)``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import orjson
import typer

from services.admin import local_state
from shared import keys as K
from shared.bus import decode_entries
from shared.messages import FIELD

NS_OPT = typer.Option("ls", "--namespace", "-n", envvar="LOCKSTEP_NAMESPACE", help="Key prefix of the cluster.")
URL_OPT = typer.Option(None, "--redis-url", help="Redis URL (default: LOCKSTEP_REDIS_URL, else the local cluster's).")
JSON_OPT = typer.Option(False, "--json", help="Machine-readable JSON instead of tables.")

FIRST_TOKEN_SCAN = 2000   # out-stream entries scanned for a request's first token (`lockstep request`)


def fail(msg: str, code: int = 1) -> None:
    typer.secho(f"lockstep: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def resolve(redis_url: str | None, namespace: str) -> str:
    """The cluster's Redis URL, checked reachable; a one-line error and exit 2 if not."""
    from shared.bus import RedisUnreachable, check_reachable

    try:
        url = local_state.resolve_redis_url(redis_url, namespace)
        asyncio.run(check_reachable(url))
    except (local_state.NoCluster, RedisUnreachable) as exc:
        fail(str(exc), 2)
    return url


def emit_json(data: Any) -> None:
    typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _num(v: Any) -> Any:
    """A hash value as int or float when it is one, else str."""
    s = _s(v)
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


async def _with_redis(url: str, fn: Any) -> Any:
    from shared.bus import connect
    r = connect(url, timeout_s=5.0)
    try:
        return await fn(r)
    finally:
        await r.aclose()


# ----------------------------------------------------------------------------- steps
async def read_steps(r: Any, keys: K.Keys, count: int) -> list[dict[str, Any]]:
    """The last ``count`` finalized snapshots from ``<ns>:steps``, oldest first."""
    entries = await r.xrevrange(keys.steps, count=count)
    out = []
    for _, eid, d in decode_entries([(keys.steps, list(reversed(entries)))]):
        if d.get("k") == "corrupt":
            continue
        d["id"] = _s(eid)
        out.append(d)
    return out


def steps_rows(snaps: list[dict[str, Any]], rank: int | None = None) -> list[dict[str, Any]]:
    """One row per (snapshot, rank): the per-rank view the scheduler finalized."""
    rows = []
    for snap in snaps:
        carried = set(snap.get("carried", ()))
        for r_str, st in sorted(snap["ranks"].items(), key=lambda kv: int(kv[0])):
            r = int(r_str)
            if rank is not None and r != rank:
                continue
            rows.append({
                "wave": snap["wave"], "step": snap["step"], "seq": snap.get("seq", 0), "t": snap["t"], "rank": r,
                "rank_step": st.get("step"), "carried": r in carried, "scheduled": st.get("scheduled", 0),
                "prefill": st.get("prefill", 0), "decode": st.get("decode", 0), "waiting": st.get("waiting", 0),
                "running": st.get("running", 0), "kv_used": st.get("kv_used", 0), "kv_total": st.get("kv_total", 0),
                "idle": bool(st.get("idle", False)), "held": st.get("held", 0), "dur_ms": st.get("dur_ms", 0.0)})
    return rows


def steps_cmd(count: int = typer.Option(10, "--count", "-c", min=1, max=20_000, help="How many finalized steps."),
              rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Only this rank's rows."),
              namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """The last N finalized steps, one row per rank (from the scheduler's <ns>:steps stream)."""
    url = resolve(redis_url, namespace)
    keys = K.Keys(namespace)
    snaps = asyncio.run(_with_redis(url, lambda r: read_steps(r, keys, count)))
    if json:
        emit_json({"namespace": namespace, "steps": snaps if rank is None else [
            {**s, "ranks": {k: v for k, v in s["ranks"].items() if int(k) == rank}} for s in snaps]})
        return
    from rich.console import Console
    from rich.table import Table

    if not snaps:
        typer.echo(f"no finalized steps yet in namespace {namespace!r} (the cluster has not run a step)")
        return
    t = Table(title=f"last {len(snaps)} finalized steps [{namespace}]", title_justify="left")
    for col in ("wave", "step", "rank", "sched tok", "prefill", "decode", "waiting", "running", "KV", "idle",
                "held", "ms"):
        t.add_column(col, justify="right")
    for row in steps_rows(snaps, rank):
        kv = f"{row['kv_used']}/{row['kv_total']}" if row["kv_total"] else "-"
        step = str(row["step"]) + ("*" if row["carried"] else "")
        t.add_row(str(row["wave"]), step, str(row["rank"]), str(row["scheduled"]), str(row["prefill"]),
                  str(row["decode"]), str(row["waiting"]), str(row["running"]), kv, "yes" if row["idle"] else "",
                  str(row["held"] or ""), f"{row['dur_ms']:.1f}")
    Console().print(t)
    if any(s.get("carried") for s in snaps):
        typer.echo("* carried: the rank missed that step's grace period; its row is its last report")


# --------------------------------------------------------------------------- request
async def read_request(r: Any, keys: K.Keys, request_id: str) -> dict[str, Any] | None:
    raw = await r.hgetall(keys.req(request_id))
    if not raw:
        return None
    rec = {_s(k): _num(v) for k, v in raw.items()}
    ttl = await r.ttl(keys.req(request_id))
    info: dict[str, Any] = {"id": request_id, "record": rec, "ttl_s": ttl if ttl >= 0 else None}
    rank = rec.get("rank")
    if isinstance(rank, int):
        pipe = r.pipeline(transaction=False)
        pipe.exists(keys.rank_alive(rank))
        pipe.sismember(keys.drained, rank)
        alive, drained = await pipe.execute()
        info["rank_alive"], info["rank_drained"] = bool(alive), bool(drained)
    if rec.get("batch"):
        b = await r.hgetall(keys.batch(str(rec["batch"])))
        if b:
            bd = {_s(k): _s(v) for k, v in b.items()}
            if "counts" in bd:
                bd["counts"] = orjson.loads(bd["counts"])
            info["batch"] = bd
    first = await _first_token_time(r, keys, request_id, rec)
    if first is not None:
        rec.setdefault("t_first_token", first)
    info["timeline"] = timeline(rec)
    info["state"] = rec.get("state", "unknown")
    return info


async def _first_token_time(r: Any, keys: K.Keys, request_id: str, rec: dict[str, Any]) -> float | None:
    """When the engine emitted the request's first token: the id (ms clock) of the first
    output-stream entry holding a delta at position 0 for it. Bounded scan from dispatch."""
    api, t0 = rec.get("api"), rec.get("t_dispatched") or rec.get("t_arrival")
    if not api or not isinstance(t0, (int, float)):
        return None
    start = f"{int(t0 * 1000)}-0"
    entries = await r.xrange(keys.out(str(api)), min=start, count=FIRST_TOKEN_SCAN)
    for eid, fields in entries:
        raw = fields.get(FIELD)
        if raw is None or request_id.encode() not in raw:
            continue
        for d in orjson.loads(raw).get("ds", ()):
            if d.get("id") == request_id and d.get("o") == 0 and d.get("t"):
                return int(_s(eid).split("-")[0]) / 1000.0
    return None


TIMELINE = (("t_arrival", "accepted by api-server"), ("t_dispatched", "placed on a rank"),
            ("t_first_token", "first token emitted"), ("t_finished", "finished"))


def timeline(rec: dict[str, Any]) -> list[dict[str, Any]]:
    base = rec.get("t_arrival")
    out = []
    for key, what in TIMELINE:
        t = rec.get(key)
        if isinstance(t, (int, float)):
            out.append({"event": key[2:], "what": what, "t": t,
                        "since_arrival_ms": round((t - base) * 1000, 3) if isinstance(base, (int, float)) else None})
    return out


def request_cmd(request_id: str = typer.Argument(..., help="Request id (the 'id' of the OpenAI response)."),
                namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Where a request is (state, rank, batch) and its timeline, from <ns>:req:<id>."""
    url = resolve(redis_url, namespace)
    keys = K.Keys(namespace)
    info = asyncio.run(_with_redis(url, lambda r: read_request(r, keys, request_id)))
    if info is None:
        if json:
            emit_json({"id": request_id, "found": False})
        fail(f"no record of request {request_id!r} in namespace {namespace!r}: unknown id, not yet placed "
             f"(queued or held for a batch), placed by an api-server in client-dispatch mode and still running, "
             f"or older than its TTL (request_record_ttl_s, default {K.REQ_HASH_TTL_S}s)", 1)
    if json:
        emit_json({"found": True, **info})
        return
    rec = info["record"]
    where = f"rank {rec['rank']}" if "rank" in rec else "no rank yet"
    if "rank_alive" in info:
        where += (" (alive" if info["rank_alive"] else " (DEAD") + (", drained)" if info["rank_drained"] else ")")
    lines = [f"request {request_id}: {info['state']}" + (f" ({rec['finish']})" if rec.get("finish") else "")
             + f" on {where}"]
    details = [f"{k}={rec[k]}" for k in ("api", "prompt_tokens", "max_tokens", "tokens", "reason", "batch") if k in rec]
    if details:
        lines.append("  " + "  ".join(details))
    if "batch" in info:
        lines.append(f"  batch {rec.get('batch')}: per-rank counts {info['batch'].get('counts')}, "
                     f"released by {info['batch'].get('reason')}")
    for ev in info["timeline"]:
        since = f"+{ev['since_arrival_ms']:.1f} ms" if ev["since_arrival_ms"] is not None else ""
        stamp = time.strftime("%H:%M:%S", time.localtime(ev["t"])) + f".{int(ev['t'] * 1000) % 1000:03d}"
        lines.append(f"  {stamp}  {since:>12}  {ev['what']}")
    if info["ttl_s"] is not None:
        lines.append(f"  (record expires in {info['ttl_s']} s)")
    typer.echo("\n".join(lines))


# --------------------------------------------------------------------- drain / resume
async def _num_ranks(r: Any, keys: K.Keys) -> int | None:
    v = await r.hget(keys.cluster, "ranks")
    return int(v) if v else None


async def set_drained(r: Any, keys: K.Keys, rank: int, drained: bool) -> dict[str, Any]:
    n = await _num_ranks(r, keys)
    if n is not None and not 0 <= rank < n:
        return {"error": f"rank {rank} is not in this cluster (ranks 0..{n - 1})"}
    if drained:
        changed = await r.sadd(keys.drained, rank)
    else:
        changed = await r.srem(keys.drained, rank)
    members = sorted(int(x) for x in await r.smembers(keys.drained))
    return {"rank": rank, "drained": drained, "changed": bool(changed), "drained_ranks": members}


async def rank_load(r: Any, keys: K.Keys, rank: int) -> dict[str, int]:
    """Work still on a rank: waiting + running (last step stats) and unacked inbox entries."""
    pipe = r.pipeline(transaction=False)
    pipe.hget(keys.rank_info(rank), "stats")
    pipe.xpending(keys.inbox(rank), K.ENGINE_GROUP)
    stats, pending = await pipe.execute(raise_on_error=False)
    st = orjson.loads(stats) if isinstance(stats, bytes) else {}
    pend = pending.get("pending", 0) if isinstance(pending, dict) else 0
    return {"waiting": st.get("waiting", 0), "running": st.get("running", 0), "inbox_pending": pend}


def drain_cmd(rank: int = typer.Argument(..., help="DP rank to drain."),
              wait: bool = typer.Option(False, "--wait", help="Wait until the rank has finished its requests."),
              timeout: float = typer.Option(600.0, "--timeout", help="With --wait: give up after this many seconds."),
              namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Stop sending new work to RANK; its running requests finish there (undo with `resume`)."""
    url = resolve(redis_url, namespace)
    keys = K.Keys(namespace)

    async def go(r: Any) -> dict[str, Any]:
        res = await set_drained(r, keys, rank, True)
        if "error" in res or not wait:
            return res
        deadline = time.monotonic() + timeout
        while True:
            load = await rank_load(r, keys, rank)
            if not any(load.values()):
                return {**res, "idle": True, "load": load}
            if time.monotonic() > deadline:
                return {**res, "idle": False, "load": load}
            await asyncio.sleep(0.25)

    res = asyncio.run(_with_redis(url, go))
    if "error" in res:
        fail(res["error"], 2)
    if json:
        emit_json(res)
    else:
        typer.echo(f"rank {rank} drained" + ("" if res["changed"] else " (already)")
                   + f"; drained ranks: {res['drained_ranks']}. The scheduler stops placing work there within "
                     "~250 ms; requests already on it finish there. Undo: lockstep resume " + str(rank))
        if wait:
            typer.echo(f"rank {rank} is idle" if res["idle"] else f"rank {rank} still has work after {timeout:g}s: "
                                                                  f"{res['load']}")
    if wait and not res["idle"]:
        raise typer.Exit(1)


def resume_cmd(rank: int = typer.Argument(..., help="DP rank to give work again."),
               namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Let RANK receive new work again (undo `drain`)."""
    url = resolve(redis_url, namespace)
    keys = K.Keys(namespace)
    res = asyncio.run(_with_redis(url, lambda r: set_drained(r, keys, rank, False)))
    if "error" in res:
        fail(res["error"], 2)
    if json:
        emit_json(res)
    else:
        typer.echo(f"rank {rank} resumed" + ("" if res["changed"] else " (was not drained)")
                   + f"; drained ranks: {res['drained_ranks'] or 'none'}")


# --------------------------------------------------------------------------- config
# What `lockstep up` writes into <ns>:cluster and passes to every service as LOCKSTEP_*.
CLUSTER_FIELDS = {"ranks": "ranks", "policy": "policy", "dispatch": "dispatch", "backend": "backend",
                  "api_servers": "num_api_servers", "port": "port"}
SERVICES = {"api-server": "ApiServerSettings", "scheduler": "SchedulerSettings", "engine-worker": "EngineSettings"}


def effective_config(env: dict[str, str], cluster: dict[str, str], namespace: str,
                     redis_url: str | None) -> dict[str, Any]:
    """Each service's settings: defaults, then LOCKSTEP_* env vars, then the running
    cluster's record (<ns>:cluster, what `lockstep up` gave its children); secrets redacted."""
    import dataclasses

    from shared import settings as S

    out: dict[str, Any] = {}
    for service, cls_name in SERVICES.items():
        cls = getattr(S, cls_name)
        names = {f.name for f in dataclasses.fields(cls)}
        overrides: dict[str, Any] = {"namespace": namespace}
        if redis_url:
            overrides["redis_url"] = redis_url
        source = {n: ("env" if S.ENV_PREFIX + n.upper() in env else "default") for n in names}
        source["namespace"] = "flag"
        if redis_url:
            source["redis_url"] = "cluster"
        cenv = dict(env)
        for ckey, field in CLUSTER_FIELDS.items():
            if field in names and ckey in cluster:
                cenv[S.ENV_PREFIX + field.upper()] = cluster[ckey]
                source[field] = "cluster"
        obj = cls.from_env(cenv, **overrides)
        values = obj.to_dict(redact=True)
        out[service] = {name: {"value": values[name], "source": source[name]} for name in values}
    return out


def config_cmd(service: Optional[str] = typer.Option(None, "--service", "-s",
                                                     help="Only this service: api-server, scheduler, engine-worker."),
               namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Effective settings of every service (defaults, LOCKSTEP_* env, the cluster's record); secrets redacted.

    Without a reachable cluster (no --redis-url, no LOCKSTEP_REDIS_URL, no local cluster) it
    shows what the services would get from this environment."""
    import os

    if service is not None and service not in SERVICES:
        fail(f"--service must be one of {', '.join(SERVICES)}, not {service!r}", 2)
    cluster: dict[str, str] = {}
    url: str | None = None
    try:
        local_state.resolve_redis_url(redis_url, namespace)
    except local_state.NoCluster:
        pass
    else:
        url = resolve(redis_url, namespace)

        async def read(r: Any) -> dict[str, str]:
            return {_s(k): _s(v) for k, v in (await r.hgetall(K.Keys(namespace).cluster)).items()}
        cluster = asyncio.run(_with_redis(url, read))
    cfg = effective_config(dict(os.environ), cluster, namespace, url)
    if service:
        cfg = {service: cfg[service]}
    if json:
        emit_json({name: {k: v["value"] for k, v in fields.items()} for name, fields in cfg.items()}
                  | {"_sources": {name: {k: v["source"] for k, v in fields.items()} for name, fields in cfg.items()}})
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not url:
        console.print(f"no running cluster found for namespace {namespace!r}: showing this environment's settings")
    for name, fields in cfg.items():
        t = Table(title=name, title_justify="left")
        t.add_column("setting")
        t.add_column("value", overflow="fold")
        t.add_column("source")
        for k, v in fields.items():
            t.add_row(k, str(v["value"]), v["source"])
        console.print(t)


# ----------------------------------------------------------------------------- init
def init_cmd(namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Write the cluster record (<ns>:cluster) from LOCKSTEP_* settings (for services started one by one, as in compose)."""
    import os

    from shared import settings as S

    url = resolve(redis_url, namespace)
    env = dict(os.environ)
    sched, eng, api = (S.SchedulerSettings.from_env(env), S.EngineSettings.from_env(env),
                       S.ApiServerSettings.from_env(env))
    record = {"ranks": sched.ranks, "api_servers": api.num_api_servers, "policy": sched.policy,
              "dispatch": sched.dispatch, "backend": eng.backend, "port": api.port, "started": time.time()}
    if eng.ranks != sched.ranks:
        fail(f"LOCKSTEP_RANKS disagrees between services ({sched.ranks} vs {eng.ranks})", 2)

    async def write(r: Any) -> None:
        await r.hset(K.Keys(namespace).cluster, mapping=record)
    asyncio.run(_with_redis(url, write))
    if json:
        emit_json({"namespace": namespace, "cluster": record})
    else:
        typer.echo(f"cluster record written to {K.Keys(namespace).cluster}: " +
                   ", ".join(f"{k}={v}" for k, v in record.items() if k != "started"))


def register(app: typer.Typer) -> None:
    app.command("init")(init_cmd)
    app.command("steps")(steps_cmd)
    app.command("request")(request_cmd)
    app.command("drain")(drain_cmd)
    app.command("resume")(resume_cmd)
    app.command("config")(config_cmd)
