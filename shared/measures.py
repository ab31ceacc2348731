"""The measures of DESIGN §6, defined once: the simulator, ``lockstep bench`` and the
dashboard all compute them here.

* **balance ratio** (TensorRT-LLM's): for every step in which any rank scheduled work,
  ``mean over ranks of scheduled tokens / max over ranks``; the run's figure is the mean
  over those steps weighted by the step's total scheduled tokens (a step that moved many
  tokens counts more than a near-empty one). 1.0 is perfect.
* **idle-forward fraction**: rank-steps that ran a dummy forward while another rank had
  work, divided by all rank-steps of steps with global work. 0.0 is perfect.
* **percentiles** (p50/p90/p99) of TTFT, ITL and end-to-end latency, nearest-rank
  (``numpy`` ``inverted_cdf``): the reported value is always one that was observed, and a
  weighted sample equals the same values repeated ``weight`` times.
* **throughput**: output tokens / (last completion - first arrival), tokens per second.
* **efficiency vs. ideal**: throughput / the throughput of the same trace run with
  perfectly balanced steps under the same cost model (the simulator computes that ideal;
  see ``services/simulator/sim.py``).

No data is not a perfect figure: a measure with nothing to measure is None (null in
JSON), never 1.0 or 0.0. Balance ratio and idle-forward fraction are None when no step
had work (no steps, or only all-zero steps: e.g. ``lockstep bench`` reading the wrong
namespace); throughput is None for an empty span (zero tokens over a real span is 0.0);
efficiency vs. ideal is None without an ideal or a throughput. The percentile functions
return NaN for an empty sample (so they stay plain floats for numpy); every caller
reports that NaN as None, and :meth:`MeasureAccumulator.summary` does so itself.

Everything takes plain sequences or numpy arrays; :class:`MeasureAccumulator` is the
incremental form for live use (feed it one step at a time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES: tuple[int, ...] = (50, 90, 99)


# --- per-step balance -----------------------------------------------------------------

def _as_matrix(scheduled: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    m = np.asarray(scheduled, dtype=np.float64)
    if m.ndim == 1:                      # one step
        m = m.reshape(1, -1)
    if m.ndim != 2:
        raise ValueError("scheduled must be steps x ranks")
    return m


def step_balance(tokens: Sequence[int] | np.ndarray) -> float | None:
    """Balance of one step: mean / max of the ranks' scheduled tokens; None if no work."""
    row = np.asarray(tokens, dtype=np.float64)
    mx = float(row.max()) if row.size else 0.0
    if mx <= 0:
        return None
    return float(row.mean() / mx)


def balance_ratio(scheduled: Sequence[Sequence[int]] | np.ndarray, weighted: bool = True) -> float | None:
    """Token-weighted mean of per-step balance over steps with any work (steps x ranks);
    None when no step had work. ``weighted=False``: the plain mean over those steps
    (TensorRT-LLM's blog reports that one)."""
    m = _as_matrix(scheduled)
    if m.size == 0:
        return None
    mx = m.max(axis=1)
    work = mx > 0
    if not work.any():
        return None
    m, mx = m[work], mx[work]
    if not weighted:
        return float((m.mean(axis=1) / mx).mean())
    total = m.sum(axis=1)
    ratio = m.mean(axis=1) / mx
    return float((ratio * total).sum() / total.sum())


def idle_forward_fraction(scheduled: Sequence[Sequence[int]] | np.ndarray,
                          idle: Sequence[Sequence[bool]] | np.ndarray | None = None) -> float | None:
    """Dummy-forward rank-steps while another rank had work / rank-steps with global work;
    None when no step had work.

    ``idle`` (steps x ranks) marks the ranks that ran a dummy forward; without it a rank
    with zero scheduled tokens in a step where another rank had work counts as idle.
    """
    m = _as_matrix(scheduled)
    if m.size == 0:
        return None
    work = m.max(axis=1) > 0
    if not work.any():
        return None
    if idle is None:
        idle_m = m[work] <= 0
    else:
        idle_m = np.asarray(idle, dtype=bool)
        if idle_m.ndim == 1:
            idle_m = idle_m.reshape(1, -1)
        idle_m = idle_m[work] & (m[work] <= 0)
    return float(idle_m.sum() / idle_m.size)


# --- latency percentiles --------------------------------------------------------------

