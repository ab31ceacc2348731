"""The engine-side measures of a ``lockstep bench`` run, from the step stats of its window:
balance ratio, idle-forward fraction, per-rank tokens, first prefill, step durations; no
stats in the window is an error, not a perfect run."""

from __future__ import annotations

from typing import Any


def step_measures(rows: list[dict[str, Any]], num_ranks: int, t_from: float, t_to: float) -> dict[str, Any]:
    """Balance ratio, idle-forward fraction and step facts from RankStats dicts."""
    from shared.measures import balance_ratio, idle_forward_fraction, percentile
    from shared.stats import is_pause_report

    steps: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for d in rows:
        t = float(d.get("t", 0.0))
        if t < t_from or t > t_to or is_pause_report(d):
            continue   # a pause's report is the ranks' load, not a step
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
    """What to tell the user when the run window had no step stats, and what to check."""
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
    ``"error"`` (see :func:`no_stats_message`) when the window had no step stats."""
    sm = step_measures(rows, num_ranks, t_from, t_to)
    if sm["steps"] == 0:
        sm["error"] = no_stats_message(namespace, redis_url, len(rows))
    return sm
