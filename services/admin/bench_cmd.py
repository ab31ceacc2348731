"""``lockstep bench``: drive a running cluster over HTTP and report the measures of
DESIGN §6 for that run.

* Client side (streaming ``/v1/completions``, one request per trace line, sent at its
  arrival time): TTFT, ITL (gap between consecutive content chunks), end-to-end latency,
  throughput (output tokens / (last completion - first send)).
* Engine side, from the step stats the ranks write to ``<ns>:stats`` during the run
  window: balance ratio and idle-forward fraction (shared/measures.py, the same
  definitions the simulator uses), per-rank scheduled tokens, the step where each rank
  first ran a prefill, and step durations. Per-rank request counts come from the
  ``<ns>:req:<id>`` hashes. No step stats in the window (a wrong ``--namespace`` or
  Redis URL) is an error, not a perfect run: balance and idle fraction are null, the
  JSON document carries ``"error"``, a warning names what to check, and the exit status
  is 1.

The trace is the simulator's (services/simulator/workload.py): ``--workload
poisson|bursty|onoff|heavy-tail|ramp|offline`` generated from ``--requests/--rate/--seed``, or ``--trace FILE``
(JSONL: ``{"t", "prompt_tokens", "output_tokens"[, "api_server"]}``). ``--load F`` runs a
generated workload at ``F`` x the cluster's capacity: the requests/s it completes when the
same requests all arrive at once (a probe run first; ``--capacity`` gives it instead, so
several clusters get the same trace), the live counterpart of the simulator's sweeps. A request is a prompt
of ``prompt_tokens`` bytes (the tokenizer is byte-level, so exactly that many tokens) with
``max_tokens = output_tokens`` and ``ignore_eos``, so every request costs what the trace
says. ``api_server`` is recorded but not used: every replica shares one port.

Wire it with ``register(app)``.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer

DEFAULT_REQUESTS = 100
DEFAULT_RATE = 8.0            # requests/s
STATS_SETTLE_S = 0.5          # after the last completion: let the last step reports land
REQUEST_TIMEOUT_S = 600.0
WARM_CONNECTIONS = 64        # connections opened (GET /v1/models) before the run starts


# ---------------------------------------------------------------------- trace
@dataclass(slots=True)
class Item:
    t: float
    prompt_tokens: int
    output_tokens: int
    api: int = -1


def build_trace(workload: str, requests: int, rate: float, seed: int, trace: Optional[Path],
                max_model_len: int = 4096) -> tuple[str, list[Item]]:
    """The requests to send: from ``trace`` when given, else generated."""
    from services.simulator.workload import generate, load_jsonl

    tr = (load_jsonl(trace, seed=seed, max_model_len=max_model_len) if trace is not None
          else generate(workload, requests, rate, seed, max_model_len=max_model_len))
    items = [Item(float(tr.t[i]), int(tr.prompt[i]), int(tr.output[i]), int(tr.api[i])) for i in range(len(tr))]
    t0 = items[0].t if items else 0.0
    for it in items:
        it.t -= t0
    return tr.name, items


def prompt_text(n: int, i: int) -> str:
    """``n`` ASCII bytes (= ``n`` tokens), different per request."""
    head = f"req {i}: "
    body = (head + "lockstep balances data-parallel ranks. ") * (n // 40 + 2)
    return body[:n]


# ---------------------------------------------------------------------- one request
@dataclass(slots=True)
class Result:
    i: int
    ok: bool = False
    id: str = ""
    sent: float = 0.0           # perf_counter at send
    sent_wall: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    done: float = 0.0           # perf_counter at the last byte
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


async def _one(client: Any, base: str, model: str, it: Item, i: int) -> Result:
    res = Result(i)
    body = {"model": model, "prompt": prompt_text(it.prompt_tokens, i), "max_tokens": it.output_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    res.sent, res.sent_wall = time.perf_counter(), time.time()
    last = 0.0
    try:
        async with client.stream("POST", base + "/completions", json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                res.error = f"HTTP {resp.status_code}: {raw[:200].decode(errors='replace')}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                doc = json.loads(data)
                if "error" in doc:
                    res.error = str(doc["error"].get("message", doc["error"]))
                    return res
                res.id = res.id or doc.get("id", "")
                if doc.get("usage"):
                    res.tokens = int(doc["usage"].get("completion_tokens", 0))
                choices = doc.get("choices") or ()
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.sent
                    else:
                        res.gaps.append(now - last)
                    last = now
        res.done = time.perf_counter()
        res.e2e = res.done - res.sent
        res.ok = True
    except Exception as exc:  # noqa: BLE001 - one failed request is a figure, not a crash
        res.error = f"{exc.__class__.__name__}: {exc}"
    return res


# ---------------------------------------------------------------------- step stats
class StatsFollower:
    """Follows ``<ns>:stats`` from the run's start, so trimming cannot lose entries."""

    def __init__(self, r: Any, stream: str) -> None:
        self.r, self.stream = r, stream
        self.rows: list[dict[str, Any]] = []
        self.last: bytes | str = "0-0"
        self._stop = asyncio.Event()

    async def start_id(self) -> None:
        tail = await self.r.xrevrange(self.stream, count=1)
        self.last = tail[0][0] if tail else "0-0"

    async def run(self) -> None:
        from shared.messages import loads
        while True:
            resp = await self.r.xread({self.stream: self.last}, block=200, count=10_000)
            got = 0
            for _, entries in resp or ():
                for eid, fields in entries:
                    self.last = eid
                    got += 1
                    raw = fields.get(b"d")
                    if raw is None:
                        continue
                    try:
                        self.rows.append(loads(raw))
                    except ValueError:
                        continue
            if not got and self._stop.is_set():
                return

    def stop(self) -> None:
        self._stop.set()


