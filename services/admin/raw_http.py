"""A minimal keep-alive HTTP/1.1 client over asyncio streams, for the request-path benchmarks.

A general-purpose client (httpx, openai) spends more CPU per request than the server path
being measured, on the same cores, and with hundreds of streams in one process it stalls on
its own (seconds), which would be read as the server's. This one writes a prepared request
and reads only what it must: the status and body of a plain response, the ``data:`` lines
of an SSE stream (chunked; the connection stays usable after ``[DONE]``).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import urlsplit

import orjson


class RawConnection:
    def __init__(self, url: str) -> None:
        """``url``: the API base, e.g. ``http://127.0.0.1:8000/v1``."""
        self.parts = urlsplit(url)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "RawConnection":
        self.reader, self.writer = await asyncio.open_connection(self.parts.hostname, self.parts.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()

    def wire(self, path: str, body: dict) -> bytes:
        """The bytes of ``POST <base><path>`` with a JSON body (prepare once, send many)."""
        data = orjson.dumps(body)
        return (f"POST {self.parts.path}{path} HTTP/1.1\r\nHost: {self.parts.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data

    def send(self, wire: bytes) -> None:
        assert self.writer is not None, "use RawConnection as 'async with'"
        self.writer.write(wire)

    async def response(self) -> tuple[int, bytes]:
        """(status, body) of a plain (Content-Length) response."""
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return int(head[9:12]), await self.reader.readexactly(length)

    async def events(self) -> AsyncIterator[bytes]:
        """The ``data: {...}`` lines of a streamed response, until ``[DONE]`` (then the
        chunked body's end is read, so the connection can carry the next request) or the
        server closes the connection."""
        assert self.reader is not None
        while True:   # chunked transfer: size lines, data lines, blank lines
            line = await self.reader.readline()
            if not line:
                return
            if line.startswith(b"data: [DONE]"):
                await self.reader.readuntil(b"0\r\n\r\n")   # the terminating chunk
                return
            if line.startswith(b"data: {"):
                yield line
