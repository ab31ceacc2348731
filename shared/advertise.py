"""The address this host's engine ranks advertise to the other hosts of their group.

``LOCKSTEP_GROUP_HOST=auto`` (compose, Kubernetes: every container has its own address,
which no static setting knows) and ``lockstep engine`` without ``--advertise-addr`` use the
address this host reaches Redis from: every host reaches Redis, so the others most likely
reach this host there. No packet is sent: a UDP connect only picks a route.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

AUTO = "auto"


class AddressUnknown(ValueError):
    """This host's address cannot be told from the Redis URL."""


def redis_host(url: str) -> str | None:
    """The first Redis host a URL names (cluster and sentinel URLs list several)."""
    from shared.redis_url import SINGLE, parse

    target = parse(url)
    if target.kind == SINGLE:
        return urlsplit(url).hostname
    return target.nodes[0][0] if target.nodes else None


def route_addr(redis_url: str) -> str:
    """The local address of the route to the Redis host."""
    host = redis_host(redis_url)
    if not host:
        raise AddressUnknown("cannot tell this host's address from the Redis URL")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError as exc:
        raise AddressUnknown(f"cannot tell this host's address ({exc})") from None


def resolve(group_host: str, redis_url: str) -> str:
    """``group_host`` itself, or the route to Redis when it is ``auto``."""
    return route_addr(redis_url) if group_host.strip().lower() == AUTO else group_host
