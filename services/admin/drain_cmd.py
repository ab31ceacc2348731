"""``lockstep drain RANK`` and ``lockstep resume RANK``: take a rank out of placement
(``<ns>:drained``) and give it back."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import orjson
import typer

from services.admin.cmd_common import JSON_OPT, NS_OPT, URL_OPT, emit_json, fail, given, resolve, with_redis, require_cluster
from shared import keys as K


async def _num_ranks(r: Any, keys: K.Keys) -> int | None:
    v = await r.hget(keys.cluster, "ranks")
    return int(v) if v else None


async def set_drained(r: Any, keys: K.Keys, rank: int, drained: bool,
                      redis_url: str | None = None) -> dict[str, Any]:
    n = await _num_ranks(r, keys)
    if n is not None and not 0 <= rank < n:
        return {"error": f"rank {rank} is not in this cluster (ranks 0..{n - 1})"}
    if drained:
        others = {int(x) for x in await r.smembers(keys.drained)} - {rank}
        if n is not None and len(others) >= n - 1:
            # the scheduler places on every rank when none is left undrained
            # (services/scheduler/membership.py), so this drain would change nothing
            return {"error": f"rank {rank} is the last rank taking new work (drained: {sorted(others)}); with "
                             "every rank drained the scheduler places on all of them again. Resume one first "
                             f"({K.admin_command('resume', keys.ns, redis_url)} RANK), or stop the cluster"}
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


def describe_load(load: dict[str, Any]) -> str:
    """'3 running, 1 waiting, 2 not yet read from its inbox' for a human, not a dict."""
    parts = [f"{load.get('running', 0)} running", f"{load.get('waiting', 0)} waiting"]
    if load.get("inbox_pending"):
        parts.append(f"{load['inbox_pending']} not yet read from its inbox")
    return ", ".join(parts)


def drain_cmd(ctx: typer.Context, rank: int = typer.Argument(..., help="DP rank to drain."),
              wait: bool = typer.Option(False, "--wait", help="Wait until the rank has finished its requests."),
              timeout: float = typer.Option(600.0, "--timeout", help="With --wait: give up after this many seconds."),
              namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Stop sending new work to RANK; its running requests finish there (undo with `resume`)."""
    if not wait and given(ctx, "timeout"):
        fail("--timeout bounds --wait; without --wait drain returns at once: add --wait, or drop --timeout", 2)
    url = resolve(redis_url, namespace)
    require_cluster(url, namespace)   # (resume needs none: it may clear a flag a stopped cluster left)
    keys = K.Keys(namespace)

    async def go(r: Any) -> dict[str, Any]:
        res = await set_drained(r, keys, rank, True, redis_url)
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

    res = asyncio.run(with_redis(url, go))
    if "error" in res:
        fail(res["error"], 2)
    if json:
        emit_json(res)
    else:
        typer.echo(f"rank {rank} drained" + ("" if res["changed"] else " (already)")
                   + f"; drained ranks: {res['drained_ranks']}. The scheduler stops placing work there within "
                     f"~250 ms; requests already on it finish there. Undo: {K.admin_command('resume', namespace, redis_url)} {rank}")
        if wait:
            typer.echo(f"rank {rank} is idle" if res["idle"] else f"rank {rank} still has work after {timeout:g}s: "
                                                                  f"{describe_load(res['load'])}; its requests keep "
                                                                  f"running there: wait again, or raise --timeout")
    if wait and not res["idle"]:
        raise typer.Exit(1)


def resume_cmd(rank: int = typer.Argument(..., help="DP rank to give work again."),
               namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Let RANK receive new work again (undo `drain`)."""
    url = resolve(redis_url, namespace)
    keys = K.Keys(namespace)
    res = asyncio.run(with_redis(url, lambda r: set_drained(r, keys, rank, False)))
    if "error" in res:
        fail(res["error"], 2)
    if json:
        emit_json(res)
    else:
        typer.echo(f"rank {rank} resumed" + ("" if res["changed"] else " (was not drained)")
                   + f"; drained ranks: {res['drained_ranks'] or 'none'}")


def register(app: typer.Typer) -> None:
    app.command("drain")(drain_cmd)
    app.command("resume")(resume_cmd)