def step_measures(rows: list[dict[str, Any]], num_ranks: int, t_from: float, t_to: float) -> dict[str, Any]:
    """Balance ratio, idle-forward fraction and step facts from RankStats dicts."""
    from shared.measures import balance_ratio, idle_forward_fraction, percentile

    steps: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for d in rows:
        t = float(d.get("t", 0.0))
        if t < t_from or t > t_to:
            continue
        steps.setdefault((int(d["wave"]), int(d["step"])), {})[int(d["rank"])] = d
    n = max([num_ranks, *(r + 1 for s in steps.values() for r in s)]) if steps else num_ranks
    keys = sorted(steps)
    sched = [[int(steps[k].get(r, {}).get("scheduled", 0)) for r in range(n)] for k in keys]
    idle = [[bool(steps[k].get(r, {}).get("idle", False)) for r in range(n)] for k in keys]
    per_rank_tokens = [sum(row[r] for row in sched) for r in range(n)]
    first_prefill: dict[str, list[int] | None] = {str(r): None for r in range(n)}
    for k in keys:
        for r, d in steps[k].items():
            if int(d.get("prefill", 0)) > 0 and first_prefill.get(str(r)) is None:
                first_prefill[str(r)] = [k[0], k[1]]
    work = [k for k, row in zip(keys, sched) if max(row, default=0) > 0]
    durs = [max(float(d.get("dur_ms", 0.0)) for d in steps[k].values()) for k in work]
    # step period: wall time between consecutive steps of one wave (forward + collective + Redis)
    ends = {k: max(float(d.get("t", 0.0)) for d in steps[k].values()) for k in keys}
    periods = [(ends[b] - ends[a]) * 1000 for a, b in zip(keys, keys[1:])
               if a[0] == b[0] and b[1] == a[1] + 1 and b in work]
    idle_rank_steps = sum(1 for row_s, row_i in zip(sched, idle) if max(row_s, default=0) > 0
                          for s, i in zip(row_s, row_i) if i and s <= 0)
    return {
        # None (null) without a step with work: no data is not a perfect figure
        "balance_ratio": balance_ratio(sched),
        "idle_forward_fraction": idle_forward_fraction(sched, idle),
        "steps": len(keys), "work_steps": len(work), "idle_forwards": idle_rank_steps,
        "ranks": n,
        "per_rank_scheduled_tokens": {str(r): per_rank_tokens[r] for r in range(n)},
        "first_prefill_step": first_prefill,
        "step_ms_p50": percentile(durs, 50) if durs else None,
        "step_ms_max": max(durs) if durs else None,
        "step_period_ms_p50": percentile(periods, 50) if periods else None,
        "step_period_ms_max": max(periods) if periods else None,
    }


def no_stats_message(namespace: str, redis_url: str | None, rows_read: int) -> str:
    """What to tell the user when the run window held no step stats, and what to check."""
    from shared import keys as K
    from shared.bus import redact_url

    stream = K.Keys(namespace).stats
    where = f"{stream} at {redact_url(redis_url)}" if redis_url else stream
    seen = (f"{rows_read} step stats were read, none inside the run window (are the clocks of "
            f"this host and the engines in step?). " if rows_read else "")
    return (f"read no step stats from {where} during the run, so balance ratio and idle-forward "
            f"fraction are null (no data, not a perfect run). {seen}Check that the namespace is the "
            f"cluster's (--namespace / LOCKSTEP_NAMESPACE; this run used {namespace!r}) and that the "
            f"cluster runs with the same Redis URL (--redis-url / LOCKSTEP_REDIS_URL).")


