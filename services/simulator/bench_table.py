"""Regenerate docs/benchmarks.md (``scripts/bench-table``): load sweeps of every workload
in each system's own deployment, the same in both uniform deployments, the goals check,
the own-deployment sweeps again on the other bundled device profiles (``OTHER_PROFILES``),
and one PNG per sweep (docs/img/sweep-WORKLOAD.png, sweep-PROFILE-WORKLOAD.png).

``scripts/bench-table --quick`` runs a small version (for a look, not for the page);
``scripts/bench-table --only default`` re-runs only the default's rows (after a change to it)
and merges them into the last full run (the peers' code did not change, nor their rows).
``scripts/bench-table --seed 2`` (or ``--workloads heavy-tail,onoff``) judges the goals on
another trace: the own-deployment sweeps on every profile, printed, the page untouched."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from services.simulator import sweep
from services.simulator.report import deployment

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
WORKLOADS = ("poisson", "bursty", "ramp", "offline")
LOADS = (0.3, 0.5, 0.8, 1.0, 1.2, 1.5)
CHECK_LOADS = (0.5, 1.0, 1.5)
POLICIES = ("default,least_score,vllm,sglang_total_requests,sglang_total_tokens,sglang_prefill_delayer,"
            "trtllm_adp_placement_only,trtllm_adp_ctx_wait,trtllm_adp_balance,fastdeploy_staggered_pr")
NOT_GOALS = {"fastdeploy_staggered_pr"}     # a reconstruction of unmerged work: reported, never a goal
RANKS, API_SERVERS, REQUESTS, SEED = 16, 4, 2000, 1
OTHER_PROFILES = ("deepseek-v3-gb200",)   # the own-deployment sweeps again on these device profiles


def _run(args: tuple[Any, ...]) -> dict[str, Any]:
    workload, dispatch, loads, ranks, api, requests, policies, profile, *seed = args
    return sweep.load_sweep(list(loads), ranks=ranks, api_servers=api, workload=workload,
                            requests=requests, seed=seed[0] if seed else SEED, policies=policies,
                            dispatch=dispatch, profile=profile)


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` sweep with the policies ``new`` ran replaced by ``new``'s results (same
    workload, loads and seed: the other policies' code did not change, so their rows stand)."""
    if [p["load"] for p in old["points"]] != [p["load"] for p in new["points"]]:
        raise ValueError("the sweeps have different load points: regenerate everything")
    for po, pn in zip(old["points"], new["points"]):
        po["policies"].update(pn["policies"])
    return old


def cmd(doc: dict[str, Any]) -> str:
    c = doc["config"]
    loads = ",".join(f"{p['load']:g}" for p in doc["points"])
    d = "" if c["dispatch"] == "each system's own" else f" --dispatch {c['dispatch']}"
    prof = "" if c.get("profile", "default") == "default" else f" --profile {c['profile']}"
    return (f"lockstep simulate --ranks {c['ranks']} --api-servers {c['api_servers']} --workload {c['workload']} "
            f"--requests {c['requests']} --seed {c['seed']} --sweep {loads}{d}{prof} --policies {POLICIES}")


def _cell(m: dict[str, Any]) -> str:
    eff, tt, itl = m.get("efficiency_vs_ideal"), m.get("ttft_p99_ms"), m.get("itl_p99_ms")
    if eff is None or tt is None:
        return "-"
    return f"{eff:.2f} / {tt / 1000:.2f} s / {itl:.0f}" if itl is not None else f"{eff:.2f} / {tt / 1000:.2f} s"


def sweep_markdown(doc: dict[str, Any]) -> str:
    loads = [p["load"] for p in doc["points"]]
    head = "| policy | deployment | " + " | ".join(f"load {x:g}" for x in loads) + " |"
    rows = [head, "|---|---|" + "|".join("---:" for _ in loads) + "|"]
    for name in doc["policies"]:
        label = f"**{name}**" if name == doc.get("default") else name
        m0 = doc["points"][0]["policies"][name]
        dep = m0.get("deployment") or deployment((m0.get("counters") or {}).get("deployment")) or "-"
        rows.append(f"| {label} | {dep} | " + " | ".join(_cell(p["policies"][name]) for p in doc["points"]) + " |")
    return "\n".join(rows)


def _num(v: Any, fmt: str) -> str:
    return "no data" if v is None else format(v, fmt)


@functools.cache
def _own_policies() -> frozenset[str]:
    """lockstep's policies: never a peer the default is judged against."""
    from services.simulator.baselines import policy_specs
    return frozenset(n for n, s in policy_specs().items() if s.lockstep)


