"""A rate (amount per second) averaged over ``tau_s`` with exponential decay, read over the
time it has had: a meter that started a second ago reads what arrived in that second as
its rate, not as that amount spread over the whole window (a new engine's first burst is
not a quiet group). The prompt tokens/s behind coordinated prefill's lone share
(rank_step.py). Pure: time passed in."""

from __future__ import annotations

import math


class RateMeter:
    __slots__ = ("tau_s", "_sum", "_t", "_t0")

    def __init__(self, tau_s: float) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be > 0")
        self.tau_s = tau_s
        self._sum = 0.0                 # decayed amount, divided by tau_s
        self._t: float | None = None    # last update
        self._t0 = 0.0                  # first update

    def add(self, amount: float, now_s: float) -> None:
        if self._t is None:
            self._t = self._t0 = now_s
        self._sum = self._decayed(now_s) + amount / self.tau_s
        self._t = now_s

    def rate(self, now_s: float) -> float:
        """Amount per second at ``now_s`` (0.0 before anything was added). Read over at
        least a tenth of the window, so one arrival at the start is not an infinite rate."""
        if self._t is None:
            return 0.0
        seen = max(now_s - self._t0, 0.1 * self.tau_s)
        return self._decayed(now_s) / -math.expm1(-seen / self.tau_s)

    def _decayed(self, now_s: float) -> float:
        return self._sum * math.exp(-max(0.0, now_s - (self._t if self._t is not None else now_s)) / self.tau_s)
