"""Is the engine group busy? The prefill pending across its ranks (in full steps), averaged
over ``tau_s`` seconds. Under a sustained backlog the step budget turns throughput-first
(a prefill waits longer for company, docs/benchmarks.md "How the default decides"); with
headroom it stays TTFT-first. Averaged so that one burst does not flip it for a step and
back. Rank 0's verdict rides in its step row (``F_BUSY``), so every rank applies the same
one. Pure: time passed in."""

from __future__ import annotations

import math


class BusyMeter:
    __slots__ = ("level", "tau_s", "avg", "_t")

    def __init__(self, level: float, tau_s: float) -> None:
        self.level = level          # busy at or above this average backlog; 0 = never busy
        self.tau_s = max(tau_s, 1e-3)
        self.avg = 0.0
        self._t: float | None = None

    def observe(self, backlog_steps: float, now_s: float) -> None:
        """The group's pending prefill, in full steps, as of the step at ``now_s``."""
        if self._t is None:
            self.avg = backlog_steps
        else:
            self.avg += (1.0 - math.exp(-max(0.0, now_s - self._t) / self.tau_s)) * (backlog_steps - self.avg)
        self._t = now_s

    @property
    def busy(self) -> bool:
        return 0 < self.level <= self.avg
