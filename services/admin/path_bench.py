"""Benchmark of the request path itself, with zero device time.

Starts (or uses) a cluster running the sim backend with --time-scale 0, then measures
from the client side:
- added TTFT: HTTP request sent -> first SSE chunk carrying text, one request at a time
  (p50/p99 over N samples): what lockstep adds on top of the device;
- sustained short requests/s (max_tokens 1, non-streaming) across the api-servers at a
  fixed concurrency.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import orjson


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


async def measure_ttft(url: str, samples: int, model: str = "lockstep-moe") -> list[float]:
    """Request written -> first SSE chunk carrying text, one request at a time over a kept-alive
    raw connection (a general-purpose client adds its own milliseconds on this path)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = orjson.dumps({"model": model, "prompt": "ttft probe", "max_tokens": 2, "stream": True, "ignore_eos": True})
    wire = (f"POST {parts.path}/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    out: list[float] = []
    try:
        for i in range(samples + 5):
            t0 = time.perf_counter()
            writer.write(wire)
            first = None
            while True:   # chunked transfer: size lines, data lines, blank lines
                line = await reader.readline()
                if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
                    first = time.perf_counter() - t0
                if line.startswith(b"data: [DONE]"):
                    await reader.readuntil(b"0\r\n\r\n")   # the terminating chunk
                    break
            if i >= 5 and first is not None:   # the first few warm the code paths
                out.append(first * 1000)
            await asyncio.sleep(0.01)
    finally:
        writer.close()
    return out


async def measure_rps(url: str, requests: int, concurrency: int, model: str = "lockstep-moe") -> dict[str, Any]:
    """Keep-alive HTTP/1.1 over raw asyncio streams: a general-purpose client (httpx) spends
    more CPU per request than the server path being measured, on the same cores."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = orjson.dumps({"model": model, "prompt": "hi", "max_tokens": 1, "ignore_eos": True})
    wire = (f"POST {parts.path}/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    lat: list[float] = []
    errors = 0
    left = requests

    async def worker() -> None:
        nonlocal errors, left
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                writer.write(wire)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                if status != 200:
                    errors += 1
                lat.append((time.perf_counter() - t0) * 1000)
        finally:
            writer.close()

    t0 = time.perf_counter()
    if True:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"requests": requests, "concurrency": concurrency, "errors": errors, "wall_s": round(wall, 3),
            "req_per_s": round(requests / wall, 1), "latency_p50_ms": round(_pct(lat, 50), 2),
            "latency_p99_ms": round(_pct(lat, 99), 2)}


def run(url: str, samples: int, requests: int, concurrency: int) -> dict[str, Any]:
    ttft = asyncio.run(measure_ttft(url, samples))
    rps = asyncio.run(measure_rps(url, requests, concurrency))
    return {"ttft_added_ms": {"p50": round(statistics.median(ttft), 3), "p99": round(_pct(ttft, 99), 3),
                              "samples": len(ttft)},
            "sustained": rps}
