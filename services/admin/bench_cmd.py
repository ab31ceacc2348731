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
  is 1. So is a run where a request failed (``"failed"``), other than one refused with a
  429 by admission control (``"rejected"``, counted among the failed: a cluster above
  capacity doing as designed). Redis lost mid-run keeps the client-side figures (balance
  null, an ``"error"``, exit 1); Ctrl-C reports the requests that finished
  (``"interrupted": true``, ``"not_finished"``) and exits 130.

The trace is the simulator's (services/simulator/workload.py): ``--workload
poisson|bursty|onoff|heavy-tail|ramp|offline`` generated from ``--requests/--rate/--seed``, or ``--trace FILE``
(JSONL: ``{"t", "prompt_tokens", "output_tokens"[, "api_server"]}``). ``--load F`` runs a
generated workload at ``F`` x the cluster's capacity: the requests/s it completes when the
same requests all arrive at once (a probe run first; ``--capacity`` gives it instead, so
several clusters get the same trace), the live counterpart of the simulator's sweeps. A request is a prompt
of ``prompt_tokens`` bytes (the tokenizer is byte-level, so exactly that many tokens) with
``max_tokens = output_tokens`` and ``ignore_eos``, so every request costs what the trace
says. ``api_server`` is recorded but not used: every replica shares one port.

The jobs live beside it: bench_trace.py (the requests), bench_client.py (HTTP),
stats_follower.py (step stats), bench_measures.py, bench_run.py (one run), bench_render.py.
Wire it with ``register(app)``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from redis.exceptions import RedisError

from services.admin.bench_render import render
from services.admin.bench_run import run_bench
from services.admin.cmd_common import console as out_console, given as given_options

OFFLINE = ("offline", "blog")   # generated all at once: the rate does not apply
DEFAULT_REQUESTS = 100
DEFAULT_RATE = 8.0            # requests/s
PROBE_MIN_REQUESTS = 500      # below this an all-at-once probe's tail dominates (the load probe: 200 read 13.9/s, 1,300 read 20.6/s)