def _arr(values: Iterable[float] | np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values.astype(np.float64, copy=False).ravel()
    return np.asarray(list(values), dtype=np.float64)


def percentile(values: Iterable[float] | np.ndarray, q: float,
               weights: Iterable[float] | np.ndarray | None = None) -> float:
    """Nearest-rank percentile ``q`` (0..100); NaN for an empty sample."""
    v = _arr(values)
    if v.size == 0:
        return math.nan
    if weights is None:
        return float(np.percentile(v, q, method="inverted_cdf"))
    w = _arr(weights)
    keep = w > 0
    if not keep.any():
        return math.nan
    return float(np.percentile(v[keep], q, weights=w[keep], method="inverted_cdf"))


def percentiles(values: Iterable[float] | np.ndarray, ps: Sequence[float] = PERCENTILES,
                weights: Iterable[float] | np.ndarray | None = None) -> dict[str, float]:
    """{"p50": .., "p90": .., "p99": ..} of ``values`` (optionally weighted)."""
    v = _arr(values)
    w = None if weights is None else _arr(weights)
    return {f"p{p:g}": percentile(v, p, w) for p in ps}


# --- throughput -----------------------------------------------------------------------

def throughput(output_tokens: float, start: float, end: float) -> float | None:
    """Output tokens per second over [start, end] (seconds); None for an empty span
    (0.0 for zero tokens over a real span: that is data)."""
    span = end - start
    return float(output_tokens) / span if span > 0 else None


def efficiency_vs_ideal(actual_tok_s: float | None, ideal_tok_s: float | None) -> float | None:
    """Throughput as a fraction of the perfectly balanced run's; None without an ideal
    (None, 0 or NaN) or without an actual throughput."""
    if actual_tok_s is None or ideal_tok_s is None or not ideal_tok_s > 0:
        return None
    actual = float(actual_tok_s)
    return actual / ideal_tok_s if math.isfinite(actual) else None


# --- incremental form -----------------------------------------------------------------

@dataclass
class MeasureAccumulator:
    """Running measures for live use: feed one step (per-rank scheduled tokens and,
    optionally, the per-rank dummy-forward flags) at a time, and per-request latencies.

    Balance and idle fraction match :func:`balance_ratio` and
    :func:`idle_forward_fraction` on the same steps exactly (None before a step with
    work). Latency samples are kept in full (a live dashboard should ``reset()`` per
    window).
    """

    _w_ratio: float = 0.0            # sum over work steps of ratio * total tokens
    _w: float = 0.0                  # sum over work steps of total tokens
    _idle_rank_steps: int = 0
    _work_rank_steps: int = 0
    work_steps: int = 0
    steps: int = 0
    output_tokens: int = 0
    first_t: float | None = None
    last_t: float | None = None
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    _itl: list[float] = field(default_factory=list)
    _itl_w: list[float] = field(default_factory=list)

    def add_step(self, scheduled: Sequence[int], idle: Sequence[bool] | None = None) -> None:
        self.steps += 1
        mx = max(scheduled) if len(scheduled) else 0
        if mx <= 0:
            return
        total = sum(scheduled)
        n = len(scheduled)
        self.work_steps += 1
        self._w_ratio += (total / n / mx) * total
        self._w += total
        if idle is None:
            self._idle_rank_steps += sum(1 for s in scheduled if s <= 0)
        else:
            self._idle_rank_steps += sum(1 for s, i in zip(scheduled, idle) if i and s <= 0)
        self._work_rank_steps += n

    def add_request(self, ttft_s: float | None = None, e2e_s: float | None = None,
                    output_tokens: int = 0, arrival: float | None = None,
                    finish: float | None = None) -> None:
        if ttft_s is not None:
            self.ttft.append(ttft_s)
        if e2e_s is not None:
            self.e2e.append(e2e_s)
        self.output_tokens += output_tokens
        if arrival is not None:
            self.first_t = arrival if self.first_t is None else min(self.first_t, arrival)
        if finish is not None:
            self.last_t = finish if self.last_t is None else max(self.last_t, finish)

    def add_itl(self, gap_s: float, count: int = 1) -> None:
        """``count`` inter-token gaps of ``gap_s`` (one decode step emits one per sequence)."""
        if count > 0:
            self._itl.append(gap_s)
            self._itl_w.append(count)

    @property
    def balance_ratio(self) -> float | None:
        return self._w_ratio / self._w if self._w > 0 else None

    @property
    def idle_forward_fraction(self) -> float | None:
        return self._idle_rank_steps / self._work_rank_steps if self._work_rank_steps else None

    @property
    def throughput(self) -> float | None:
        if self.first_t is None or self.last_t is None:
            return None
        return throughput(self.output_tokens, self.first_t, self.last_t)

    def summary(self) -> dict[str, float | None]:
        """The measures by name; None for each one without data."""
        out: dict[str, float | None] = {
            "balance_ratio": self.balance_ratio,
            "idle_forward_fraction": self.idle_forward_fraction,
            "throughput_tok_s": self.throughput,
        }
        for name, vals, w in (("ttft", self.ttft, None), ("e2e", self.e2e, None),
                              ("itl", self._itl, self._itl_w)):
            for k, v in percentiles(vals, weights=w).items():
                out[f"{name}_{k}_ms"] = None if math.isnan(v) else v * 1000.0
        return out

    def reset(self) -> None:
        fresh = MeasureAccumulator()
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(fresh, f))
