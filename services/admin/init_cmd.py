"""``lockstep init``: write the cluster record ``<ns>:cluster`` from LOCKSTEP_* settings, for
services started one by one (compose, k8s) rather than by ``lockstep up``."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import typer

from services.admin.cmd_common import JSON_OPT, NS_OPT, URL_OPT, emit_json, fail, resolve, with_redis
from shared import keys as K


def init_cmd(namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Write the cluster record (<ns>:cluster) from LOCKSTEP_* settings (for services started one by one, as in compose)."""
    import os

    from shared import settings as S

    url = resolve(redis_url, namespace)
    env = dict(os.environ)
    try:
        sched, eng, api = (S.SchedulerSettings.from_env(env), S.EngineSettings.from_env(env),
                           S.ApiServerSettings.from_env(env))
    except ValueError as exc:    # a LOCKSTEP_* value or combination the services would refuse
        fail(str(exc), 2)
    record = {"ranks": sched.ranks, "api_servers": api.num_api_servers, "policy": sched.policy,
              "dispatch": sched.dispatch, "backend": eng.backend, "port": api.port, "started": time.time()}
    if eng.ranks != sched.ranks:
        fail(f"LOCKSTEP_RANKS disagrees between services ({sched.ranks} vs {eng.ranks})", 2)

    async def write(r: Any) -> list[str]:
        """Write the record; what it changed of a running cluster's (said, not refused:
        compose runs init again at every `up`, a scale-out included)."""
        keys = K.Keys(namespace)
        old = {k.decode(): v.decode() for k, v in (await r.hgetall(keys.cluster)).items()}
        pipe = r.pipeline(transaction=False)
        pipe.exists(keys.leader)
        for rank in range(max(int(old.get("ranks") or 0), sched.ranks)):
            pipe.exists(keys.rank_alive(rank))
        running = any(await pipe.execute())
        if running and old.get("started"):
            # the start time names the api-servers' shared /metrics directory: a replica
            # started after a new one would count apart from the others
            record["started"] = float(old["started"])
        changed = [f"{k} {old[k]} -> {v}" for k, v in record.items()
                   if k != "started" and k in old and old[k] != str(v)] if running else []
        await r.hset(keys.cluster, mapping=record)
        return changed
    changed = asyncio.run(with_redis(url, write))
    if changed:
        typer.secho(f"lockstep: the cluster in namespace {namespace!r} runs, and its services read this record: "
                    f"changed {', '.join(changed)}. If that was not meant, run init again with its settings "
                    "(`lockstep config` shows them)", fg=typer.colors.YELLOW, err=True)
    if json:
        emit_json({"namespace": namespace, "cluster": record})
    else:
        typer.echo(f"cluster record written to {K.Keys(namespace).cluster}: " +
                   ", ".join(f"{k}={v}" for k, v in record.items() if k != "started"))


def register(app: typer.Typer) -> None:
    app.command("init")(init_cmd)
