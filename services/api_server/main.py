"""Run one api-server replica. Every replica binds the same port with SO_REUSEPORT, so
the kernel spreads connections across them."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from services.api_server.app import create_app
from services.api_server.metrics_dir import for_cluster
from shared.bus import RedisUnreachable, check_reachable
from shared.settings import ApiServerSettings


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def main(settings: ApiServerSettings) -> int:
    try:
        asyncio.run(check_reachable(settings.redis_url))
    except RedisUnreachable as exc:
        print(f"lockstep api-server: {exc}")
        return 2
    try:
        sock = reuseport_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"lockstep api-server: cannot listen on {settings.host}:{settings.port}: {exc}")
        return 2
    try:
        metrics_dir = asyncio.run(for_cluster(settings.redis_url, settings.namespace, settings.port))
    except Exception as exc:  # noqa: BLE001 - metrics then cover this replica only, as before
        print(f"lockstep api-server: metrics are this replica's only: {exc}")
        metrics_dir = None
    app = create_app(settings, metrics_dir)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, backlog=4096, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0
