"""One ``lockstep bench`` run: send the trace over HTTP while following the step stats, then
put the client-side and engine-side measures in one document."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any, Optional

from services.admin.bench_client import WARM_CONNECTIONS, Interrupted, base_url, drive, served_model
from services.admin.bench_measures import engine_report
from services.admin.bench_trace import build_trace
from services.admin.stats_follower import StatsFollower

STATS_SETTLE_S = 0.5          # after the last completion: let the last step reports land
REQUEST_TIMEOUT_S = 600.0


async def run_bench(url: str, redis_url: str | None, namespace: str, workload: str, requests: int,
                    rate: float, seed: int, trace: Optional[Path], progress: bool = True,
                    at_once: bool = False, api_key: str | None = None) -> dict[str, Any]:
    import httpx
    from redis.exceptions import RedisError

    from shared import keys as K
    from shared.bus import connect
    from shared.measures import percentiles, throughput

    base = base_url(url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=WARM_CONNECTIONS)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        try:
            model, max_model_len = await served_model(client, base)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 401:
                raise PermissionError(f"the lockstep API at {base} needs an API key"
                                      f"{' (the one given was refused)' if api_key else ''}: pass --api-key KEY, "
                                      "or set OPENAI_API_KEY (one of the cluster's LOCKSTEP_API_KEYS)") from None
            raise ConnectionError(f"cannot reach the lockstep API at {base}: {exc}") from None
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ConnectionError(f"cannot reach the lockstep API at {base}: {exc}") from None
        name, items, clipped = build_trace(workload, requests, rate, seed, trace, max_model_len)
        if at_once:   # the capacity probe: the same requests, all at t=0
            name = f"{name} (all at once)"
            for it in items:
                it.t = 0.0
        # Open the connections a burst will need before the clock starts, so the first
        # requests of the trace do not pay TCP set-up (and a cold replica's first request).
        await asyncio.gather(*(client.get(base + "/models") for _ in range(min(len(items), WARM_CONNECTIONS))),
                             return_exceptions=True)
        keys = K.Keys(namespace)
        r = connect(redis_url) if redis_url else None
        follower = StatsFollower(r, keys.stats) if r is not None else None
        num_ranks = 0
        interrupted = False
        follow_task: asyncio.Task | None = None
        try:
            if r is not None:
                num_ranks = int((await r.hget(keys.cluster, "ranks")) or 0)
                await follower.start_id()
                follow_task = asyncio.create_task(follower.run())
            try:
                results = await drive(client, base, model, items, progress)
            except Interrupted as stopped:
                results, interrupted = stopped.results, True
            t_end_wall = time.time()
            if follow_task is not None:
                if not interrupted:
                    await asyncio.sleep(STATS_SETTLE_S)
                follower.stop()
                await follow_task
            per_rank_req: dict[str, int] = {}
            if r is not None and follower.error is None:
                ids = [x.id for x in results if x.ok and x.id]
                pipe = r.pipeline(transaction=False)
                for rid in ids:
                    pipe.hget(keys.req(rid), "rank")
                try:
                    got = await pipe.execute()
                except (RedisError, OSError) as exc:
                    follower.error, got = exc, []
                for v in got:
                    if v is not None:
                        per_rank_req[v.decode()] = per_rank_req.get(v.decode(), 0) + 1
        finally:
            if follow_task is not None and not follow_task.done():
                follow_task.cancel()
                await asyncio.gather(follow_task, return_exceptions=True)
            if r is not None:
                await r.aclose()

    ok = [x for x in results if x.ok]
    failed = [x for x in results if not x.ok]
    t_first = min((x.sent_wall for x in results), default=0.0)
    out: dict[str, Any] = {"url": base, "namespace": namespace, "model": model, "trace": name,
                           "requests": len(items), "completed": len(ok), "failed": len(failed),
                           # of the failed, refused by admission control (429 "retry later"): not errors
                           "rejected": sum(1 for x in failed if x.status == 429),
                           # cut to fit the served model's max_model_len (said on stderr)
                           "clipped_requests": clipped, "max_model_len": max_model_len}
    if failed:
        out["errors"] = sorted({x.error for x in failed})[:5]
    start = min((x.sent for x in results), default=0.0)
    end = max((x.done for x in ok), default=start)
    out["duration_s"] = end - start
    out["output_tokens"] = sum(x.tokens for x in ok)
    out["throughput_tok_s"] = throughput(out["output_tokens"], start, end)
    gaps = [g for x in ok for g in x.gaps]
    for label, vals in (("ttft", [x.ttft for x in ok if x.ttft is not None]),
                        ("itl", gaps), ("e2e", [x.e2e for x in ok if x.e2e is not None])):
        for k, v in percentiles(vals).items():
            out[f"{label}_{k}_ms"] = None if math.isnan(v) else v * 1000.0
        out[f"{label}_max_ms"] = max(vals) * 1000.0 if vals else None
    out["ttft_ms"] = [None if x.ttft is None else round(x.ttft * 1000.0, 3) for x in results]
    if interrupted:
        out["interrupted"] = True      # Ctrl-C: the figures are those of the requests that finished
        out["not_finished"] = len(items) - len(results)
    if follower is not None and follower.error is None:
        sm = engine_report(follower.rows, num_ranks, t_first - 1.0, t_end_wall + STATS_SETTLE_S,
                           namespace, redis_url)
        out.update(sm)
        out["per_rank_requests"] = {str(k): per_rank_req.get(str(k), 0) for k in range(sm["ranks"])}
    else:
        out["balance_ratio"] = out["idle_forward_fraction"] = None
        if follower is not None:
            from shared.bus import redact_url
            out["error"] = (f"the cluster's Redis ({redact_url(redis_url or '')}) went away mid-run "
                            f"({follower.error.__class__.__name__}: {follower.error}): the step stats stop there, "
                            "so balance and idle forwards are null; the client-side figures stand")
    return out
