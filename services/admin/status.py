"""`lockstep status`: the cluster's state read from Redis alone."""

from __future__ import annotations

import math
import time
from typing import Any

import orjson

from shared import keys as K
from shared.bus import connect, redact_url
from shared.replies import as_str, str_keys


def _number(v: str) -> Any:
    """A Redis hash value as JSON has it: a number where it is one (``ranks``, ``port``,
    ``started``), else the string."""
    try:
        return int(v)
    except ValueError:
        pass
    try:
        f = float(v)
    except ValueError:
        return v
    return f if math.isfinite(f) else v


def _json_field(v: str) -> Any:
    try:
        return orjson.loads(v)
    except orjson.JSONDecodeError:
        return v


async def request_queue(r: Any, keys: K.Keys) -> dict[str, Any]:
    """The requests stream as the scheduler sees it: its length (the trim keeps the last
    entry read, so never 0 once used), what it has not read (lag) and not acked yet."""
    pipe = r.pipeline(transaction=False)
    pipe.xlen(keys.requests)
    pipe.xinfo_groups(keys.requests)
    length, groups = await pipe.execute(raise_on_error=False)
    out: dict[str, Any] = {"requests_len": length if isinstance(length, int) else 0,
                           "scheduler_pending": 0, "scheduler_lag": 0}
    if isinstance(groups, list):
        for g in groups:
            g = str_keys(g)
            if as_str(g.get("name", "")) == K.SCHEDULER_GROUP:
                out["scheduler_pending"] = int(g.get("pending") or 0)
                out["scheduler_lag"] = int(g.get("lag") or 0)
    return out


async def collect(url: str, namespace: str) -> dict[str, Any]:
    k = K.Keys(namespace)
    r = connect(url, timeout_s=5.0)
    try:
        cluster = {key.decode(): _number(val.decode()) for key, val in (await r.hgetall(k.cluster)).items()}
        n = int(cluster.get("ranks", 0))
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.exists(k.rank_alive(i))
            pipe.hgetall(k.rank_info(i))
            pipe.xlen(k.inbox(i))
            pipe.xpending(k.inbox(i), K.ENGINE_GROUP)
        pipe.get(k.leader)
        pipe.hgetall(k.scheduler)
        pipe.hget(k.snapshot, "json")
        pipe.smembers(k.drained)
        res = await pipe.execute(raise_on_error=False)
        queue = await request_queue(r, k)
        spare_keys = [key async for key in r.scan_iter(match=k.spare("*"), count=1000)]
        # value: "pid@host"
        spares = sorted(int(v.split(b"@")[0]) for v in await r.mget(spare_keys) if v) if spare_keys else []
    finally:
        await r.aclose()
    ranks = []
    for i in range(n):
        alive, info, inbox_len, pending = res[i * 4: i * 4 + 4]
        info = info if isinstance(info, dict) else {}
        stats = orjson.loads(info[b"stats"]) if b"stats" in info else {}
        pend = pending.get("pending", 0) if isinstance(pending, dict) else 0
        ranks.append({
            "rank": i, "alive": bool(alive), "pid": int(info.get(b"pid", 0) or 0),
            "backend": info.get(b"backend", b"").decode(),
            "wave": stats.get("wave"), "step": stats.get("step"), "waiting": stats.get("waiting", 0),
            "running": stats.get("running", 0), "kv_used": stats.get("kv_used", 0), "kv_total": stats.get("kv_total", 0),
            "idle_forwards": int(info.get(b"idle_forwards", 0) or 0), "inbox_pending": pend,
            "inbox_len": inbox_len if isinstance(inbox_len, int) else 0,
            "last_step_age_s": round(time.time() - stats["t"], 3) if stats.get("t") else None,
        })
    if "backend" not in cluster:   # a record written again after an empty restart (the scheduler's) lacks it
        known = sorted({r["backend"] for r in ranks if r["backend"]})
        if known:
            cluster["backend"] = "/".join(known)
    leader, sched, snap, drained = res[n * 4:]
    sched = {a.decode(): b.decode() for a, b in sched.items()} if isinstance(sched, dict) else {}
    counters = orjson.loads(sched.pop("counters")) if "counters" in sched else {}
    # as JSON has them: numbers (pid, since, t) and the lists written as JSON (live, drained)
    sched = {key: _json_field(val) if key in ("live", "drained") else _number(val) if key in ("pid", "since", "t")
             else val for key, val in sched.items()}
    snapshot = orjson.loads(snap) if snap else None
    return {
        "namespace": namespace, "redis_url": redact_url(url), "cluster": cluster,
        # the lease's holder, not the hash's last writer (it outlives a dead leader)
        "scheduler": {**sched, "leader": leader.decode() if leader else None, "counters": counters},
        # requests: the stream's length (as before); unread / unacked: what is queued there
        "queues": {"requests": queue["requests_len"], "requests_unread": queue["scheduler_lag"],
                   "requests_unacked": queue["scheduler_pending"]},
        "drained": sorted(int(x) for x in drained) if isinstance(drained, set) else [],
        "ranks": ranks,
        "spares": spares,   # pids of hot-spare engine processes waiting to take a rank
        "snapshot": {"wave": snapshot["wave"], "step": snapshot["step"], "seq": snapshot["seq"],
                     "age_s": round(time.time() - snapshot["t"], 3)} if snapshot else None,
    }


