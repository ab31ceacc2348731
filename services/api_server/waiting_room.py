"""What an api-server started during a Redis outage answers while it waits for Redis.

Without Redis it can serve nothing, but a client should hear that, with a Retry-After,
instead of "connection refused" (which reads as "nothing is there; check the address").
So the replica binds its port at once and answers every request on it with a 503
(``redis_unavailable``) until Redis is reachable; then the real server takes the same
listening socket over, and the connections waiting in its backlog go to it.
"""

from __future__ import annotations

import asyncio
import socket

import orjson

from shared.bus import redact_url

RETRY_AFTER_S = 5
_HEAD_LIMIT = 64 << 10    # bytes of request line and headers read before answering
_READ_S = 5.0             # a client that sends nothing in this long is dropped


def unavailable_response(redis_url: str) -> bytes:
    """The whole HTTP/1.1 answer: a 503 in OpenAI's error shape."""
    body = orjson.dumps({"error": {
        "message": f"this api-server is waiting for Redis ({redact_url(redis_url)}), which is unreachable; retry after the "
                   "Retry-After delay", "type": "server_error", "param": None, "code": "redis_unavailable"}})
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"retry-after: {RETRY_AFTER_S}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def body_length(head: bytes) -> int:
    """The Content-Length a request head declares (0 if none or unreadable)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return 0


class WaitingRoom:
    """Answers 503 on a listening socket until closed; the socket itself stays open (it
    serves a duplicate of it), so that the real server can take it over."""

    def __init__(self, sock: socket.socket, redis_url: str, max_body_bytes: int) -> None:
        self.sock, self.answer, self.max_body = sock, unavailable_response(redis_url), max_body_bytes
        self.server: asyncio.Server | None = None

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._serve, sock=self.sock.dup(), limit=_HEAD_LIMIT)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_S):
                head = await reader.readuntil(b"\r\n\r\n")
                # read what it sent (up to the body limit), so closing does not reset the
                # connection before the client has read the answer
                await reader.readexactly(min(body_length(head), self.max_body))
            writer.write(self.answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
