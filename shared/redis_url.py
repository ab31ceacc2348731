"""Which Redis deployment a URL names: one server, a Redis Cluster or a Sentinel group.

Pure parsing; shared/bus.py builds the client. Accepted forms (TLS with ``rediss``):

- ``redis://[user:pw@]HOST:PORT[/DB]``: one server (redis-py's own URL rules);
- ``redis+cluster://[user:pw@]HOST:PORT[,HOST:PORT...]``: a Redis Cluster; any node will
  do, the client learns the others (and every failover) from the cluster itself (name
  several: a process that starts while the only named node is down finds no cluster;
  ``with_nodes`` adds the ones learned, for the processes a supervisor starts);
- ``redis+sentinel://[user:pw@]HOST:PORT[,HOST:PORT...]/SERVICE_NAME[/DB]``: the primary
  that these sentinels name for SERVICE_NAME (the user and password are the data
  servers'; sentinels without auth).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote

SINGLE, CLUSTER, SENTINEL = "single", "cluster", "sentinel"


class BadRedisUrl(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class RedisTarget:
    kind: str                              # SINGLE, CLUSTER or SENTINEL
    url: str                               # as given (SINGLE: passed to redis-py as is)
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""                      # SENTINEL: the monitored primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse(url: str) -> RedisTarget:
    """The deployment ``url`` names; BadRedisUrl with what is wrong otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise BadRedisUrl(f"not a Redis URL (no scheme): {url!r}")
    scheme = scheme.lower()
    if scheme in ("redis", "rediss"):
        # redis-py reads a database that is not a number as 0, without a word
        path = rest.rpartition("@")[2].partition("/")[2].split("?", 1)[0].strip("/")
        if path and not path.isdigit():
            raise BadRedisUrl(f"bad database number {path!r} in {url!r}: use redis://HOST:PORT/N, N a number")
        return RedisTarget(SINGLE, url)
    if scheme == "unix":
        return RedisTarget(SINGLE, url)
    base, plus, kind = scheme.partition("+")
    if not plus or base not in ("redis", "rediss") or kind not in (CLUSTER, SENTINEL):
        raise BadRedisUrl(f"unknown Redis URL scheme {scheme!r}: use redis://, rediss://, "
                          "redis+cluster:// or redis+sentinel://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        userinfo, hostpart = "", rest
    hosts, _, path = hostpart.partition("/")
    path = path.split("?", 1)[0]
    nodes = tuple(_node(h, url) for h in hosts.split(",") if h)
    if not nodes:
        raise BadRedisUrl(f"no HOST:PORT in {url!r}")
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if colon else None)
    parts = [p for p in path.split("/") if p]
    service, db = "", 0
    if kind == SENTINEL:
        if not parts:
            raise BadRedisUrl(f"a sentinel URL names the service: redis+sentinel://HOST:PORT/SERVICE_NAME, got {url!r}")
        service, parts = parts[0], parts[1:]
    if parts:
        if kind == CLUSTER:
            raise BadRedisUrl(f"Redis Cluster has only database 0: drop '/{'/'.join(parts)}' from {url!r}")
        if len(parts) > 1 or not parts[0].isdigit():
            raise BadRedisUrl(f"bad database number in {url!r}")
        db = int(parts[0])
    return RedisTarget(kind, url, nodes, service, db, username, password, base == "rediss")


def _node(text: str, url: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = text, "6379" if "sentinel" not in url else "26379"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRedisUrl(f"bad HOST:PORT {text!r} in {url!r}")
    return host, int(port)


def with_nodes(url: str, nodes: Iterable[tuple[str, int]]) -> str:
    """A ``redis+cluster://`` URL that also names ``nodes`` (after its own, no repeats);
    any other URL as it is."""
    target = parse(url)
    if target.kind != CLUSTER:
        return url
    extra = [n for n in dict.fromkeys(nodes) if n not in target.nodes]
    if not extra:
        return url
    scheme, _, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    hosts, slash, tail = hostpart.partition("/")
    named = ",".join([hosts.rstrip(","), *(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in extra)])
    return f"{scheme}://{userinfo}{at}{named}{slash}{tail}"
