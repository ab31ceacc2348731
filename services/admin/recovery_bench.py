"""Benchmark of recovery from a rank death (`python -m services.admin.recovery_bench`).

Starts a sim cluster, runs N streaming requests, SIGKILLs one engine-worker while most
streams are mid-flight, and reports from the client side and the services' logs:
- detect: kill -> first survivor leaves the broken group (collective error);
- resumed: kill -> the scheduler hands the dead rank's requests back to their api-servers;
- re-formed: kill -> the group runs again with the replacement rank (a hot spare, or with
  ``--spares 0`` the dead rank's process started again);
- stall: the longest gap between two tokens of a resumed stream (what its client saw),
  and TTFT / output tokens/s over the run, against the same run without the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any


from services.admin.fault_inject import kill_rank_mid_decode_in_background
from services.admin.raw_http import RawConnection
from shared.redis_server import free_port


def _start(ranks: int, state: str, port: int, spares: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "LOCKSTEP_STATE_DIR": state}
    env.pop("LOCKSTEP_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "up", "--backend", "sim", "--ranks", str(ranks),
                             "--api-servers", "2", "--port", str(port), "--namespace", "rec", "--spares", str(spares)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("REDIS_URL="):
            return proc, line.split("=", 1)[1].strip()
    raise SystemExit("cluster did not start")


async def _run(url: str, n: int, tokens: int) -> dict[str, Any]:
    """``n`` streams at once, each on its own raw connection (services/admin/raw_http.py)."""

    async def one(i: int) -> dict[str, Any]:
        times: list[float] = []
        count = 0
        async with RawConnection(url) as conn:
            wire = conn.wire("/completions", {"model": "lockstep-moe", "prompt": f"recovery {i}", "max_tokens": tokens,
                                              "seed": i, "stream": True, "stream_options": {"include_usage": True},
                                              "ignore_eos": True})
            t0 = time.monotonic()
            conn.send(wire)
            async for line in conn.events():
                doc = json.loads(line[6:])
                if doc.get("usage"):
                    count = doc["usage"]["completion_tokens"]
                if doc.get("choices") and doc["choices"][0].get("text"):
                    times.append(time.monotonic())
        gaps = [b - a for a, b in zip(times, times[1:])]
        return {"ttft": times[0] - t0 if times else None, "max_gap": max(gaps, default=0.0), "tokens": count,
                "end": times[-1] if times else t0}

    t0 = time.monotonic()
    res = await asyncio.gather(*(one(i) for i in range(n)))
    wall = max(r["end"] for r in res) - t0
    return {"results": res, "wall": wall}


def _log_times(log_dir: Path, event: str) -> list[float]:
    out = []
    for f in log_dir.glob("*.log"):
        for line in f.read_text(errors="replace").splitlines():
            if f'"event": "{event}"' in line:
                try:
                    ts = json.loads(line)["timestamp"]
                    out.append(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp())
                except ValueError:
                    pass
    return sorted(out)


def measure(ranks: int, n: int, tokens: int, kill: bool, spares: int = 1) -> dict[str, Any]:
    state = tempfile.mkdtemp(prefix="lockstep-rec-")
    port = free_port()
    up, redis_url = _start(ranks, state, port, spares)
    try:
        status = json.loads(subprocess.run([sys.executable, "-m", "services.admin.cli", "status", "--json", "-n", "rec"],
                                           capture_output=True, text=True, env={**os.environ, "LOCKSTEP_STATE_DIR": state},
                                           check=True).stdout)
        killed = None
        if kill:
            # On the victim's own step reports, once most of its share is mid-decode.
            killed = kill_rank_mid_decode_in_background(redis_url, "rec", ranks - 1, status["ranks"][ranks - 1]["pid"],
                                                        min_running=n // ranks * 3 // 4, max_tokens=tokens)
        run = asyncio.run(_run(f"http://127.0.0.1:{port}/v1", n, tokens))
        if killed is not None:
            run["kill_t"] = killed(5)
            if run["kill_t"] is None:
                raise SystemExit("the victim rank never had most of its requests mid-decode; nothing was measured")
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    res = run["results"]
    ttfts = sorted(r["ttft"] for r in res if r["ttft"] is not None)
    out: dict[str, Any] = {
        "requests": n, "completed_exact": sum(r["tokens"] == tokens for r in res),
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
        "throughput_tok_s": round(sum(r["tokens"] for r in res) / run["wall"], 1),
        "stall_max_ms": round(1000 * max(r["max_gap"] for r in res), 1),
    }
    if kill:
        logs = Path(state) / "rec" / "logs"
        k = run["kill_t"]
        after = lambda ts: [t - k for t in ts if t >= k]  # noqa: E731
        detect = after(_log_times(logs, "engine_group_reforming"))
        resumed = after(_log_times(logs, "resuming_requests_of_dead_ranks"))
        formed = after(_log_times(logs, "engine_group_formed"))
        out.update({"detect_s": round(detect[0], 3) if detect else None,
                    "resumed_s": round(resumed[0], 3) if resumed else None,
                    "reformed_s": round(formed[-1], 3) if formed else None,
                    "stalled_streams": sum(r["max_gap"] > 0.5 for r in res)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--spares", type=int, default=1,
                    help="hot spares (`lockstep up --spares`); 0: the dead rank's process is started again")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = {"baseline": measure(a.ranks, a.requests, a.tokens, kill=False, spares=a.spares),
           "rank_killed": measure(a.ranks, a.requests, a.tokens, kill=True, spares=a.spares)}
    if a.json:
        print(json.dumps(res))
        return
    b, k = res["baseline"], res["rank_killed"]
    print(f"rank death with {a.ranks} ranks, {a.spares} hot spare(s), {a.requests} streams x {a.tokens} tokens "
          f"(sim backend):")
    print(f"  detected after {k['detect_s']} s, requests resumed after {k['resumed_s']} s, "
          f"group re-formed after {k['reformed_s']} s")
    print(f"  completed exactly: {k['completed_exact']}/{a.requests} (baseline {b['completed_exact']}/{a.requests})")
    print(f"  longest stall a client saw: {k['stall_max_ms']} ms (baseline {b['stall_max_ms']} ms); "
          f"streams stalled > 0.5 s: {k['stalled_streams']}")
    print(f"  TTFT p50 {k['ttft_p50_ms']} ms (baseline {b['ttft_p50_ms']}), throughput {k['throughput_tok_s']} tok/s "
          f"(baseline {b['throughput_tok_s']})")


if __name__ == "__main__":
    main()
