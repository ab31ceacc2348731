"""What every operator command shares: the ``--namespace/-n``, ``--redis-url`` and
``--json`` options, finding the cluster's Redis (unreachable: one red line, exit 2), and
decoding Redis replies for display."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import orjson
import typer

from services.admin import local_state
from shared.replies import as_str

NS_OPT = typer.Option("ls", "--namespace", "-n", envvar="LOCKSTEP_NAMESPACE", help="Key prefix of the cluster.")
URL_OPT = typer.Option(None, "--redis-url", help="Redis URL (default: LOCKSTEP_REDIS_URL, else the local cluster's).")
JSON_OPT = typer.Option(False, "--json", help="Machine-readable JSON instead of tables.")


PIPED_WIDTH = 160   # a table written to a file or a pipe: wide enough that no column is cut


def console() -> Any:
    """A rich Console for a command's tables: the terminal's width, or ``PIPED_WIDTH``
    where stdout is not a terminal (rich's 80 columns cut headers and values there)."""
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


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


def require_cluster(url: str, namespace: str) -> None:
    """Exit 2 with what to do when nothing of a cluster is recorded in ``namespace`` at
    ``url`` (a mistyped ``-n`` read as an empty, healthy-looking cluster, exit 0)."""
    from shared import keys as K
    from shared.bus import redact_url

    async def recorded(r: Any) -> bool:
        return bool(await r.exists(K.Keys(namespace).cluster))
    if not asyncio.run(with_redis(url, recorded)):
        fail(no_cluster_message(namespace, redact_url(url)), 2)


def no_cluster_message(namespace: str, shown_url: str) -> str:
    from shared import keys as K
    return (f"no cluster in namespace {namespace!r} at {shown_url} (nothing recorded there): start one with "
            f"`{K.admin_command('up', namespace)}`, or pass the namespace it runs in (-n NAMESPACE)")


def log_level_known(name: str) -> bool:
    """A level the services' settings take (checked before any of them starts)."""
    from shared.settings import LOG_LEVELS
    return name.lower() in LOG_LEVELS


def given(ctx: typer.Context, *names: str) -> set[str]:
    """Which of the options ``names`` the command line (or the environment) set, rather than
    left at their defaults: so a command can refuse one that another makes moot. (By name:
    typer may run on its own copy of click, whose ParameterSource is another enum.)"""
    out = set()
    for n in names:
        src = ctx.get_parameter_source(n)
        if src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP"):
            out.add(n)
    return out


def emit_json(data: Any) -> None:
    typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())


def as_number(v: Any) -> Any:
    """A hash value as int or float when it is one, else str."""
    s = as_str(v)
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


async def with_redis(url: str, fn: Any) -> Any:
    """``await fn(client)`` with a client that is closed afterwards."""
    from shared.bus import connect
    r = connect(url, timeout_s=5.0)
    try:
        return await fn(r)
    finally:
        await r.aclose()
