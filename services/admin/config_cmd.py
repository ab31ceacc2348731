"""``lockstep config``: every service's effective settings and where each value came from
(default, LOCKSTEP_* env, the cluster record), secrets redacted."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import typer

from services.admin import local_state
from services.admin.cmd_common import console as out_console, JSON_OPT, NS_OPT, URL_OPT, as_str, emit_json, fail, resolve, with_redis
from shared import keys as K

# What `lockstep up` writes into <ns>:cluster and passes to every service as LOCKSTEP_*.
CLUSTER_FIELDS = {"ranks": "ranks", "policy": "policy", "dispatch": "dispatch", "backend": "backend",
                  "api_servers": "num_api_servers", "port": "port"}
SERVICES = {"api-server": "ApiServerSettings", "scheduler": "SchedulerSettings", "engine-worker": "EngineSettings"}


def effective_config(env: dict[str, str], cluster: dict[str, str], namespace: str,
                     redis_url: str | None) -> dict[str, Any]:
    """Each service's settings: defaults, then LOCKSTEP_* env vars, then the running
    cluster's record (<ns>:cluster, what `lockstep up` gave its children); secrets redacted."""
    from shared import settings as S

    out: dict[str, Any] = {}
    for service, cls_name in SERVICES.items():
        cls = getattr(S, cls_name)
        names = set(cls.model_fields)
        overrides: dict[str, Any] = {"namespace": namespace}
        if redis_url:
            overrides["redis_url"] = redis_url
        # a renamed setting may still come from its old variable
        source = {n: ("env" if any(S.ENV_PREFIX + a.upper() in env for a in S.names_of(cls, n)) else "default")
                  for n in names}
        # -n, else LOCKSTEP_NAMESPACE (the option's envvar), else the default
        source["namespace"] = ("flag" if namespace != env.get(S.ENV_PREFIX + "NAMESPACE", namespace)
                               else "env" if S.ENV_PREFIX + "NAMESPACE" in env
                               else "default" if namespace == K.DEFAULT_NAMESPACE else "flag")
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
            return {as_str(k): as_str(v) for k, v in (await r.hgetall(K.Keys(namespace).cluster)).items()}
        cluster = asyncio.run(with_redis(url, read))
    try:
        cfg = effective_config(dict(os.environ), cluster, namespace, url)
    except ValueError as exc:    # a LOCKSTEP_* value or combination the services would refuse
        fail(str(exc), 2)
    if service:
        cfg = {service: cfg[service]}
    if json:
        emit_json({name: {k: v["value"] for k, v in fields.items()} for name, fields in cfg.items()}
                  | {"_sources": {name: {k: v["source"] for k, v in fields.items()} for name, fields in cfg.items()}})
        return
    from rich.table import Table

    console = out_console()
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


def register(app: typer.Typer) -> None:
    app.command("config")(config_cmd)
