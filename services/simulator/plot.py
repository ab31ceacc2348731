"""``--plot FILE.png``: per-rank load over time (one heat map per policy), balance ratio
and idle-forward fraction per policy, and TTFT CDFs. matplotlib with the Agg backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.simulator.sim import RunResult

MAX_COLS = 600   # time bins of a heat map


def _f(v: Any) -> str:
    """A 0..1 measure for a title; "-" when it has no data (None)."""
    return "-" if v is None else f"{v:.3f}"


def _bar_width(v: Any) -> float:
    """A bar's width: NaN (no bar) for a measure without data, never a misleading 0."""
    return float("nan") if v is None else float(v)


def _binned(r: RunResult) -> tuple[np.ndarray, float, float]:
    """Per-rank scheduled tokens per second, in MAX_COLS time bins."""
    if r.step_t.size == 0:
        return np.zeros((r.scheduled.shape[1], 1)), 0.0, 1.0
    t0, t1 = float(r.step_t[0]), float(r.step_t[-1] + r.step_dur[-1])
    bins = min(MAX_COLS, max(1, r.step_t.size))
    idx = np.minimum(((r.step_t - t0) / max(t1 - t0, 1e-9) * bins).astype(int), bins - 1)
    out = np.zeros((r.scheduled.shape[1], bins))
    np.add.at(out.T, idx, r.scheduled)
    width = (t1 - t0) / bins
    return out / max(width, 1e-9), t0, t1


def plot_results(results: list[RunResult], doc: dict[str, Any], path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig = plt.figure(figsize=(14, 3.0 * n + 4.5))
    gs = fig.add_gridspec(n + 1, 2, height_ratios=[1.0] * n + [1.6])
    vmax = max((float(_binned(r)[0].max()) for r in results), default=1.0) or 1.0
    for k, r in enumerate(results):
        ax = fig.add_subplot(gs[k, :])
        m, t0, t1 = _binned(r)
        im = ax.imshow(m, aspect="auto", origin="lower", extent=(t0, t1, -0.5, m.shape[0] - 0.5),
                       cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        p = doc["policies"].get(r.name, {})
        ax.set_title(f"{r.name}: scheduled tokens/s per rank (balance {_f(p.get('balance_ratio'))}, "
                     f"idle fwd {_f(p.get('idle_forward_fraction'))})", fontsize=9)
        ax.set_ylabel("rank")
        if k == n - 1:
            ax.set_xlabel("time (s)")
        fig.colorbar(im, ax=ax, pad=0.01)

    ax = fig.add_subplot(gs[n, 0])
    names = [r.name for r in results]
    bal = [_bar_width(doc["policies"][x]["balance_ratio"]) for x in names]
    idle = [_bar_width(doc["policies"][x]["idle_forward_fraction"]) for x in names]
    y = np.arange(len(names))
    ax.barh(y - 0.2, bal, height=0.4, label="balance ratio")
    ax.barh(y + 0.2, idle, height=0.4, label="idle-forward fraction")
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("balance ratio / idle-forward fraction", fontsize=9)

    ax = fig.add_subplot(gs[n, 1])
    for r in results:
        ttft = np.sort((r.first_t - r.arrival)[np.isfinite(r.first_t)]) * 1000.0
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=r.name, lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_sweep(doc: dict[str, Any], path: str | Path) -> None:
    """A load sweep: throughput (efficiency vs ideal) and TTFT p99 against load, one line
    per policy; the default drawn thick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [p["load"] for p in doc["points"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in doc["policies"]:
        eff = [p["policies"][name].get("efficiency_vs_ideal") for p in doc["points"]]
        ttft = [p["policies"][name].get("ttft_p99_ms") for p in doc["points"]]
        kw = {"lw": 3.0, "color": "black"} if name == doc.get("default") else {"lw": 1.2}
        a1.plot(loads, [float("nan") if v is None else v for v in eff], marker="o", label=name, **kw)
        a2.plot(loads, [float("nan") if v is None else v / 1000.0 for v in ttft], marker="o", label=name, **kw)
    c = doc["config"]
    a1.set_title(f"{c['workload']}: throughput / ideal (capacity {doc['capacity']['requests_per_s']:.0f} req/s)", fontsize=9)
    a1.set_xlabel("load (x capacity)")
    a1.set_ylabel("efficiency vs ideal")
    a1.grid(alpha=0.3)
    a2.set_title(f"TTFT p99 ({c['ranks']} ranks, {c['api_servers']} api-servers, {c['dispatch']})", fontsize=9)
    a2.set_xlabel("load (x capacity)")
    a2.set_ylabel("seconds (log)")
    a2.set_yscale("log")
    a2.grid(alpha=0.3, which="both")
    a2.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
