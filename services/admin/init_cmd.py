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

    async def write(r: Any) -> None:
        await r.hset(K.Keys(namespace).cluster, mapping=record)
    asyncio.run(with_redis(url, write))
    if json:
        emit_json({"namespace": namespace, "cluster": record})
    else:
        typer.echo(f"cluster record written to {K.Keys(namespace).cluster}: " +
                   ", ".join(f"{k}={v}" for k, v in record.items() if k != "started"))


def register(app: typer.Typer) -> None:
    app.command("init")(init_cmd)
