"""`lockstep bench`'s client counts a request completed only when its stream is whole:
a stream cut before `[DONE]`, or short of the tokens asked, was counted ok (found by the
load probe, 2026-12-05). Real HTTP: a server of the test's own that cuts its streams."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from services.admin.bench_client import stream_one
from services.admin.bench_trace import Item


def _chunk(doc: dict) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


async def _serve(tokens: int, done: bool, port_box: list[int]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
                      if k.lower() == b"content-length")
        await reader.readexactly(length)
        body = b"".join(_chunk({"id": "cmpl-1", "choices": [{"index": 0, "text": "a"}]}) for _ in range(tokens))
        body += _chunk({"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": tokens}})
        if done:
            body += b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port_box.append(server.sockets[0].getsockname()[1])
    return server


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tokens,done,ok", [(5, True, True), (5, False, False), (3, True, False)])
async def test_only_a_whole_stream_counts_as_completed(tokens, done, ok):
    port: list[int] = []
    server = await _serve(tokens, done, port)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            res = await stream_one(client, f"http://127.0.0.1:{port[0]}/v1", "m", Item(0.0, 8, 5), 0)
    finally:
        server.close()
        await server.wait_closed()
    assert res.ok is ok and res.tokens == tokens, res
    assert (res.error == "") is ok
