"""Calibrate a profile against a published table: run the simulator on the same workload
under the peer's strategies and put the rows next to the published figures.

The reference is TensorRT-LLM tech blog 10, "ADP Balance Strategy"
(docs/source/blogs/tech_blog/blog10_ADP_Balance_Strategy.md): DeepSeek-V3 on 8 GB200,
attention DP 8 + EP 8, 16,000 requests all at once, input mean 803 / output mean 3,653.

Balance is reported two ways, because the blog's "Avg Balance Ratio" is not our measure:

* ``balance_blog`` — the blog's: the plain mean over iterations with work of
  ``avg_tokens / max_tokens`` across ranks (every iteration counts once);
* ``balance_ratio`` — the simulator's (shared/measures.py): the same per-step ratio weighted
  by the step's tokens.

``sol_tok_s`` is the blog's speed-of-light throughput: ``elapsed / sum(step_time * ratio) *
actual``; ``sol_gain`` is ``sol_tok_s / actual - 1``, the blog's "theoretical performance
improvement", and ``balance_time`` = ``actual / sol_tok_s`` = 1 / (1 + ``sol_gain``), the
balance weighted by step time. The blog plots (and quotes a gain for) iterations 100-12,000
(``WINDOW``): the ``*_window`` figures are those iterations only, null when a run is shorter.
The comparison is reported, never asserted: small traces are noisy.

    python -m services.simulator.calibrate --requests 2000 [--profile deepseek-v3-gb200]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from shared import measures
from shared.cost_model import CostModel
from services.simulator import profile as profile_mod
from services.simulator import workload as workload_mod
from services.simulator.report import throughput_of
from services.simulator.sim import RunResult, SimConfig, resolve_policies, run_policy

PROFILE = "deepseek-v3-gb200"
BLOG = "TensorRT-LLM tech blog 10 (ADP Balance Strategy), Performance Summary table"
BLOG_REQUESTS = 16000

# strategy -> (simulator policy, blog tok/s, blog balance ratio, blog SOL tok/s)
BLOG_ROWS: dict[str, tuple[str, float, float, float]] = {
    "baseline": ("trtllm_adp_placement_only", 25664.0, 0.5411, 39552.0),
    "context_wait": ("trtllm_adp_ctx_wait", 33499.0, 0.8433, 38312.0),
    "full_strategy": ("trtllm_adp_balance", 34140.0, 0.8770, 37912.0),
}
# The baseline's printed "Avg Balance Ratio" (54.11 %) is, to all four digits, its SOL gain
# (39,552 / 25,664 - 1 = 0.5411); the blog's draft (bloc_x_adp-scheduler-opt.md) prints it
# next to sol_tps and calls that quantity "Theoretical Performance Improvement" for its
# window; the other rows' are not their gains (14.4 %, 11.1 %). As a balance it cannot
# hold beside 84.33 % (docs/calibration.md), so that row is compared by its gain.
PRINTED_AS_GAIN = ("baseline",)
# the iterations the blog's Figures 4-6 plot; for the baseline it quotes a 70.23 % gain there
WINDOW = (100, 12000)
BLOG_BASELINE_GAIN_WINDOW = 0.7023
# run alongside, not a blog row: lockstep's RoundRobin (no sort, no late binding)
EXTRA = ("round_robin",)
POLICIES = tuple(p for p, *_ in BLOG_ROWS.values()) + EXTRA


def blog_balance(scheduled: np.ndarray) -> float | None:
    """The blog's Avg Balance Ratio: the unweighted mean over iterations with work of
    mean/max tokens across ranks (shared/measures.py, ``weighted=False``)."""
    return measures.balance_ratio(scheduled, weighted=False)


def sol_gain(step_dur: np.ndarray, ratio: np.ndarray) -> float | None:
    """The blog's theoretical improvement ``elapsed / sum(time * ratio) - 1``; None without
    steps."""
    sol = float((step_dur * ratio).sum())
    return float(step_dur.sum()) / sol - 1.0 if step_dur.size and sol > 0 else None


def window(n_steps: int, lo: int = WINDOW[0], hi: int = WINDOW[1]) -> slice | None:
    """Iterations ``[lo, hi)`` of a run; None when the run does not reach ``lo``."""
    return slice(lo, min(hi, n_steps)) if n_steps > lo else None


def _ratios(r: RunResult) -> np.ndarray:
    m = np.asarray(r.scheduled, dtype=np.float64)
    mx = m.max(axis=1) if m.size else np.zeros(0)
    out = np.ones_like(mx)
    work = mx > 0
    out[work] = m[work].mean(axis=1) / mx[work]
    return out


def measure(r: RunResult, cost: CostModel | None = None) -> dict[str, Any]:
    from shared import measures
    tput = throughput_of(r)
    ratio = _ratios(r)
    sol_time = float((r.step_dur * ratio).sum())
    elapsed = float(r.step_dur.sum())
    done = np.isfinite(r.finish_t)
    makespan = float(r.finish_t[done].max() - r.arrival.min()) if done.any() else 0.0
    win = window(r.step_dur.size)
    last_first = float(r.first_t[np.isfinite(r.first_t)].max()) if np.isfinite(r.first_t).any() else 0.0
    # the schedule of an offline trace under these (iteration-counted) policies does not
    # depend on the cost constants, so these sums give the makespan of any CostModel:
    # n_work*fixed + token_ms*sum_max_tokens + ctx_ms_per_1k*sum_max_ctx/1000 + n_idle*idle
    mx = np.asarray(r.scheduled).max(axis=1) if r.scheduled.size else np.zeros(0)
    cm = cost or CostModel()
    idle = (mx == 0) & np.isclose(r.step_dur * 1000.0, cm.idle_ms)
    ctx = (r.step_dur * 1000.0 - cm.fixed_ms - cm.token_ms * mx) * 1000.0 / cm.ctx_ms_per_1k \
        if cm.ctx_ms_per_1k > 0 else np.zeros_like(mx)
    out_tokens = float(r.output[done].sum())
    return {
        "output_tokens": out_tokens,
        "step_sums": {"n_work": int((~idle).sum()), "n_idle": int(idle.sum()),
                      "sum_max_tokens": float(mx[~idle].sum()),
                      "sum_max_ctx": float(np.clip(ctx[~idle], 0, None).sum())},
        "throughput_tok_s": tput,
        "balance_blog": blog_balance(r.scheduled),
        "balance_ratio": measures.balance_ratio(r.scheduled),
        "sol_tok_s": tput * elapsed / sol_time if sol_time > 0 else None,
        "sol_gain": sol_gain(r.step_dur, ratio),
        "balance_time": sol_time / elapsed if elapsed > 0 else None,
        "balance_blog_window": blog_balance(r.scheduled[win]) if win else None,
        "sol_gain_window": sol_gain(r.step_dur[win], ratio[win]) if win else None,
        # admission phase (until the last request's first token) vs the drain after it
        "balance_blog_admission": blog_balance(r.scheduled[r.step_t <= last_first]),
        "balance_blog_drain": blog_balance(r.scheduled[r.step_t > last_first]),
        "drain_s": float(r.step_dur[r.step_t > last_first].sum()),
        "steps": int(r.step_dur.size),
        "steps_until_last_first_token": int((r.step_t <= last_first).sum()),
        "mean_step_ms": elapsed / r.step_dur.size * 1000.0 if r.step_dur.size else 0.0,
        "makespan_s": makespan,
        "completed": int(done.sum()),
        "wall_s": r.wall_s,
    }


def run(profile: str | Path = PROFILE, requests: int = 2000, seed: int = 0, ranks: int = 8,
        policies: tuple[str, ...] = POLICIES, cost: dict[str, float] | None = None,
        engine: dict[str, int] | None = None) -> dict[str, Any]:
    """Run the blog's strategies (and ``EXTRA``) on a ``requests``-long blog trace; return
    ``{"config", "rows": {strategy: {blog..., sim..., diffs}}, "extra": {policy: sim}}``.
    ``cost`` / ``engine`` override the profile's fields (used while fitting)."""
    prof = profile_mod.load(profile)
    eng = dataclasses.replace(prof.engine, **(engine or {}))
    cm = dataclasses.replace(prof.cost, **(cost or {}))
    cfg = SimConfig(ranks=ranks, api_servers=1, engine=eng, cost=cm, seed=seed)
    tr = workload_mod.generate("blog", requests, 1.0, seed, 1, max_model_len=eng.max_model_len)
    specs = {s.name: s for s in resolve_policies(list(policies), cfg)}
    t0 = time.perf_counter()
    sims = {name: measure(run_policy(tr, spec, cfg), cm) for name, spec in specs.items()}
    wall = time.perf_counter() - t0
    base_pol = BLOG_ROWS["baseline"][0]
    base_blog = BLOG_ROWS["baseline"][1]
    rows: dict[str, Any] = {}
    for key, (pol, tok, bal, sol) in BLOG_ROWS.items():
        s = sims.get(pol)
        if s is None:
            continue
        row: dict[str, Any] = {"policy": pol, "blog_tok_s": tok, "blog_speedup": tok / base_blog,
                               "blog_balance": bal, "blog_sol_tok_s": sol, **s}
        b = sims.get(base_pol)
        if b and b["throughput_tok_s"]:
            row["speedup"] = s["throughput_tok_s"] / b["throughput_tok_s"]
            row["speedup_diff"] = row["speedup"] - row["blog_speedup"]
        if s["balance_blog"] is not None:
            row["balance_diff"] = s["balance_blog"] - bal
        row["tok_s_rel_diff"] = s["throughput_tok_s"] / tok - 1.0
        # the blog's own table gives every row's gain and time-weighted balance
        row["blog_sol_gain"] = sol / tok - 1.0
        row["blog_balance_time"] = tok / sol
        if key == "baseline":
            row["blog_sol_gain_window"] = BLOG_BASELINE_GAIN_WINDOW
        measure_key = "sol_gain" if key in PRINTED_AS_GAIN else "balance_blog"
        sim_v = s[measure_key]
        row["balance_match"] = {"measure": measure_key, "blog": bal, "sim": sim_v,
                                "diff": sim_v - bal if sim_v is not None else None}
        rows[key] = row
    extra = {}
    for pol in policies:
        if pol in EXTRA and pol in sims:
            e = dict(sims[pol])
            if sims.get(base_pol, {}).get("throughput_tok_s"):
                e["speedup_vs_baseline"] = e["throughput_tok_s"] / sims[base_pol]["throughput_tok_s"]
            extra[pol] = e
    return {"config": {"profile": prof.name, "requests": requests, "seed": seed, "ranks": ranks,
                       "trace": tr.describe(), "engine": dataclasses.asdict(eng),
                       "cost": cm.to_dict(), "reference": BLOG, "wall_s": wall},
            "rows": rows, "extra": extra}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2%}"