def _peers(pol: dict[str, Any], default: str) -> dict[str, Any]:
    own = _own_policies()
    return {n: v for n, v in pol.items() if n != default and n not in NOT_GOALS and n not in own}


def _floor3(x: float) -> str:
    """Three decimals, rounded down: 0.9496 reads 0.949 beside a goal of >= 0.95, not 0.950."""
    return f"{math.floor(x * 1000) / 1000:.3f}"


def goal_lines(doc: dict[str, Any]) -> list[str]:
    """Issue #13's criteria on one sweep, each stated met or NOT met (never asserted).
    A figure with no data is never met."""
    d = doc.get("default")
    out = []
    inf = float("inf")
    for p in doc["points"]:
        pol = p["policies"]
        if d not in pol:   # (--only without the default): nobody to judge
            out.append(f"- load {p['load']:g}: the default policy is not in this run — not judged")
            continue
        me = pol[d]
        peers = _peers(pol, d)
        if not peers:   # (--only without a peer): nothing to judge against, so nothing is met
            out.append(f"- load {p['load']:g}: no peer in this run — not judged")
            continue
        best_tp = max(peers.items(), key=lambda kv: kv[1]["throughput_tok_s"] or 0)
        best_tt = min(peers.items(), key=lambda kv: kv[1]["ttft_p99_ms"] if kv[1]["ttft_p99_ms"] is not None else inf)
        best_itl = min(peers.items(), key=lambda kv: kv[1]["itl_p99_ms"] if kv[1]["itl_p99_ms"] is not None else inf)
        tp, btp = me["throughput_tok_s"], best_tp[1]["throughput_tok_s"]
        ok_tp = tp is not None and tp >= (btp or 0)
        parts = [f"throughput {_num(tp, ',.0f')} vs best peer {best_tp[0]} {_num(btp, ',.0f')}"
                 f"{'' if btp is None else ' tok/s'} — {'met' if ok_tp else 'NOT met'}"]
        if p["load"] >= 1.0:
            eff = me["efficiency_vs_ideal"]
            parts.append(f"efficiency {'no data' if eff is None else _floor3(eff)} (goal >= 0.95) — "
                         f"{'met' if eff is not None and eff >= 0.95 else 'NOT met'}")
        if p["load"] <= 0.8:
            tt, btt = me["ttft_p99_ms"], best_tt[1]["ttft_p99_ms"]
            ok = tt is not None and tt <= (btt if btt is not None else inf)
            parts.append(f"TTFT p99 {_num(None if tt is None else tt / 1000, '.2f')}{'' if tt is None else ' s'} vs best "
                         f"{best_tt[0]} {_num(None if btt is None else btt / 1000, '.2f')}{'' if btt is None else ' s'}"
                         f" — {'met' if ok else 'NOT met'}")
        # at the 1 ms the table shows: a 0.04 ms difference of 132 ms steps is no difference
        it, bit = me["itl_p99_ms"], best_itl[1]["itl_p99_ms"]
        ok_itl = it is not None and (bit is None or round(it) <= round(bit))
        parts.append(f"ITL p99 {_num(it, '.0f')} vs {_num(bit, '.0f')}{'' if bit is None else ' ms'} — "
                     f"{'met' if ok_itl else 'NOT met'}")
        out.append(f"- load {p['load']:g}: " + "; ".join(parts))
    return out


def goal_tally(lines: list[str]) -> tuple[int, int]:
    """(goal lines NOT met, goal lines judged) in :func:`goal_lines`' output."""
    missed = sum(line.count("— NOT met") for line in lines)
    return missed, missed + sum(line.count("— met") for line in lines)


