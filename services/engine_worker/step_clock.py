"""What a full step costs on this engine, measured. Pure: durations passed in.

The waits of coordinated prefill (how long a prefill may wait for other ranks to share its
step) are worth what an unbalanced prefill step costs, and that is the engine's: on the
simulator's default profile a full 2,048-token step takes ~131 ms, on the
``deepseek-v3-gb200`` profile a full 4,608-token step ~525 ms. So the waits are set in full
steps and turned into milliseconds with this estimate: a least-squares line through the
recent steps' (busiest rank's tokens, duration), evaluated at ``max_tokens``. In the
simulator the best waits were the same number of full steps on both profiles (1.5 and 23:
200 ms / 3 s on the default profile, ~800 ms / 12 s on gb200; docs/benchmarks.md).

Recent: the sums decay with a half-life of ``halflife_steps``. A line needs steps of
different sizes; while the recent steps are all about the same size (a long run of decode
steps, whose noise alone would give any slope) the last good fit stands, and before any
fit there is no estimate (0.0: the caller keeps its waits in milliseconds).
"""

from __future__ import annotations

MIN_SPREAD = 0.05   # the fit needs step sizes whose spread is at least this share of a full step


class StepClock:
    __slots__ = ("max_tokens", "_decay", "_s0", "_sx", "_sy", "_sxx", "_sxy", "_fit", "_slope")

    def __init__(self, max_tokens: int, halflife_steps: float = 2000.0) -> None:
        if max_tokens < 1 or halflife_steps <= 0:
            raise ValueError("max_tokens must be >= 1 and halflife_steps > 0")
        self.max_tokens = int(max_tokens)
        self._decay = 0.5 ** (1.0 / halflife_steps)
        self._s0 = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._fit = 0.0     # the last well-conditioned estimate (0.0: none yet)
        self._slope = 0.0   # its ms per token

    def observe(self, tokens: int, dur_ms: float) -> None:
        """A step whose busiest rank computed ``tokens`` took ``dur_ms``."""
        if tokens <= 0 or dur_ms <= 0:
            return
        x, y, k = float(min(tokens, self.max_tokens)), float(dur_ms), self._decay
        self._s0 = self._s0 * k + 1.0
        self._sx = self._sx * k + x
        self._sy = self._sy * k + y
        self._sxx = self._sxx * k + x * x
        self._sxy = self._sxy * k + x * y
        mx = self._sx / self._s0
        var = self._sxx / self._s0 - mx * mx
        if var < (MIN_SPREAD * self.max_tokens) ** 2:
            return
        slope = max(0.0, (self._sxy / self._s0 - mx * self._sy / self._s0) / var)
        fixed = max(0.0, self._sy / self._s0 - slope * mx)
        self._fit = fixed + slope * self.max_tokens
        self._slope = slope

    @property
    def token_ms(self) -> float:
        """What one more token in the busiest rank adds to a step, in ms (0.0 until the steps
        allow a fit)."""
        return self._slope

    @property
    def full_step_ms(self) -> float:
        """The estimated duration of a ``max_tokens`` step (0.0 until the steps allow a fit)."""
        return self._fit
