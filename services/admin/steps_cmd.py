"""``lockstep steps``: the last finalized steps, one row per rank, from ``<ns>:steps``."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import typer

from services.admin.cmd_common import console as out_console, fail, JSON_OPT, NS_OPT, URL_OPT, as_str, emit_json, resolve, with_redis, require_cluster
from shared import keys as K
from shared.bus import decode_entries


async def read_steps(r: Any, keys: K.Keys, count: int) -> list[dict[str, Any]]:
    """The last ``count`` finalized snapshots from ``<ns>:steps``, oldest first."""
    entries = await r.xrevrange(keys.steps, count=count)
    out = []
    for _, eid, d in decode_entries([(keys.steps, list(reversed(entries)))]):
        if d.get("k") == "corrupt":
            continue
        d["id"] = as_str(eid)
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
                "idle": bool(st.get("idle", False)), "held": st.get("held", 0), "dur_ms": st.get("dur_ms", 0.0),
                "pause": bool((st.get("extra") or {}).get("pause"))})
    return rows


def steps_cmd(count: int = typer.Option(10, "--count", "-c", min=1, max=20_000, help="How many finalized steps."),
              rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Only this rank's rows."),
              namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """The last N finalized steps, one row per rank (from the scheduler's <ns>:steps stream)."""
    url = resolve(redis_url, namespace)
    require_cluster(url, namespace)
    keys = K.Keys(namespace)
    snaps = asyncio.run(with_redis(url, lambda r: read_steps(r, keys, count)))
    seen = sorted({int(k) for s in snaps for k in s["ranks"]})
    if rank is not None and seen and rank not in seen:
        fail(f"--rank {rank}: no such rank in these steps (ranks {', '.join(map(str, seen))})", 2)
    if json:
        emit_json({"namespace": namespace, "steps": snaps if rank is None else [
            {**s, "ranks": {k: v for k, v in s["ranks"].items() if int(k) == rank}} for s in snaps]})
        return
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
                  str(row["held"] or ""), "pause" if row["pause"] else f"{row['dur_ms']:.1f}")
    out_console().print(t)
    if any(s.get("carried") for s in snaps):
        typer.echo("* carried: the rank missed that step's grace period; its row is its last report")


def register(app: typer.Typer) -> None:
    app.command("steps")(steps_cmd)