def check_markdown(docs: dict[str, dict[str, Any]]) -> str:
    """Default vs the best peer (by throughput) in both uniform deployments."""
    rows = ["| workload | deployment | load | default: eff / TTFT p99 / ITL p99 ms | best peer by throughput: same |",
            "|---|---|---:|---:|---|"]
    for (workload, disp), doc in docs.items():
        d = doc.get("default")
        for p in doc["points"]:
            pol = p["policies"]
            peers = _peers(pol, d)
            best = "no peer in this run"
            if peers:
                bn = max(peers, key=lambda n: peers[n]["throughput_tok_s"] or 0)
                best = f"{bn}: {_cell(peers[bn])}"
            mine = _cell(pol[d]) if d in pol else "not in this run"
            rows.append(f"| {workload} | {disp} | {p['load']:g} | {mine} | {best} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a small run printed to stdout, the page untouched")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--from-json", action="store_true",
                    help="re-render the page from docs/benchmarks.json (no simulation)")
    ap.add_argument("--profile", choices=OTHER_PROFILES,
                    help="run only this profile's sweeps (with --only: only those policies) and merge them into "
                         "docs/benchmarks.json; every other section stays as it was")
    ap.add_argument("--only", metavar="POLICIES",
                    help="re-run only these policies (comma-separated, e.g. default after changing it) and "
                         "merge them into docs/benchmarks.json; the other rows stay as they were")
    ap.add_argument("--seed", type=int, default=SEED,
                    help=f"judge the goals on another trace (the page's is seed {SEED}): the own-deployment sweeps "
                         "on every profile, printed with a count of the lines missed; the page untouched")
    ap.add_argument("--workloads", metavar="W1,W2",
                    help="the same on these workloads (any of lockstep simulate's, e.g. heavy-tail,onoff,fixed,blog; "
                         f"the page's are {','.join(WORKLOADS)}): printed, the page untouched")
    a = ap.parse_args(argv)
    if a.seed != SEED or a.workloads:
        return _other_trace(ap, a)
    if a.only:
        from services.simulator.sim import SimConfig, resolve_policies
        try:
            a.only = ",".join(s.name for s in resolve_policies(a.only, SimConfig()))
        except ValueError as exc:
            ap.error(f"--only: {exc}")
    if a.from_json:
        data = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
        both = {tuple(k.split(":", 1)): v for k, v in data["uniform"].items()}
        write_page(data["own"], both, data.get("wall_s", 0.0), data.get("rerun"), data.get("profiles"))
        return
    ranks, api, req = (8, 2, 600) if a.quick else (RANKS, API_SERVERS, REQUESTS)
    loads = (0.5, 1.0, 1.5) if a.quick else LOADS
    policies = a.only or POLICIES
    jobs = [] if a.profile else [(w, None, loads, ranks, api, req, policies, None) for w in WORKLOADS]
    if not a.profile:
        jobs += [(w, d, CHECK_LOADS, ranks, api, req, policies, None) for w in WORKLOADS for d in ("scheduler", "client")]
    if a.profile or not a.quick:   # (--quick alone: the default profile only)
        jobs += [(w, None, loads, ranks, api, req, policies, prof)
                 for prof in ([a.profile] if a.profile else OTHER_PROFILES) for w in WORKLOADS]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        results = list(ex.map(_run, jobs))
    wall = time.perf_counter() - t0
    own = {j[0]: r for j, r in zip(jobs, results) if j[1] is None and j[7] is None}
    both = {(j[0], j[1]): r for j, r in zip(jobs, results) if j[1] is not None}
    profiles: dict[str, dict[str, Any]] = {}
    for j, r in zip(jobs, results):
        if j[7] is not None:
            profiles.setdefault(j[7], {})[j[0]] = r
    if a.quick:
        named = [(w, doc) for w, doc in own.items()]
        named += [(f"{w} ({prof})", doc) for prof, docs in profiles.items() for w, doc in docs.items()]
        for w, doc in named:
            print(f"## {w}\n{sweep_markdown(doc)}\n" + "\n".join(goal_lines(doc)) + "\n")
        if both:
            print(check_markdown(both))
        return
    rerun = None
    if a.profile:   # one profile's sweeps, into the last full run (the other sections stand)
        data = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
        old = (data.get("profiles") or {}).get(a.profile, {})
        profiles = {**(data.get("profiles") or {}),
                    a.profile: {w: merge(old[w], doc) if a.only else doc for w, doc in profiles[a.profile].items()}}
        own, both = data["own"], {tuple(k.split(":", 1)): v for k, v in data["uniform"].items()}
        rerun, wall = data.get("rerun"), data.get("wall_s", 0.0)
    elif a.only:
        data = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
        own = {w: merge(data["own"][w], doc) for w, doc in own.items()}
        both = {k: merge(data["uniform"][f"{k[0]}:{k[1]}"], doc) for k, doc in both.items()}
        old_profiles = data.get("profiles") or {}
        profiles = {prof: {w: merge(old_profiles[prof][w], doc) for w, doc in docs.items()}
                    for prof, docs in profiles.items()}
        rerun = {"policies": a.only, "wall_s": wall}
        wall = data.get("wall_s", 0.0)
    (ROOT / "docs" / "benchmarks.json").write_text(json.dumps(
        {"own": own, "uniform": {f"{k[0]}:{k[1]}": v for k, v in both.items()}, "profiles": profiles,
         "wall_s": wall, "rerun": rerun}))
    write_page(own, both, wall, rerun, profiles)