def engine_report(rows: list[dict[str, Any]], num_ranks: int, t_from: float, t_to: float,
                  namespace: str, redis_url: str | None) -> dict[str, Any]:
    """The engine-side part of the report: :func:`step_measures` of the run window, plus
    ``"error"`` (see :func:`no_stats_message`) when the window held no step stats."""
    sm = step_measures(rows, num_ranks, t_from, t_to)
    if sm["steps"] == 0:
        sm["error"] = no_stats_message(namespace, redis_url, len(rows))
    return sm


# ---------------------------------------------------------------------- the run
def _base_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def _model(client: Any, base: str) -> tuple[str, int]:
    resp = await client.get(base + "/models")
    resp.raise_for_status()
    m = resp.json()["data"][0]
    return m["id"], int(m.get("max_model_len") or 4096)


async def run_bench(url: str, redis_url: str | None, namespace: str, workload: str, requests: int,
                    rate: float, seed: int, trace: Optional[Path], progress: bool = True,
                    at_once: bool = False) -> dict[str, Any]:
    import httpx

    from shared import keys as K
    from shared.bus import connect
    from shared.measures import percentiles, throughput

    base = _base_url(url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=WARM_CONNECTIONS)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        try:
            model, max_model_len = await _model(client, base)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ConnectionError(f"cannot reach the lockstep API at {base}: {exc}") from None
        name, items = build_trace(workload, requests, rate, seed, trace, max_model_len)
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
        try:
            if r is not None:
                num_ranks = int((await r.hget(keys.cluster, "ranks")) or 0)
                await follower.start_id()
            follow_task = asyncio.create_task(follower.run()) if follower else None
            results = await _drive(client, base, model, items, progress)
            t_end_wall = time.time()
            if follower is not None:
                await asyncio.sleep(STATS_SETTLE_S)
                follower.stop()
                await follow_task
            per_rank_req: dict[str, int] = {}
            if r is not None:
                ids = [x.id for x in results if x.ok and x.id]
                pipe = r.pipeline(transaction=False)
                for rid in ids:
                    pipe.hget(keys.req(rid), "rank")
                for v in await pipe.execute():
                    if v is not None:
                        per_rank_req[v.decode()] = per_rank_req.get(v.decode(), 0) + 1
        finally:
            if r is not None:
                await r.aclose()

    ok = [x for x in results if x.ok]
    failed = [x for x in results if not x.ok]
    t_first = min((x.sent_wall for x in results), default=0.0)
    out: dict[str, Any] = {"url": base, "namespace": namespace, "model": model, "trace": name,
                           "requests": len(items), "completed": len(ok), "failed": len(failed)}
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
    if follower is not None:
        sm = engine_report(follower.rows, num_ranks, t_first - 1.0, t_end_wall + STATS_SETTLE_S,
                           namespace, redis_url)
        out.update(sm)
        out["per_rank_requests"] = {str(k): per_rank_req.get(str(k), 0) for k in range(sm["ranks"])}
    else:
        out["balance_ratio"] = out["idle_forward_fraction"] = None
    return out


async def _drive(client: Any, base: str, model: str, items: list[Item], progress: bool) -> list[Result]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, disable=not (progress and console.is_terminal),
                   transient=False)
    with bar:
        sent_t = bar.add_task("sent", total=len(items))
        done_t = bar.add_task("done", total=len(items))
        tasks: list[asyncio.Task] = []

        async def one(it: Item, i: int) -> Result:
            res = await _one(client, base, model, it, i)
            bar.advance(done_t)
            return res

        t0 = time.perf_counter()
        for i, it in enumerate(items):
            delay = t0 + it.t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(it, i)))
            bar.advance(sent_t)
        return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------------- CLI
