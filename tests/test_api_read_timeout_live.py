"""A client that stalls while sending its request is dropped after ``read_timeout_s``
(found by the load probe, 2026-12-05: 300 connections that sent nothing, and 500 that sent
their headers and part of a body, were all still open minutes later, outside every
admission bound). A real api-server process and Redis, raw sockets as the clients."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.redis_server import EmbeddedRedis, free_port
from tests.helpers import poll_until

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.0


def _closed_within(sock: socket.socket, bound_s: float) -> tuple[bool, bytes]:
    """(whether the server closed the connection within bound_s, what it sent first)."""
    sock.settimeout(bound_s)
    got = b""
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < bound_s:
            chunk = sock.recv(65536)
            if not chunk:
                return True, got
            got += chunk
    except (TimeoutError, socket.timeout):
        return False, got
    except ConnectionResetError:
        return True, got
    return False, got


@pytest.mark.timeout(60)
def test_stalled_heads_and_bodies_are_dropped():
    redis = EmbeddedRedis(port=free_port()).start()
    port = free_port()
    env = {**os.environ, "LOCKSTEP_REDIS_URL": redis.url, "LOCKSTEP_PORT": str(port), "LOCKSTEP_HOST": "127.0.0.1",
           "LOCKSTEP_NAMESPACE": "readtimeout", "LOCKSTEP_READ_TIMEOUT_S": str(TIMEOUT_S)}
    api = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "api-server"], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
    try:
        poll_until(up, 30, "the api-server serving")
        silent = socket.create_connection(("127.0.0.1", port))
        half_head = socket.create_connection(("127.0.0.1", port))
        half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        half_body = socket.create_connection(("127.0.0.1", port))
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 100\r\n\r\n{\"model\": ")
        bound = TIMEOUT_S + 5   # the timeout plus a loaded machine's slack; without the fix: never
        assert _closed_within(silent, bound) == (True, b"")
        assert _closed_within(half_head, bound) == (True, b"")
        closed, answer = _closed_within(half_body, bound)
        assert closed and answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer
        # a kept-alive connection is fine between requests (uvicorn's keep-alive bounds that)
        with httpx.Client(timeout=5) as c:
            assert c.get(base + "/health").status_code == 200
            time.sleep(TIMEOUT_S + 0.5)
            assert c.get(base + "/health").status_code == 200
        for s in (silent, half_head, half_body):
            s.close()
    finally:
        api.terminate()
        api.wait(20)
        redis.stop()
