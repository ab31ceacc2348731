"""Turn simulation runs into the measures of shared/measures.py: a dict per policy, the
JSON document, and a rich table."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shared import measures
from services.simulator.sim import RunResult

# (key, column title, format) for the table
COLUMNS: list[tuple[str, str, str]] = [
    ("balance_ratio", "balance", "{:.3f}"),
    ("idle_forward_fraction", "idle fwd", "{:.3f}"),
    ("idle_forward_fraction_arrivals", "idle fwd (arrivals)", "{:.3f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    ("e2e_p99_ms", "E2E p99 ms", "{:.0f}"),
    ("throughput_tok_s", "tok/s", "{:,.0f}"),
    ("efficiency_vs_ideal", "eff vs ideal", "{:.3f}"),
    ("completed", "done", "{:d}"),
]


def _ms(d: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}_{k}_ms": v * 1000.0 for k, v in d.items()}


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (np.floating,)):
        return _clean(float(x))
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return x


def throughput_of(r: RunResult) -> float:
    done = np.isfinite(r.finish_t)
    if not done.any():
        return 0.0
    return measures.throughput(float(r.output[done].sum()), float(r.arrival.min()),
                               float(r.finish_t[done].max()))


def summarize(r: RunResult, ideal_tok_s: float | None) -> dict[str, Any]:
    done = np.isfinite(r.finish_t)
    ttft = (r.first_t - r.arrival)[np.isfinite(r.first_t)]
    e2e = (r.finish_t - r.arrival)[done]
    tput = throughput_of(r)
    busy = float(r.step_dur.sum())
    per_rank = np.bincount(r.rank_of[r.rank_of >= 0], minlength=r.scheduled.shape[1]) \
        if r.scheduled.size else np.zeros(0)
    # the same measures over the steps that began while requests were still arriving: the
    # drain after the last arrival (a few long decodes on a few ranks, the others idle by
    # necessity) is left out, so this shows what dispatch and alignment can change
    arr = r.step_t <= float(r.arrival.max()) if r.step_t.size else np.zeros(0, dtype=bool)
    out: dict[str, Any] = {
        "balance_ratio": measures.balance_ratio(r.scheduled),
        "idle_forward_fraction": measures.idle_forward_fraction(r.scheduled),
        "balance_ratio_arrivals": measures.balance_ratio(r.scheduled[arr]),
        "idle_forward_fraction_arrivals": measures.idle_forward_fraction(r.scheduled[arr]),
        **_ms(measures.percentiles(ttft), "ttft"),
        **_ms(measures.percentiles(r.step_dur, weights=r.decode_tokens), "itl"),
        **_ms(measures.percentiles(e2e), "e2e"),
        "throughput_tok_s": tput,
        "efficiency_vs_ideal": measures.efficiency_vs_ideal(tput, ideal_tok_s),
        "completed": int(done.sum()),
        "rejected": int(r.counters.get("rejected", 0)),
        "requests": int(r.arrival.size),
        "steps": int(r.step_dur.size),
        "busy_s": busy,
        "makespan_s": float(r.finish_t[done].max() - r.arrival.min()) if done.any() else 0.0,
        "mean_step_ms": busy / r.step_dur.size * 1000.0 if r.step_dur.size else 0.0,
        "requests_per_rank_max_over_mean": float(per_rank.max() / per_rank.mean()) if per_rank.size and per_rank.mean() > 0 else None,
        "counters": r.counters,
        "deployment": deployment(r.counters.get("deployment")),
    }
    return _clean(out)


def deployment(d: dict[str, Any] | None) -> str | None:
    """Who decided and how fresh its view was, in words (the table's 'deployment')."""
    if not d:
        return None
    if d.get("late_binding"):
        return "in-engine queue, exact view"
    n, v = d.get("dispatchers", 1), d.get("view_interval_ms", 0.0)
    who = "1 dispatcher" if n == 1 else f"{n} api-servers"
    return f"{who}, view {'every step' if not v else f'every {v:g} ms'}"


def document(config: dict[str, Any], results: list[RunResult], ideal: RunResult | None) -> dict[str, Any]:
    ideal_tok_s = throughput_of(ideal) if ideal is not None else None
    doc: dict[str, Any] = {"config": config, "policies": {}}
    if ideal is not None:
        doc["ideal"] = _clean({"throughput_tok_s": ideal_tok_s, "steps": int(ideal.step_dur.size),
                               "busy_s": float(ideal.step_dur.sum()),
                               "ttft_p99_ms": measures.percentile((ideal.first_t - ideal.arrival), 99) * 1000.0})
    for r in results:
        doc["policies"][r.name] = summarize(r, ideal_tok_s)
    return doc


def best_policies(doc: dict[str, Any], lockstep_names: set[str]) -> dict[str, str | None]:
    """Best lockstep policy and best baseline by efficiency (ties: TTFT p99)."""
    def key(name: str) -> tuple:
        p = doc["policies"][name]
        return (-(p["efficiency_vs_ideal"] or 0.0), p["ttft_p99_ms"] or math.inf)
    own = sorted((n for n in doc["policies"] if n in lockstep_names), key=key)
    base = sorted((n for n in doc["policies"] if n not in lockstep_names), key=key)
    return {"lockstep": own[0] if own else None, "baseline": base[0] if base else None}


def fmt(key: str, v: Any) -> str:
    """One table cell; "-" for a measure without data (None, or a NaN not yet cleaned)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    for k, _, f in COLUMNS:
        if k == key:
            try:
                return f.format(v)
            except (ValueError, TypeError):
                return str(v)
    return str(v)


def rich_table(doc: dict[str, Any], title: str | None = None):
    from rich.table import Table
    table = Table(title=title, show_lines=False)
    table.add_column("policy", style="bold", no_wrap=True)   # names differ only at their ends
    table.add_column("deployment")
    for _, head, _ in COLUMNS:
        table.add_column(head, justify="right")
    for name, p in doc["policies"].items():
        label = name + (" (default)" if name == doc.get("default") else "")
        table.add_row(label, p.get("deployment") or "-", *[fmt(k, p.get(k)) for k, _, _ in COLUMNS])
    return table


def markdown_table(doc: dict[str, Any]) -> str:
    head = "| policy | deployment | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|---|---|" + "|".join("---:" for _ in COLUMNS) + "|"
    rows = [head, sep]
    for name, p in doc["policies"].items():
        rows.append(f"| {name} | {p.get('deployment') or '-'} | " + " | ".join(fmt(k, p.get(k)) for k, _, _ in COLUMNS) + " |")
    return "\n".join(rows)
