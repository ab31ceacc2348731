"""``lockstep request ID``: where a request is (state, rank, batch) and its timeline,
from ``<ns>:req:<id>`` and the first token on its api-server's output stream."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import orjson
import typer

from services.admin.cmd_common import (JSON_OPT, NS_OPT, URL_OPT, as_number, as_str, emit_json, fail, resolve,
                                       with_redis)
from shared import keys as K
from shared.messages import FIELD

FIRST_TOKEN_SCAN = 2000   # out-stream entries scanned for a request's first token


async def read_request(r: Any, keys: K.Keys, request_id: str) -> dict[str, Any] | None:
    raw = await r.hgetall(keys.req(request_id))
    if not raw:
        return None
    rec = {as_str(k): as_number(v) for k, v in raw.items()}
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
            bd = {as_str(k): as_str(v) for k, v in b.items()}
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
                return int(as_str(eid).split("-")[0]) / 1000.0
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
    info = asyncio.run(with_redis(url, lambda r: read_request(r, keys, request_id)))
    if info is None:
        if json:
            emit_json({"id": request_id, "found": False})
        fail(f"no record of request {request_id!r} in namespace {namespace!r}: unknown id, not yet placed "
             f"(unread, or kept unplaced by the scheduler's policy), placed by an api-server in client-dispatch mode and still running, "
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


def register(app: typer.Typer) -> None:
    app.command("request")(request_cmd)
