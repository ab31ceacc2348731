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

from services.admin.raw_http import RawConnection
from shared import trace


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


async def measure_ttft(url: str, samples: int, model: str = "lockstep-moe") -> list[float]:
    """Request written -> first SSE chunk carrying text, one request at a time over a kept-alive
    raw connection (a general-purpose client adds its own milliseconds on this path)."""
    out: list[float] = []
    async with RawConnection(url) as conn:
        wire = conn.wire("/completions", {"model": model, "prompt": "ttft probe", "max_tokens": 2,
                                          "stream": True, "ignore_eos": True})
        for i in range(samples + 5):
            if trace.ENABLED:
                trace.mark("client_sent")
            t0 = time.perf_counter()
            conn.send(wire)
            first = None
            async for line in conn.events():
                if first is None and b'"text":""' not in line:
                    first = time.perf_counter() - t0
                    if trace.ENABLED:
                        trace.mark("client_first")
            if i >= 5 and first is not None:   # the first few warm the code paths
                out.append(first * 1000)
            await asyncio.sleep(0.01)
    return out


async def measure_rps(url: str, requests: int, concurrency: int, model: str = "lockstep-moe") -> dict[str, Any]:
    """Short non-streaming requests over ``concurrency`` kept-alive raw connections."""
    lat: list[float] = []
    errors = 0
    left = requests

    async def worker() -> None:
        nonlocal errors, left
        async with RawConnection(url) as conn:
            wire = conn.wire("/completions", {"model": model, "prompt": "hi", "max_tokens": 1, "ignore_eos": True})
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                conn.send(wire)
                status, _ = await conn.response()
                if status != 200:
                    errors += 1
                lat.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests": requests, "concurrency": concurrency, "errors": errors, "wall_s": round(wall, 3),
            "req_per_s": round(requests / wall, 1), "latency_p50_ms": round(_pct(lat, 50), 2),
            "latency_p99_ms": round(_pct(lat, 99), 2)}


async def calibrate(redis_url: str, samples: int = 200, block_ms: int = 2000,
                    idle_s: float = 0.005) -> dict[str, float | None]:
    """What one hop costs on this host, for reading the figures above elsewhere: a Redis
    round trip (PING, back to back) and the wake-up of a reader blocked in XREAD by an
    XADD from another connection after an idle gap (what every hop of the path pays)."""
    from shared.bus import connect

    r = connect(redis_url)
    reader_conn = connect(redis_url)
    key = f"lockstep:calibrate:{time.time_ns()}"
    try:
        pings = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await r.ping()
            pings.append((time.perf_counter() - t0) * 1e6)
        wakes = []
        last = "$"
        for _ in range(samples // 2):
            read = asyncio.ensure_future(reader_conn.xread({key: last}, block=block_ms))
            await asyncio.sleep(idle_s)   # the reader is blocked and the host idles, as between requests
            t0 = time.perf_counter()
            last = await r.xadd(key, {"t": "1"})
            if await read:   # empty: the block ran out before the add (a loaded host): no sample
                wakes.append((time.perf_counter() - t0) * 1e6)
        return {"redis_ping_us": round(statistics.median(pings), 1),
                "xadd_to_xread_wake_us": round(statistics.median(wakes), 1) if wakes else None}
    finally:
        await r.delete(key)
        await r.aclose()
        await reader_conn.aclose()


def run(url: str, samples: int, requests: int, concurrency: int) -> dict[str, Any]:
    ttft = asyncio.run(measure_ttft(url, samples))
    rps = asyncio.run(measure_rps(url, requests, concurrency))
    return {"ttft_added_ms": {"p50": round(statistics.median(ttft), 3), "p99": round(_pct(ttft, 99), 3),
                              "samples": len(ttft)},
            "sustained": rps}


# The hops of one request, in path order (shared/trace.py marks; "R" is the rank that
# received the request). A missing mark (e.g. no scheduler with --dispatch client) joins
# its two neighbours into one hop.
PATH_MARKS = ["client_sent", "http_in", "submit_sent", "sched_read", "sched_sent", "rank_wake:R", "step_start:R",
              "step_synced:R", "publish_sent:R", "api_read", "sse_first", "client_first"]
HOP_NAMES = {
    ("client_sent", "http_in"): "client -> api handler (HTTP, ASGI)",
    ("http_in", "submit_sent"): "api: parse, admit",
    ("submit_sent", "sched_read"): "api -> Redis -> scheduler",
    ("sched_read", "sched_sent"): "scheduler: policy, pipeline",
    ("sched_sent", "rank_wake:R"): "scheduler -> Redis -> rank (wake)",
    ("submit_sent", "rank_wake:R"): "api -> Redis -> rank (wake)",
    ("rank_wake:R", "step_start:R"): "rank: admit, schedule",
    ("step_start:R", "step_synced:R"): "step collective (all ranks)",
    ("step_synced:R", "publish_sent:R"): "forward (zero time), postprocess",
    ("publish_sent:R", "api_read"): "rank -> Redis -> api",
    ("api_read", "sse_first"): "api: route delta, SSE chunk",
    ("sse_first", "client_first"): "api -> client",
}


def breakdown(trace_dir: str, skip: int = 5) -> list[dict[str, Any]]:
    """p50 of each hop over the TTFT probes, from the marks the processes wrote."""
    import glob

    marks: list[tuple[float, str]] = []
    for path in glob.glob(f"{trace_dir}/*.trace"):
        with open(path) as f:
            marks.extend((float(t), name) for t, name in (line.split() for line in f if line.strip()))
    marks.sort()
    probes: list[dict[str, float]] = []
    for t, name in marks:
        if name == "client_sent":
            probes.append({name: t})
        elif probes and name not in probes[-1]:
            probes[-1][name] = t
    hops: dict[tuple[str, str], list[float]] = {}
    for p in probes[skip:]:
        woke = [k.split(":")[1] for k in p if k.startswith("rank_wake:")]
        if "client_first" not in p or not woke:
            continue
        seen = [(m, p[m.replace(":R", ":" + woke[0])]) for m in PATH_MARKS if m.replace(":R", ":" + woke[0]) in p]
        for (a, ta), (b, tb) in zip(seen, seen[1:]):
            hops.setdefault((a, b), []).append((tb - ta) * 1000)
    out = []
    for (a, b), xs in hops.items():
        out.append({"hop": HOP_NAMES.get((a, b), f"{a} -> {b}"), "p50_ms": round(statistics.median(xs), 3),
                    "samples": len(xs)})
    return out