def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def bench(
    url: Optional[str] = typer.Option(None, "--url", help="API base URL (default: the local cluster's)."),
    redis_url: Optional[str] = typer.Option(None, "--redis-url",
                                            help="Redis URL for the step stats (default: LOCKSTEP_REDIS_URL, else the local cluster's)."),
    namespace: str = typer.Option("ls", "--namespace", "-n", envvar="LOCKSTEP_NAMESPACE", help="Key prefix of the cluster."),
    workload: str = typer.Option("poisson", "--workload", help="poisson | bursty | onoff | heavy-tail | ramp | offline (the simulator's workloads)."),
    requests: int = typer.Option(DEFAULT_REQUESTS, "--requests", min=1, help="Requests to generate."),
    rate: float = typer.Option(DEFAULT_RATE, "--rate", min=0.0, help="Mean requests/s of the generated workload."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated workload."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="JSONL trace: {t, prompt_tokens, output_tokens[, api_server]} per line."),
    load: Optional[float] = typer.Option(None, "--load", min=0.01,
                                         help="Run at this fraction of the cluster's capacity (sets --rate): "
                                              "capacity = requests/s completed when the same requests "
                                              "all arrive at once (measured first, unless --capacity)."),
    capacity: Optional[float] = typer.Option(None, "--capacity", min=0.0,
                                             help="With --load: the capacity in requests/s, not measured "
                                                  "(give several clusters the same trace)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Benchmark a running cluster: TTFT/ITL/throughput from the client, balance and idle forwards from the step stats."""
    from services.admin import local_state

    def fail(msg: str, code: int = 2) -> None:
        typer.secho(f"lockstep bench: {msg}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code)

    from services.simulator.workload import WORKLOADS
    if workload not in WORKLOADS:
        fail(f"--workload must be one of {', '.join(WORKLOADS)}, not {workload!r}")
    if trace is None and rate <= 0:
        fail("--rate must be > 0")
    if url is None:
        state = local_state.read(namespace)
        if not state:
            fail(f"no running local cluster in namespace {namespace!r}; pass --url (and --redis-url)")
        url = state["api_url"]
    try:
        rurl: str | None = local_state.resolve_redis_url(redis_url, namespace)
    except local_state.NoCluster:
        rurl = None
        typer.secho("lockstep bench: no Redis URL; reporting client-side measures only", err=True)
    if load is not None and trace is not None:
        fail("--load scales a generated workload's rate; a --trace keeps its own arrival times")
    if capacity is not None and load is None:
        fail("--capacity only applies with --load")
    try:
        probe = None
        if load is not None:
            if capacity is None:
                probe = asyncio.run(run_bench(url, rurl, namespace, workload, requests, rate, seed, None,
                                              at_once=True))
                if not probe["completed"] or not probe["duration_s"]:
                    fail("the capacity probe completed no request: is the cluster serving?", 1)
                capacity = probe["completed"] / probe["duration_s"]
                if not as_json:
                    typer.echo(f"capacity: {capacity:.2f} requests/s ({probe['completed']} requests all at once "
                               f"in {probe['duration_s']:.1f} s); running at {load:g}x = {load * capacity:.2f}/s",
                               err=True)
            rate = load * capacity
        doc = asyncio.run(run_bench(url, rurl, namespace, workload, requests, rate, seed, trace))
        if load is not None:
            doc.update(load=load, rate=rate, capacity_rps=capacity,
                       capacity_measured=probe is not None,
                       capacity_probe={k: probe[k] for k in ("requests", "completed", "duration_s",
                                                              "throughput_tok_s")} if probe else None)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"lockstep bench: {doc['trace']}, {doc['requests']} requests at {doc['url']}",
                  title_justify="left")
        t.add_column("measure")
        t.add_column("value", justify="right")
        rows = [("completed / failed", f"{doc['completed']} / {doc['failed']}"),
                ("throughput (tok/s)", _fmt(doc["throughput_tok_s"])),
                ("TTFT p50 / p90 / p99 (ms)", " / ".join(_fmt(doc[f"ttft_p{p}_ms"]) for p in (50, 90, 99))),
                ("ITL p50 / p90 / p99 (ms)", " / ".join(_fmt(doc[f"itl_p{p}_ms"]) for p in (50, 90, 99))),
                ("e2e p50 / p99 (ms)", " / ".join(_fmt(doc[f"e2e_p{p}_ms"]) for p in (50, 99))),
                ("balance ratio", _fmt(doc["balance_ratio"], ".3f")),
                ("idle-forward fraction", _fmt(doc["idle_forward_fraction"], ".3f"))]
        if "per_rank_requests" in doc:
            rows.append(("requests per rank", " ".join(str(v) for v in doc["per_rank_requests"].values())))
            rows.append(("steps (with work)", f"{doc['steps']} ({doc['work_steps']})"))
        for k, v in rows:
            t.add_row(k, v)
        Console().print(t)
        for e in doc.get("errors", ()):
            typer.echo(f"error: {e}", err=True)
    if doc.get("error"):
        typer.secho(f"lockstep bench: {doc['error']}", fg=typer.colors.RED, err=True)
    if doc["completed"] == 0 or doc.get("error"):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to ``app``."""
    app.command("bench")(bench)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(typer.run(bench))
