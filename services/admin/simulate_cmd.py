"""``lockstep simulate``: run the discrete-event simulator (services/simulator) on one
trace under several policies and print the measures (table, JSON, plot).

Wire it with ``register(app)``; ``python -m services.simulator`` runs the same command.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from services.admin.cmd_common import console as out_console, given as given_options

DEFAULT_RATE_PER_RANK = 3.0   # requests/s per rank when --rate is not given


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")   # (matplotlib writes these by suffix)


def parse_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """``POLICY.KEY=VALUE`` -> {POLICY: {KEY: VALUE}}; values parsed as JSON when they can be."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        try:
            lhs, value = item.split("=", 1)
            policy, key = lhs.split(".", 1)
        except ValueError:
            raise typer.BadParameter(f"--param {item!r}: expected POLICY.KEY=VALUE") from None
        try:
            v: Any = json.loads(value)
        except json.JSONDecodeError:
            # nan / inf as numbers (refused where a policy takes a finite one), else the string
            v = float(value) if value.strip().lower() in ("nan", "inf", "-inf", "+inf") else value
        out.setdefault(policy.strip(), {})[key.strip()] = v
    return out


def simulate(
    ctx: typer.Context,
    ranks: int = typer.Option(8, "--ranks", min=1, help="DP ranks in the engine group."),
    api_servers: int = typer.Option(1, "--api-servers", min=1, help="api-server replicas."),
    workload: str = typer.Option("bursty", "--workload", help="poisson | bursty | onoff | heavy-tail | ramp | fixed | offline | blog; fixed:IN:OUT sets fixed's prompt and output tokens (default 1024:128)."),
    requests: int = typer.Option(10000, "--requests", min=1, help="Requests to generate."),
    rate: Optional[float] = typer.Option(None, "--rate", help=f"Mean requests/s (default {DEFAULT_RATE_PER_RANK:g} x ranks)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the trace and the modeled latencies."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="JSONL trace: {t, prompt_tokens, output_tokens[, max_tokens, api_server]} per line (numbers; token counts whole; other keys are ignored, but a near-miss of these is refused as a typo)."),
    policies: str = typer.Option("all", "--policies", help="Comma list of policies, or 'all'."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: per-rank load, balance, TTFT CDFs."),
    cost_model: Optional[Path] = typer.Option(None, "--cost-model", help="JSON cost-model constants (CostModel.load), in place of the profile's."),
    param: list[str] = typer.Option([], "--param", help="Policy constructor argument, POLICY.KEY=VALUE (repeatable)."),
    profile: str = typer.Option("default", "--profile", help="Engine limits + step-time model: a bundled name (default, deepseek-v3-gb200, small-cpu) or a JSON file."),
    dispatch: Optional[str] = typer.Option(None, "--dispatch", help="Deployment for every system: 'scheduler' (one dispatcher, fresh view) or 'client' (every api-server decides). Default: each system's own."),
    view_interval_ms: float = typer.Option(100.0, "--view-interval-ms", min=0.0, help="With --dispatch client: how often the api-servers' load view is published."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Comma list of load fractions of the group's capacity (e.g. 0.3,0.5,0.8,1.0,1.2,1.5): one run each; --rate is ignored."),
) -> None:
    """Simulate lockstep's policies and the peers' baselines on one trace."""
    from services.simulator.runner import run

    if dispatch not in (None, "scheduler", "client"):
        typer.echo("error: --dispatch is 'scheduler' or 'client'", err=True)
        raise typer.Exit(2)
    # Options another one makes moot are refused, not silently ignored.
    given = given_options(ctx, "workload", "requests", "rate", "view_interval_ms")
    refusal = None
    if "view_interval_ms" in given and dispatch != "client":
        refusal = ("--view-interval-ms is the client-dispatch view's period; without --dispatch client every "
                   "system keeps its own (add --dispatch client, or drop --view-interval-ms)")
    elif trace is not None and given & {"workload", "requests", "rate"}:
        opts = ", ".join("--" + n for n in sorted(given & {"workload", "requests", "rate"}))
        refusal = f"--trace replays its own requests at its own times; {opts} shape a generated workload: drop them, or drop --trace"
    elif "rate" in given and sweep is not None:
        refusal = "--sweep sets the rate at each load (a fraction of the measured capacity); drop --rate"
    elif "rate" in given and workload in ("offline", "blog"):
        refusal = f"--workload {workload} sends every request at once: it has no rate for --rate to set; drop --rate"
    elif not policies.replace(",", "").strip():
        refusal = "--policies names none; give a comma list of policies, or 'all'"
    elif plot is not None and not plot.parent.is_dir():
        refusal = f"--plot {plot}: no directory {plot.parent} to write it in (it is written after the run)"
    elif plot is not None and plot.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        refusal = (f"--plot {plot}: write a picture, named .png (or {', '.join('.' + f for f in PLOT_FORMATS[1:])}); "
                   "it is written after the run")
    if refusal:
        typer.echo(f"error: {refusal}", err=True)
        raise typer.Exit(2)
    if sweep is not None:
        if trace is not None:
            typer.echo("error: --sweep generates --workload at each load; it cannot replay a --trace "
                       "(drop --sweep to run the trace as recorded)", err=True)
            raise typer.Exit(2)
        _sweep(sweep, as_json, plot, ranks=ranks, api_servers=api_servers, workload=workload,
               requests=requests, seed=seed, policies=policies, params=parse_params(param),
               profile=profile, dispatch=dispatch, view_interval_ms=view_interval_ms, cost_model=cost_model)
        return
    try:
        doc, results = run(ranks=ranks, api_servers=api_servers, workload=workload, requests=requests,
                           rate=rate if rate is not None else DEFAULT_RATE_PER_RANK * ranks, seed=seed,
                           trace=trace, policies=policies, cost_model=cost_model,
                           params=parse_params(param), progress=sys.stderr.isatty(),
                           profile=profile, dispatch=dispatch, view_interval_ms=view_interval_ms)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    clipped = doc["config"]["trace"].get("clipped_requests")
    if clipped:
        typer.echo(f"warning: {clipped} of {doc['config']['trace']['requests']} requests do not "
                   f"fit the profile's max_model_len ({doc['config']['sim']['engine']['max_model_len']}): their "
                   "lengths were cut to fit (the live api-servers refuse such requests)", err=True)
    if plot is not None:
        from services.simulator.plot import plot_results
        plot_results(results, doc, plot)
    if as_json:
        typer.echo(json.dumps(doc, sort_keys=False))
        return
    from services.simulator.report import rich_table
    c = doc["config"]
    con = out_console()
    con.print(rich_table(doc, title=(f"{c['ranks']} ranks x {c['api_servers']} api-servers, "
                                           f"{c['trace']['name']} {c['trace']['requests']} requests")))
    if "ideal" in doc:
        con.print(f"ideal (perfectly balanced steps): {doc['ideal']['throughput_tok_s']:,.0f} tok/s")
    rejected = {n: p["rejected"] for n, p in doc["policies"].items() if p.get("rejected")}
    if rejected:
        con.print("rejected (no rank can run them; not in 'done'): "
                  + ", ".join(f"{n} {k}" for n, k in rejected.items()))
    con.print("simulated in " + ", ".join(f"{r.name} {r.wall_s:.1f}s" for r in results))
    if plot is not None:
        con.print(f"plot: {plot}")


def _sweep(fractions: str, as_json: bool, plot: Optional[Path], **kw: Any) -> None:
    from services.simulator.sweep import load_sweep, sweep_table
    try:
        try:
            fr = [float(x) for x in fractions.split(",") if x.strip()]
        except ValueError:
            fr = []
        if not fr or any(not (0 < f < math.inf) for f in fr):   # (NaN compares false)
            raise ValueError(f"--sweep {fractions!r}: give positive, finite load fractions, e.g. 0.5,1.0,1.5")
        doc = load_sweep(fr, progress=sys.stderr.isatty(), **kw)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if plot is not None:
        from services.simulator.plot import plot_sweep
        plot_sweep(doc, plot)
    if as_json:
        typer.echo(json.dumps(doc, sort_keys=False))
        return
    con = out_console()
    con.print(sweep_table(doc))
    if plot is not None:
        con.print(f"plot: {plot}")


def register(app: typer.Typer) -> None:
    """Add the ``simulate`` command to ``app``."""
    app.command("simulate")(simulate)
