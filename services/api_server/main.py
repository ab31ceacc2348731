"""Run one api-server replica. Every replica binds the same port with SO_REUSEPORT, so
the kernel spreads connections across them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from services.api_server.app import create_app
from services.api_server.metrics_dir import for_cluster
from services.api_server.read_timeout import protocol_with_head_timeout
from services.api_server.waiting_room import WaitingRoom
from shared.bus import BadRedisUrlError, RedisUnreachable, wait_reachable, worth_logging
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


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins (``on_exit``), so that the
    requests in flight end with a 503 within ``shutdown_grace_s``, streams with an error
    event, instead of being cut when uvicorn's own grace runs out."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def _waiting(settings: ApiServerSettings) -> Callable[[str, int], None]:
    def say(error: str, attempt: int) -> None:
        if worth_logging(attempt):
            print(f"lockstep api-server: waiting for Redis (up to {settings.redis_wait_s:g} s): {error}", flush=True)
    return say


async def _wait_for_redis(settings: ApiServerSettings, sock: socket.socket) -> None:
    """Return once Redis is reachable. While a replica allowed to wait (``redis_wait_s``)
    does, its port answers 503 ``redis_unavailable`` rather than refusing connections."""
    try:
        await wait_reachable(settings.redis_url, 0)
        return
    except RedisUnreachable as exc:
        if isinstance(exc, BadRedisUrlError) or settings.redis_wait_s <= 0:
            raise
    room = WaitingRoom(sock, settings.redis_url, settings.body_limit)
    await room.open()
    try:
        await wait_reachable(settings.redis_url, settings.redis_wait_s, on_wait=_waiting(settings))
    finally:
        await room.close()


def main(settings: ApiServerSettings) -> int:
    try:
        sock = reuseport_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"lockstep api-server: cannot listen on {settings.host}:{settings.port}: {exc}")
        return 2
    try:
        asyncio.run(_wait_for_redis(settings, sock))
    except RedisUnreachable as exc:
        print(f"lockstep api-server: {exc}")
        return 2
    try:
        metrics_dir = asyncio.run(for_cluster(settings.redis_url, settings.namespace, settings.port))
    except Exception as exc:  # noqa: BLE001 - metrics then cover this replica only, as before
        print(f"lockstep api-server: metrics are this replica's only: {exc}")
        metrics_dir = None
    app = create_app(settings, metrics_dir)
    # uvicorn cuts what is still open this long after the signal: past our own grace, by
    # which time every request has had its 503
    config = uvicorn.Config(app, loop="uvloop", http=protocol_with_head_timeout(settings.read_timeout_s),
                            log_level="warning", access_log=False,
                            timeout_graceful_shutdown=settings.shutdown_grace_s + 2, backlog=4096,
                            timeout_keep_alive=30)
    server = _Server(config, on_exit=app.begin_close)
    server.run(sockets=[sock])
    return 0
