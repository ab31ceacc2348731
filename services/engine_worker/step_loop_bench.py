"""Benchmark of the live engine step loop: a whole `lockstep up` cluster under steady load.

    python -m services.engine_worker.step_loop_bench --ranks 2|4 [--backend torch|sim] [--json]

Starts a private cluster (its own Redis, namespace and port, like scripts/bench-path),
keeps ``--concurrency`` streaming requests in flight per rank (each pinned with
``data_parallel_rank``, a new one as soon as one finishes), and after a warm-up reads the
engines' own per-step stats from the ``<ns>:stats`` stream over the measurement window:

* steps/s and ms per step: a rank's step period is the time between the ends of two
  consecutive steps (the whole loop: schedule, collective, forward, Redis round trip);
  ``forward_ms`` is the slowest rank's forward + postprocess of a step;
* collective share: the time a rank spent in the step all-gather (``exchange_s``, incl.
  waiting for peers) and in the MoE all-to-alls (``comm_s``, torch only) ÷ its step period;
* Redis round trips per rank per step of the step loop (``round_trips``; the liveness
  thread and the api-server watch are not counted; goal: one);
* decode tokens/s, balance ratio and idle-forward fraction (shared/measures.py).

All figures are medians over steps (and over ranks where a figure is per rank).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis

from shared.bus import connect
from shared.keys import Keys
from shared.stats import is_pause_report
from shared.measures import balance_ratio, idle_forward_fraction
from shared.messages import FIELD
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def start_cluster(ranks: int, backend: str, port: int, namespace: str, time_scale: float,
                  timeout_s: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "LOCKSTEP_STATE_DIR": tempfile.mkdtemp(prefix="lockstep-engine-bench-")}
    env.pop("LOCKSTEP_REDIS_URL", None)
    up = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "up", "--backend", backend,
                           "--ranks", str(ranks), "--api-servers", "1", "--port", str(port),
                           "--namespace", namespace, "--time-scale", str(time_scale), "--log-level", "warning"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    assert up.stdout is not None
    for line in up.stdout:
        if line.startswith("REDIS_URL="):
            return up, line.split("=", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    stop_cluster(up)
    raise SystemExit("the cluster did not start (see `lockstep up` logs)")


def stop_cluster(up: subprocess.Popen) -> None:
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)


async def _load(url: str, ranks: int, concurrency: int, max_tokens: int, stop: asyncio.Event,
                done: list[int]) -> None:
    """``concurrency`` streaming requests per rank, each replaced as soon as it finishes.
    Output lengths vary (uniform in [max_tokens/2, 3*max_tokens/2], the first request of
    each client in [1, max_tokens]) so the clients do not move in convoys that all finish,
    and leave their rank empty, in the same step."""
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=ranks * concurrency + 8,
                                                                  max_keepalive_connections=ranks * concurrency)) as http:
        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                mt = rng.randint(1, max_tokens) if n == 0 else rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2)
                body = {"model": "lockstep-moe", "prompt": f"bench client {i} request {n}", "max_tokens": mt,
                        "ignore_eos": True, "temperature": 0, "stream": True, "data_parallel_rank": i % ranks}
                n += 1
                try:
                    async with http.stream("POST", url + "/completions", json=body) as resp:
                        async for _ in resp.aiter_lines():
                            if stop.is_set():
                                return
                    done[0] += 1
                except httpx.HTTPError:
                    done[1] += 1
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(client(i) for i in range(ranks * concurrency)))


async def _mark(r: aioredis.Redis, keys: Keys) -> bytes:
    last = await r.xrevrange(keys.stats, count=1)
    return last[0][0] if last else b"0-0"


async def drive(url: str, redis_url: str, namespace: str, ranks: int, concurrency: int, max_tokens: int,
                warmup_s: float, duration_s: float) -> tuple[list[dict[str, Any]], dict[str, int]]:
    keys = Keys(namespace)
    r = connect(redis_url)
    stop = asyncio.Event()
    done = [0, 0]
    load = asyncio.create_task(_load(url, ranks, concurrency, max_tokens, stop, done))
    try:
        await asyncio.sleep(warmup_s)           # fixed warm-up and measurement windows
        start = await _mark(r, keys)
        done0 = list(done)
        await asyncio.sleep(duration_s)
        end = await _mark(r, keys)
        entries = await r.xrange(keys.stats, min=start, max=end)
        stats = [orjson.loads(f[FIELD]) for eid, f in entries if eid != start]
        stats = [d for d in stats if not is_pause_report(d)]   # a pause's report is not a step
        return stats, {"completed": done[0] - done0[0], "errors": done[1] - done0[1]}
    finally:
        stop.set()
        load.cancel()
        try:
            await load
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the load is over either way
            pass
        await r.aclose()


def _round(v: float | None, nd: int) -> float | None:
    return None if v is None else round(v, nd)


def summarize(stats: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    med = statistics.median
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    by_step: dict[tuple[int, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for d in stats:
        by_rank[d["rank"]].append(d)
        by_step[(d["wave"], d["step"])][d["rank"]] = d
    periods, shares, a2a_shares, x_shares, rtts, rates = [], [], [], [], [], []
    for rank, rows in by_rank.items():
        rows.sort(key=lambda d: (d["wave"], d["step"]))
        steps = trips = 0
        for a, b in zip(rows, rows[1:]):
            if (b["wave"], b["step"]) != (a["wave"], a["step"] + 1):
                continue                         # a pause (new wave) in between
            dt = b["t"] - a["t"]
            if dt <= 0:
                continue
            ea, eb = a.get("extra", {}), b.get("extra", {})
            comm = eb.get("comm_s", 0.0) - ea.get("comm_s", 0.0)
            exch = eb.get("exchange_s", 0.0) - ea.get("exchange_s", 0.0)
            periods.append(dt)
            shares.append((comm + exch) / dt)
            a2a_shares.append(comm / dt)
            x_shares.append(exch / dt)
            if "round_trips" in eb and "round_trips" in ea:
                trips += eb["round_trips"] - ea["round_trips"]
                steps += 1
        if steps:
            rtts.append(trips / steps)
        if len(rows) > 1 and rows[-1]["t"] > rows[0]["t"]:
            rates.append((len(rows) - 1) / (rows[-1]["t"] - rows[0]["t"]))
    full = [v for v in by_step.values() if len(v) == ranks]
    sched = [[v[r]["scheduled"] for r in range(ranks)] for v in full]
    idle = [[v[r]["idle"] for r in range(ranks)] for v in full]
    window = (max(d["t"] for d in stats) - min(d["t"] for d in stats)) if stats else 0.0
    decode = sum(d["decode"] for d in stats)
    return {
        "steps": len(full),
        "steps_per_s": round(med(rates), 2) if rates else None,
        "step_ms_median": round(med(periods) * 1e3, 2) if periods else None,
        "forward_ms_median": round(med([max(v[r]["dur_ms"] for r in v) for v in full]), 2) if full else None,
        "collective_share_median": round(med(shares), 3) if shares else None,
        "all_to_all_share_median": round(med(a2a_shares), 3) if a2a_shares else None,
        "exchange_share_median": round(med(x_shares), 3) if x_shares else None,
        "redis_round_trips_per_rank_step": round(med(rtts), 3) if rtts else None,
        "decode_tokens_per_s": round(decode / window, 1) if window else None,
        "tokens_per_step_median": med([sum(row) for row in sched]) if sched else None,
        # None (null) when no full step had work: no data, not a perfect figure
        "balance_ratio": _round(balance_ratio(sched), 3),
        "idle_forward_fraction": _round(idle_forward_fraction(sched, idle), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.engine_worker.step_loop_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, choices=[1, 2, 4, 8])
    p.add_argument("--backend", default="torch", choices=["torch", "sim"])
    p.add_argument("--concurrency", type=int, default=32, help="streaming requests in flight per rank")
    p.add_argument("--max-tokens", type=int, default=64, help="mean output length (varied +-50%%)")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds of load before measuring")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim backend: scale of modeled device time")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    port = free_port()
    namespace = f"ebench{os.getpid()}"
    up, redis_url = start_cluster(args.ranks, args.backend, port, namespace, args.time_scale, args.start_timeout)
    try:
        stats, reqs = asyncio.run(drive(f"http://127.0.0.1:{port}/v1", redis_url, namespace, args.ranks,
                                        args.concurrency, args.max_tokens, args.warmup, args.duration))
    finally:
        stop_cluster(up)
    out = {"ranks": args.ranks, "backend": args.backend, "concurrency_per_rank": args.concurrency,
           "max_tokens": args.max_tokens, "duration_s": args.duration, **summarize(stats, args.ranks),
           "requests_completed": reqs["completed"], "request_errors": reqs["errors"]}
    if args.json:
        print(json.dumps(out))
    else:
        width = max(map(len, out))
        for k, v in out.items():
            print(f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
