"""Load sweeps: one workload at fractions of the group's capacity, every policy at each.

**Capacity** is measured, not assumed: the same workload (same length distributions, same
seed and count) arrives all at once and runs on the perfectly balanced ideal group (one
pooled rank with the capacity of all, services/simulator/sim.py ``run_ideal``); capacity =
requests completed / makespan, in requests/s. It is what the group could sustain with
perfect balance and no dispatch latency, so load 1.0 is the most any policy could keep up
with, and no real policy reaches ideal throughput above it.

At load ``f`` the workload runs at ``f x capacity`` requests/s. ``offline`` (and ``blog``)
have no rate: there ``f`` sizes the batch that arrives at t=0 to ``f x 20 s`` of capacity.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from services.simulator import profile as profile_mod
from services.simulator import runner, workload
from services.simulator.sim import SimConfig, run_ideal
from shared.cost_model import CostModel

OFFLINE_SECONDS = 20.0     # offline sweep: f x this many seconds of capacity arrive at t=0
OFFLINE_KINDS = ("offline", "blog")


def capacity(kind: str, requests: int, seed: int, ranks: int, api_servers: int,
             profile: str | None = None, cost_model: Path | str | None = None) -> float:
    """Requests/s the perfectly balanced group completes when saturated (see above)."""
    prof = profile_mod.load(profile)
    cost = CostModel.load(cost_model) if cost_model else prof.cost
    cfg = dataclasses.replace(SimConfig(), ranks=ranks, api_servers=api_servers, engine=prof.engine,
                              cost=cost, seed=seed)
    tr = workload.generate(kind, requests, 1.0, seed, api_servers, max_model_len=prof.engine.max_model_len)
    tr = dataclasses.replace(tr, t=np.zeros(len(tr)))
    ideal = run_ideal(tr, cfg)
    span = float(np.nanmax(ideal.finish_t))
    return len(tr) / span if span > 0 else float("nan")


def load_sweep(fractions: list[float], *, ranks: int, api_servers: int, workload: str, requests: int,
               seed: int, policies: str, params: dict[str, Any] | None = None, profile: str | None = None,
               dispatch: str | None = None, view_interval_ms: float = 100.0,
               cost_model: Path | str | None = None, progress: bool = False) -> dict[str, Any]:
    cap = capacity(workload, requests, seed, ranks, api_servers, profile, cost_model)
    points = []
    for f in fractions:
        kw: dict[str, Any] = dict(ranks=ranks, api_servers=api_servers, workload=workload, seed=seed,
                                  policies=policies, params=params, profile=profile, dispatch=dispatch,
                                  view_interval_ms=view_interval_ms, cost_model=cost_model,
                                  progress=progress)
        if workload in OFFLINE_KINDS:
            kw.update(requests=max(1, int(round(f * OFFLINE_SECONDS * cap))), rate=1.0)
        else:
            kw.update(requests=requests, rate=f * cap)
        doc, _ = runner.run(**kw)
        points.append({"load": f, "rate": kw["rate"] if workload not in OFFLINE_KINDS else None,
                       "requests": kw["requests"], "ideal": doc.get("ideal"), "policies": doc["policies"]})
    first = points[0] if points else {}
    return {"config": {"ranks": ranks, "api_servers": api_servers, "workload": workload, "seed": seed,
                       "requests": requests, "profile": profile_mod.load(profile).name,
                       "dispatch": dispatch or "each system's own", "view_interval_ms": view_interval_ms,
                       **({"cost_model": str(cost_model)} if cost_model else {})},
            "capacity": {"requests_per_s": cap,
                         "how": "requests / makespan of the same workload, all at t=0, on the perfectly "
                                "balanced ideal group (services/simulator/sweep.py)"},
            # (None when the default did not run: a reader must not look up a row that is absent)
            "default": runner.DEFAULT_SIM_POLICY if runner.DEFAULT_SIM_POLICY in first.get("policies", {}) else None,
            "policies": list(first.get("policies", {})),
            "points": points}


def sweep_table(doc: dict[str, Any], key: str = "throughput_tok_s"):
    """A rich table: one row per policy, per load point 'tok/s (eff) | TTFT p99'."""
    from rich.table import Table
    c = doc["config"]
    t = Table(title=(f"{c['workload']}: {c['ranks']} ranks x {c['api_servers']} api-servers, profile "
                     f"{c['profile']}, dispatch {c['dispatch']}; capacity "
                     f"{doc['capacity']['requests_per_s']:.1f} req/s"))
    t.add_column("policy", style="bold")
    for p in doc["points"]:
        t.add_column(f"load {p['load']:g}\ntok/s (eff) | TTFT p99 ms", justify="right")
    for name in doc["policies"]:
        cells = []
        for p in doc["points"]:
            m = p["policies"][name]
            eff = m.get("efficiency_vs_ideal")
            tt = m.get("ttft_p99_ms")
            cells.append(f"{m['throughput_tok_s'] or 0:,.0f} ({eff:.2f}) | {tt:,.0f}" if eff is not None and tt is not None
                         else "-")
        t.add_row(name + (" (default)" if name == doc.get("default") else ""), *cells)
    return t
