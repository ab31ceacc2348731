"""Overhead benchmark for the pure core (DESIGN §6 "overhead"): scheduler time per dispatch
decision and per finalized step.

    python -m shared.policy.bench            # table
    python -m shared.policy.bench --json     # one JSON object

Decisions: each policy at 8, 64 and 256 ranks places requests of varied sizes; every
``--every`` decisions a snapshot arrives whose ranks echo the seqs they had received one
snapshot earlier (so the local view always holds about one interval of unseen dispatches,
as in service). Timed: ``choose`` plus ``on_snapshot``, per snapshot interval (the median
interval is taken, so a preempted interval on a busy machine does not skew the figure);
building the fake snapshot is not timed.
Steps: a 64-rank aggregator is fed every rank's report of each step in a random order;
timed per step (all 64 reports, the last one finalizing and publishing). Figures are
medians over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

from shared.policy.aggregator import StepAggregator
from shared.policy.base import RequestInfo
from shared.policy.registry import make_policy
from shared.stats import RankStats, Snapshot

POLICY_NAMES = ("round_robin", "least_score", "least_tokens")
RANK_COUNTS = (8, 64, 256)


def _requests(n: int, rnd: random.Random) -> list[RequestInfo]:
    return [RequestInfo(id=f"r{i}", prompt_tokens=rnd.randint(16, 4096), max_tokens=rnd.randint(16, 1024),
                        arrival=i * 1e-3) for i in range(n)]


def bench_decisions(name: str, n_ranks: int, decisions: int, every: int, seed: int = 0) -> dict[str, float]:
    """One run: µs per decision (snapshot handling amortized in) and µs per on_snapshot."""
    rnd = random.Random(seed)
    reqs = _requests(decisions, rnd)
    policy = make_policy(name, ranks=list(range(n_ranks)))
    me = policy.dispatcher_id
    sent = [0] * n_ranks        # last seq sent per rank
    acked = [0] * n_ranks       # what the next snapshot echoes: sent as of the previous one
    perf = time.perf_counter
    chunk_us: list[float] = []  # per interval: (decisions + the snapshot after them) / decisions
    snap_us: list[float] = []
    step = 0
    for lo in range(0, decisions, every):
        chunk = reqs[lo:lo + every]
        t0 = perf()
        for r in chunk:
            a = policy.choose(r, r.arrival)
            sent[a.rank] = a.seq
        busy = perf() - t0
        step += 1
        snap = Snapshot(wave=0, step=step, t=chunk[-1].arrival, seq=step, ranks={
            k: RankStats(rank=k, wave=0, step=step, waiting=rnd.randint(0, 20), running=rnd.randint(0, 64),
                         outstanding=rnd.randint(0, 200_000), kv_used=rnd.randint(0, 1000), kv_total=1000,
                         recv={me: acked[k]})
            for k in range(n_ranks)})
        acked = sent[:]
        t0 = perf()
        policy.on_snapshot(snap)
        dt = perf() - t0
        chunk_us.append((busy + dt) / len(chunk) * 1e6)
        snap_us.append(dt * 1e6)
    # medians over intervals: robust to preemption on a shared machine
    us = statistics.median(chunk_us)
    return {"us_per_decision": us, "decisions_per_s": 1e6 / us, "us_per_snapshot": statistics.median(snap_us)}


def bench_steps(n_ranks: int, steps: int, seed: int = 0) -> dict[str, float]:
    """One run: µs to finalize a step (all reports of it, the last one publishing)."""
    rnd = random.Random(seed)
    plan = []
    for s in range(1, steps + 1):
        reports = [RankStats(rank=r, wave=0, step=s, waiting=rnd.randint(0, 9), recv={"scheduler": s})
                   for r in range(n_ranks)]
        rnd.shuffle(reports)
        plan.append(reports)
    agg = StepAggregator(range(n_ranks), grace_s=0.05)
    perf = time.perf_counter
    per_step, last_report = [], []
    now = 0.0
    for reports in plan:
        now += 0.02
        head, last = reports[:-1], reports[-1]
        t0 = perf()
        for st in head:
            agg.report(st, now)
        t1 = perf()
        snap = agg.report(last, now)
        t2 = perf()
        assert snap is not None and not snap.carried
        per_step.append(t2 - t0)
        last_report.append(t2 - t1)
    return {"us_per_step": statistics.median(per_step) * 1e6,
            "us_per_report": statistics.median(per_step) * 1e6 / n_ranks,
            "us_finalizing_report": statistics.median(last_report) * 1e6}


def run(repeats: int = 5, decisions: int = 20_000, every: int = 64, steps: int = 2_000) -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count(),
                           "loadavg_1m": os.getloadavg()[0],  # a busy machine inflates every figure
                           "repeats": repeats, "decisions": decisions,
                           "snapshot_every": every, "policies": {}, "aggregator": {}}
    for name in POLICY_NAMES:
        for n in RANK_COUNTS:
            runs = [bench_decisions(name, n, decisions, every, seed=i) for i in range(repeats)]
            out["policies"].setdefault(name, {})[str(n)] = {
                k: statistics.median(r[k] for r in runs) for k in runs[0]}
    for n in (64,):
        runs = [bench_steps(n, steps, seed=i) for i in range(repeats)]
        out["aggregator"][str(n)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return out


def _print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"dispatch decisions (snapshot every {res['snapshot_every']} decisions, "
                    f"median of {res['repeats']})")
    for col in ("policy", "ranks", "decisions/s", "µs/decision", "µs/snapshot"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, by_n in res["policies"].items():
        for n, r in by_n.items():
            t.add_row(name, n, f"{r['decisions_per_s']:,.0f}", f"{r['us_per_decision']:.2f}",
                      f"{r['us_per_snapshot']:.1f}")
    console.print(t)
    a = Table(title=f"step finalization (median of {res['repeats']}; load average "
                    f"{res['loadavg_1m']:.1f} on {res['cpus']} CPUs)")
    for col in ("ranks", "µs/step (all reports)", "µs/report", "µs finalizing report"):
        a.add_column(col, justify="right")
    for n, r in res["aggregator"].items():
        a.add_row(n, f"{r['us_per_step']:.1f}", f"{r['us_per_report']:.2f}", f"{r['us_finalizing_report']:.1f}")
    console.print(a)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m shared.policy.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--every", type=int, default=64, help="decisions between snapshots")
    ap.add_argument("--steps", type=int, default=2_000)
    args = ap.parse_args(argv)
    res = run(args.repeats, args.decisions, args.every, args.steps)
    if args.json:
        import json
        print(json.dumps(res))
    else:
        _print_table(res)


if __name__ == "__main__":
    main()