def bench(
    ctx: typer.Context,
    url: Optional[str] = typer.Option(None, "--url", help="API base URL (default: the local cluster's)."),
    redis_url: Optional[str] = typer.Option(None, "--redis-url",
                                            help="Redis URL for the step stats (default: LOCKSTEP_REDIS_URL, else the local cluster's)."),
    namespace: str = typer.Option("ls", "--namespace", "-n", envvar="LOCKSTEP_NAMESPACE", help="Key prefix of the cluster."),
    workload: str = typer.Option("poisson", "--workload", help="poisson | bursty | onoff | heavy-tail | ramp | fixed | offline | blog (the simulator's workloads); fixed:IN:OUT sets fixed's prompt and output tokens (default 1024:128)."),
    requests: int = typer.Option(DEFAULT_REQUESTS, "--requests", min=1, help="Requests to generate."),
    rate: float = typer.Option(DEFAULT_RATE, "--rate", help="Mean requests/s of the generated workload (> 0)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated workload."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="JSONL trace: {t, prompt_tokens, output_tokens[, api_server]} per line."),
    load: Optional[float] = typer.Option(None, "--load", min=0.01,
                                         help="Run at this fraction of the cluster's capacity (sets --rate): "
                                              "capacity = requests/s completed when the same requests "
                                              "all arrive at once (measured first, unless --capacity)."),
    capacity: Optional[float] = typer.Option(None, "--capacity", min=0.0,
                                             help="With --load: the capacity in requests/s, not measured "
                                                  "(give several clusters the same trace)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", show_envvar=False,
                                          help="API key, for a cluster started with LOCKSTEP_API_KEYS (default: "
                                               "OPENAI_API_KEY, else the first of LOCKSTEP_API_KEYS)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Benchmark a running cluster: TTFT/ITL/throughput from the client, balance and idle forwards from the step stats."""
    from services.admin import local_state

    def fail(msg: str, code: int = 2) -> None:
        typer.secho(f"lockstep bench: {msg}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code)

    from services.simulator.workload import check_kind
    try:
        check_kind(workload)
    except ValueError as exc:
        fail(f"--workload: {exc}")
    if trace is None and not 0 < rate < float("inf"):   # (NaN compares false)
        fail(f"--rate must be a finite number > 0, not {rate:g}")
    # Options another one makes moot are refused, not silently ignored.
    given = given_options(ctx, "workload", "requests", "rate")
    if trace is not None and given:
        fail(f"--trace replays its own requests at its own times; {', '.join('--' + n for n in sorted(given))} "
             "shape a generated workload: drop them, or drop --trace")
    if load is not None and "rate" in given:
        fail("--load sets the rate (a fraction of the capacity); drop --rate, or drop --load to give the rate")
    if trace is None and workload in OFFLINE and (load is not None or "rate" in given):
        fail(f"--workload {workload} sends every request at once: it has no rate for "
             f"{'--load' if load is not None else '--rate'} to set; use a timed workload "
             "(poisson, bursty, onoff, heavy-tail, ramp)")
    if capacity is not None and capacity <= 0:
        fail("--capacity must be > 0 requests/s")
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
    # the cluster's own key where this shell started it (LOCKSTEP_API_KEYS): bench just works
    key = api_key or next((k.strip() for k in os.environ.get("LOCKSTEP_API_KEYS", "").split(",") if k.strip()), None)
    try:
        probe = None
        if load is not None:
            if capacity is None:
                if requests < PROBE_MIN_REQUESTS:
                    typer.secho(f"lockstep bench: warning: a capacity probe of {requests} requests reads low (the "
                                "last requests' decode, with the ranks half idle, is much of its time): --load "
                                f"{load:g} then runs below {load:g}x; use --requests {PROBE_MIN_REQUESTS} or more, "
                                "or give --capacity", err=True)
                probe = asyncio.run(run_bench(url, rurl, namespace, workload, requests, rate, seed, None,
                                              at_once=True, api_key=key))
                if probe.get("interrupted"):
                    fail(f"interrupted during the capacity probe ({probe['completed']} of {probe['requests']} "
                         "requests finished); nothing measured", 130)
                if not probe["completed"] or not probe["duration_s"]:
                    fail("the capacity probe completed no request: is the cluster serving?", 1)
                capacity = probe["completed"] / probe["duration_s"]
                if not as_json:
                    typer.echo(f"capacity: {capacity:.2f} requests/s ({probe['completed']} requests all at once "
                               f"in {probe['duration_s']:.1f} s); running at {load:g}x = {load * capacity:.2f}/s",
                               err=True)
            rate = load * capacity
        doc = asyncio.run(run_bench(url, rurl, namespace, workload, requests, rate, seed, trace, api_key=key))
        if load is not None:
            doc.update(load=load, rate=rate, capacity_rps=capacity,
                       capacity_measured=probe is not None,
                       capacity_probe={k: probe[k] for k in ("requests", "completed", "duration_s",
                                                              "throughput_tok_s")} if probe else None)
    except KeyboardInterrupt:      # a second Ctrl-C, or one between the probe and the run
        fail("interrupted", 130)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    except RedisError as exc:   # the step stats are read there: a clear error, not a traceback
        from shared.bus import redact_url
        fail(f"cannot read the step stats from Redis at {redact_url(rurl or '')}: {exc.__class__.__name__}: {exc} "
             "(fix --redis-url / LOCKSTEP_REDIS_URL, or drop it for client-side measures only)")
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        out_console().print(render(doc))
    if doc.get("clipped_requests"):
        typer.secho(f"lockstep bench: warning: {doc['clipped_requests']} of {doc['requests']} requests do not fit "
                    f"the served model's max_model_len ({doc['max_model_len']}): their prompt and output lengths "
                    "were cut to fit, so the run is not the shape asked for", err=True)
    for e in doc.get("errors", ()):   # stderr: the JSON on stdout stays one document
        typer.echo(f"error: {e}", err=True)
    if doc.get("error"):
        typer.secho(f"lockstep bench: {doc['error']}", fg=typer.colors.RED, err=True)
    errors = doc["failed"] - doc.get("rejected", 0)
    if errors:
        typer.secho(f"lockstep bench: {errors} of {doc['requests']} requests failed (errors above); "
                    "the api-servers' and ranks' logs say why", fg=typer.colors.RED, err=True)
    elif doc.get("rejected"):
        typer.echo(f"lockstep bench: {doc['rejected']} of {doc['requests']} requests were refused with 429 "
                   "(admission control: the cluster was above capacity)", err=True)
    if doc.get("interrupted"):
        typer.secho(f"lockstep bench: interrupted: the figures are those of the {doc['completed']} requests that "
                    f"finished ({doc['not_finished']} of {doc['requests']} did not)", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130)
    if doc["completed"] == 0 or doc.get("error") or errors:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to ``app``."""
    app.command("bench")(bench)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(typer.run(bench))