def render(data: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c = data["cluster"]
    if not c and not data["ranks"]:
        from services.admin.cmd_common import no_cluster_message
        return Text(no_cluster_message(data["namespace"], data["redis_url"]))
    head = Text(f"lockstep [{data['namespace']}] at {data['redis_url']}: "
                f"{c.get('ranks', '?')} ranks ({c.get('backend', '?')}), {c.get('api_servers', '?')} api-servers, "
                f"policy {c.get('policy', '?')}, dispatch {c.get('dispatch', '?')}")
    t = Table(title="ranks", title_justify="left")
    for col in ("rank", "pid", "alive", "wave", "step", "waiting", "running", "KV use", "idle fwd", "inbox pend"):
        t.add_column(col, justify="right")
    for r in data["ranks"]:
        kv = f"{r['kv_used']}/{r['kv_total']}" if r["kv_total"] else "-"
        t.add_row(str(r["rank"]), str(r["pid"] or "-"), "yes" if r["alive"] else "[red]no[/red]",
                  str(r["wave"] if r["wave"] is not None else "-"), str(r["step"] if r["step"] is not None else "-"),
                  str(r["waiting"]), str(r["running"]), kv, str(r["idle_forwards"]), str(r["inbox_pending"]))
    s = data["scheduler"]
    snap = data["snapshot"]
    resumed = s["counters"].get("resumed", 0)   # placed again after their rank died: counted in dispatched too
    tail = Text(f"scheduler: leader {s.get('leader') or 'NONE'}; dispatched {s['counters'].get('dispatched', 0)}"
                + (f" (of which {resumed} placed again after their rank died)" if resumed else "") + "; "
                f"requests queued {data['queues'].get('requests_unread', 0)} (being placed "
                f"{data['queues'].get('requests_unacked', 0)}); "
                + (f"snapshot wave {snap['wave']} step {snap['step']} ({snap['age_s']}s ago)" if snap else "no snapshot yet")
                + (f"; drained ranks {data['drained']}" if data["drained"] else "")
                + f"; hot spares ready: {len(data['spares'])}")
    down = [r["rank"] for r in data["ranks"] if not r["alive"]]
    if not down:
        return Group(head, t, tail)
    warn = Text(f"engine group: {len(data['ranks']) - len(down)} of {len(data['ranks'])} ranks live (down: "
                f"{', '.join(map(str, down))}). It steps only with all of them: nothing is served until the missing "
                "ranks are back (a hot spare takes a slot at once: `lockstep up --spares N`, `lockstep engine "
                "--spares N`); the api-servers answer 503 once LOCKSTEP_ENGINE_DOWN_TIMEOUT_S has passed.",
                style="bold red")
    return Group(head, t, warn, tail)