def detail_table(doc: dict[str, Any]) -> str:
    """Markdown: the balance figures behind the match, blog (derived from its table) vs sim."""
    out = ["| strategy | printed balance | compared as | sim | diff | blog SOL gain | sim SOL gain | "
           "blog SOL gain it. 100-12,000 | sim SOL gain it. 100-12,000 | blog time-weighted "
           "balance | sim time-weighted balance | sim balance it. 100-12,000 | sim steps |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in doc["rows"].items():
        m = r["balance_match"]
        diff = "-" if m["diff"] is None else f"{m['diff']:+.3f}"
        out.append(f"| {key} | {_pct(m['blog'])} | {m['measure']} | {_pct(m['sim'])} | {diff} | "
                   f"{_pct(r['blog_sol_gain'])} | {_pct(r['sol_gain'])} | "
                   f"{_pct(r.get('blog_sol_gain_window'))} | {_pct(r['sol_gain_window'])} | "
                   f"{_pct(r['blog_balance_time'])} | {_pct(r['balance_time'])} | "
                   f"{_pct(r['balance_blog_window'])} | {r['steps']:,} |")
    return "\n".join(out)


def table(doc: dict[str, Any]) -> str:
    """Markdown: blog vs simulator per strategy."""
    out = ["| strategy | policy | blog tok/s | sim tok/s | blog speedup | sim speedup | "
           "blog balance | sim balance (blog's mean) | sim balance (token-weighted) | "
           "blog SOL tok/s | sim SOL tok/s |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in doc["rows"].items():
        out.append(f"| {key} | {r['policy']} | {r['blog_tok_s']:,.0f} | {r['throughput_tok_s']:,.0f} | "
                   f"{r['blog_speedup']:.2f}x | {r.get('speedup', float('nan')):.2f}x | "
                   f"{r['blog_balance']:.2%} | {r['balance_blog']:.2%} | {r['balance_ratio']:.2%} | "
                   f"{r['blog_sol_tok_s']:,.0f} | {r['sol_tok_s']:,.0f} |")
    for pol, e in doc.get("extra", {}).items():
        out.append(f"| (not in blog) | {pol} | - | {e['throughput_tok_s']:,.0f} | - | "
                   f"{e.get('speedup_vs_baseline', float('nan')):.2f}x | - | {e['balance_blog']:.2%} | "
                   f"{e['balance_ratio']:.2%} | - | {e['sol_tok_s']:,.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    doc = run(a.profile, a.requests, a.seed, policies=tuple(p for p in a.policies.split(",") if p))
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        print(table(doc))
        print()
        print(detail_table(doc))
        print(f"\n{doc['config']['requests']} requests, simulated in {doc['config']['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