def _other_trace(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``--seed`` / ``--workloads``: the goals judged on a trace the page does not show (is
    the default tuned to one trace?), printed; the page and docs/benchmarks.json untouched."""
    from services.simulator.workload import WORKLOADS as KNOWN
    if a.only or a.quick or a.from_json:
        ap.error("--seed / --workloads judge the default against every peer on a new trace: "
                 "not with --only, --quick or --from-json")
    workloads = tuple(w.strip() for w in a.workloads.split(",") if w.strip()) if a.workloads else WORKLOADS
    bad = [w for w in workloads if w.split(":", 1)[0] not in KNOWN]
    if bad or not workloads:
        ap.error(f"--workloads: unknown {', '.join(bad) or 'none given'}; known: {', '.join(KNOWN)}")
    profiles = [a.profile] if a.profile else [None, *OTHER_PROFILES]
    jobs = [(w, None, LOADS, RANKS, API_SERVERS, REQUESTS, POLICIES, prof, a.seed)
            for prof in profiles for w in workloads]
    t0 = time.perf_counter()
    missed = judged = 0
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        for j, doc in zip(jobs, ex.map(_run, jobs)):
            lines = goal_lines(doc)
            m, n = goal_tally(lines)
            missed, judged = missed + m, judged + n
            name = j[0] if j[7] is None else f"{j[0]} ({j[7]})"
            print(f"## {name}, seed {a.seed}: {m} of {n} goal lines not met\n`{cmd(doc)}`\n\n{sweep_markdown(doc)}\n\n"
                  + "\n".join(lines) + "\n", flush=True)
    print(f"seed {a.seed}, {', '.join(workloads)}: {missed} of {judged} goal lines not met "
          f"({time.perf_counter() - t0:.0f} s)")


def _sweep_section(w: str, doc: dict[str, Any], img: str) -> str:
    cap = doc["capacity"]["requests_per_s"]
    return (f"### {w}\n\n`{cmd(doc)}`\n\ncapacity {cap:.1f} requests/s; each cell: efficiency vs ideal / "
            f"TTFT p99 / ITL p99 ms.\n\n" + sweep_markdown(doc) +
            f"\n\n![{w} sweep](img/{img})\n\nThe default against the peers (goals of issue #13):\n\n" +
            "\n".join(goal_lines(doc)) + "\n")


def write_page(own: dict[str, Any], both: dict[tuple, Any], wall: float, rerun: dict | None = None,
               profiles: dict[str, dict[str, Any]] | None = None) -> None:
    from services.simulator.plot import plot_sweep
    IMG.mkdir(parents=True, exist_ok=True)
    sections = []
    for w, doc in own.items():
        plot_sweep(doc, IMG / f"sweep-{w}.png")
        sections.append(_sweep_section(w, doc, f"sweep-{w}.png"))
    others = []
    for prof, docs in (profiles or {}).items():
        part = [f"## The same sweeps on the `{prof}` profile\n\nEvery system in its own deployment, as above, "
                f"on the `{prof}` device profile (services/simulator/profiles/{prof}.json: its engine limits and "
                "step cost; [calibration.md](calibration.md)).\n"]
        for w, doc in docs.items():
            plot_sweep(doc, IMG / f"sweep-{prof}-{w}.png")
            part.append(_sweep_section(f"{w} ({prof})", doc, f"sweep-{prof}-{w}.png"))
        others.append("\n".join(part))
    head = (ROOT / "services" / "simulator" / "benchmarks_head.md").read_text()
    tail = (ROOT / "services" / "simulator" / "benchmarks_tail.md").read_text()
    OUT.write_text(head + "\n## Load sweeps, each system in its own deployment\n\n" + "\n".join(sections) +
                   "\n## The same in both uniform deployments\n\nEvery system as one dispatcher with a fresh "
                   "view (`--dispatch scheduler`), then as every api-server deciding from a 100 ms view "
                   "(`--dispatch client`; lockstep's api-servers place at once in that mode). Commands: the "
                   "sweep commands above with `--sweep 0.5,1,1.5 --dispatch scheduler|client`.\n\n" +
                   check_markdown(both) + "\n\n" + "".join(o + "\n" for o in others) + tail +
                   f"\n\n_Generated in {wall / 60:.0f} min on 2 cores._" +
                   (f" _Rows of {rerun['policies']} re-run since (`scripts/bench-table --only {rerun['policies']}`, "
                    f"{rerun['wall_s'] / 60:.0f} min)._" if rerun else "") + "\n")
    print(f"wrote {OUT} ({wall:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
