"""What a full step costs on this engine, and which part of it a lone prefill wastes,
measured. Pure: durations passed in.

The waits of coordinated prefill (how long a prefill may wait for other ranks to share its
step) are worth what an unbalanced prefill step costs, and that is the engine's: on the
simulator's default profile a full 2,048-token step takes ~131 ms, on the
``deepseek-v3-gb200`` profile a full 4,608-token step ~525 ms. So the waits are set in full
steps and turned into milliseconds with this estimate. In the simulator the best waits were
the same number of full steps on both profiles (1.5 and 23: 200 ms / 3 s on the default
profile, ~800 ms / 12 s on gb200; docs/benchmarks.md).

The estimate is a least-squares plane through the recent steps' (busiest rank's tokens,
ranks' mean tokens, duration):

    step_ms = fixed + token_ms * max_tokens + shared_ms * mean_tokens

``token_ms`` is the part only the busiest rank computes: what the other ranks idle through
when one rank prefills alone, and all that running prefills together can save.
``shared_ms`` follows the group's total: experts that compute every rank's tokens, or ranks
that share one device or CPU (4 torch ranks on 2 cores: a 2,048-token prefill alone took
~200 ms there, on every rank at once ~620 ms, so waiting for company saved nothing). Only
steps whose busiest and mean tokens vary apart tell the two parts apart (with one rank
prefilling at a time they move together), and a shared part counts only where it stands
well clear of the durations' noise (four standard errors) and is a quarter of a token's
cost or more; until then the fit is a line through the busiest rank's tokens alone
(``shared_ms`` 0), as on a device where each rank is its own.

Recent: the sums decay with a half-life of ``halflife_steps``. A fit needs steps of
different sizes; while the recent steps are all about the same size (a long run of decode
steps, whose noise alone would give any slope) the last good fit stands, and before any
fit there is no estimate (0.0: the caller keeps its waits in milliseconds).
"""

from __future__ import annotations

MIN_SPREAD = 0.05   # a fit needs step sizes whose spread is at least this share of a full step
MIN_T = 4.0         # a shared part counts from this many standard errors
MIN_SHARED = 0.25   # and from this share of a token's cost: the context's cost, not in the
                    # fit, fakes 1-12 % in the simulator, and a smaller part would move the
                    # lone share (rank_step.py) too little to change a decision
SMALL_AFTER = 16    # steps with no fit, whose busiest rank computed under SMALL_SHARE of a
SMALL_SHARE = 0.25  # full step (mean + 2 spreads): its prefills are small (``small_steps``)


class StepClock:
    __slots__ = ("max_tokens", "_decay", "_n", "_w2", "_x", "_m", "_y", "_xx", "_mm", "_xm", "_xy", "_my",
                 "_yy", "_fit", "_slope", "_shared", "_seen", "_best_tps", "prior_ms")

    def __init__(self, max_tokens: int, halflife_steps: float = 2000.0) -> None:
        if max_tokens < 1 or halflife_steps <= 0:
            raise ValueError("max_tokens must be >= 1 and halflife_steps > 0")
        self.max_tokens = int(max_tokens)
        self._decay = 0.5 ** (1.0 / halflife_steps)
        # decayed sums of 1, x (busiest tokens), m (mean tokens), y (ms) and their products
        self._n = self._w2 = self._x = self._m = self._y = 0.0
        self._xx = self._mm = self._xm = self._xy = self._my = self._yy = 0.0
        self._fit = 0.0     # the last well-conditioned estimate of a full step (0.0: none yet)
        self._slope = 0.0   # its busiest-rank ms per token
        self._shared = 0.0  # its ms per token of the ranks' mean
        self._seen = 0      # steps observed
        self._best_tps = 0.0   # the most tokens/s a rank computed in a step of half a full step or more
        # a full step as the engine's own model says, before any is measured (the sim's cost
        # model; 0.0: none): a burst on a cluster that had served nothing was admitted whole
        self.prior_ms = 0.0

    def observe(self, tokens: int, dur_ms: float, mean_tokens: float | None = None) -> None:
        """A step whose busiest rank computed ``tokens`` (the ranks ``mean_tokens`` on
        average; None: as many as the busiest) took ``dur_ms``."""
        if tokens <= 0 or dur_ms <= 0:
            return
        cap = self.max_tokens
        self._seen += 1
        x, y, k = float(min(tokens, cap)), float(dur_ms), self._decay
        m = x if mean_tokens is None else float(min(max(mean_tokens, 0.0), x))
        if 2 * m >= cap:
            self._best_tps = max(self._best_tps, m * 1000.0 / y)
        self._n = self._n * k + 1.0
        self._w2 = self._w2 * k * k + 1.0
        self._x = self._x * k + x
        self._m = self._m * k + m
        self._y = self._y * k + y
        self._xx = self._xx * k + x * x
        self._mm = self._mm * k + m * m
        self._xm = self._xm * k + x * m
        self._xy = self._xy * k + x * y
        self._my = self._my * k + m * y
        self._yy = self._yy * k + y * y
        n = self._n
        mx, mm, my = self._x / n, self._m / n, self._y / n
        vx = self._xx / n - mx * mx
        floor = (MIN_SPREAD * cap) ** 2
        if vx < floor:
            return
        vm = self._mm / n - mm * mm
        cxm = self._xm / n - mx * mm
        cxy = self._xy / n - mx * my
        cmy = self._my / n - mm * my
        slope, shared = cxy / vx, 0.0
        apart = vm - cxm * cxm / vx   # the variance of the mean tokens the busiest do not explain
        if apart > 1.0:
            det = vx * vm - cxm * cxm
            a, b = (cxy * vm - cmy * cxm) / det, (cmy * vx - cxy * cxm) / det
            noise = max(0.0, self._yy / n - my * my - a * cxy - b * cmy)   # the plane's residual variance
            if (b > 0 and b > MIN_SHARED * (a + b)
                    and b * b * apart * (n * n / self._w2) >= MIN_T * MIN_T * noise):
                slope, shared = a, b
                if a < 0:   # all of it shared
                    slope, shared = 0.0, cmy / vm
        slope, shared = max(0.0, slope), max(0.0, shared)
        fixed = max(0.0, my - slope * mx - shared * mm)
        self._fit = fixed + (slope + shared) * cap
        self._slope = slope
        self._shared = shared

    @property
    def token_ms(self) -> float:
        """What one more token in the busiest rank alone adds to a step, in ms: the part of
        a lone prefill the other ranks idle through (0.0 until the steps allow a fit)."""
        return self._slope

    @property
    def shared_ms(self) -> float:
        """What one more token of the ranks' mean adds to a step, in ms (0.0 until the steps
        tell it apart from ``token_ms``)."""
        return self._shared

    @property
    def full_step_ms(self) -> float:
        """The estimated duration of a step in which every rank computes ``max_tokens``
        (0.0 until the steps allow a fit)."""
        return self._fit

    @property
    def fixed_ms(self) -> float:
        """The part of a step no token adds to (launches, collectives), in ms: the fit's
        intercept (0.0 before a fit)."""
        if self._fit <= 0:
            return 0.0
        return max(0.0, self._fit - (self._slope + self._shared) * self.max_tokens)

    @property
    def full_rate_tps(self) -> float:
        """The tokens/s a rank computes in full steps: ``max_tokens`` over the fitted full
        step; before a fit, the fastest step in which the ranks computed half a full step or
        more; before either, the engine's own model of a full step (``prior_ms``; 0.0: none
        of these yet). The most a backlog drains at. Before a fit only: a fast big step seen
        once says little of a loaded host (4 torch ranks on 2 CPU cores: 6,300 tokens/s in
        one step, 530 fitted once every core was busy)."""
        if self._fit > 0:
            return self.max_tokens * 1000.0 / self._fit
        if self._best_tps > 0 or self.prior_ms <= 0:
            return self._best_tps
        return self.max_tokens * 1000.0 / self.prior_ms

    @property
    def small_steps(self) -> bool:
        """No fit yet, and none likely: ``SMALL_AFTER`` steps in which the busiest rank
        computed a small share of a full step (short prompts among decodes never spread the
        steps enough for a fit). A small prefill here costs the other ranks little, whatever
        a token costs: the callers need no estimate to know a wait for company is not worth
        its delay (rank_step.py). (Without this the waits stayed at their milliseconds
        before a fit, 200 ms on every first token of a chat-sized workload, at every load.)"""
        if self._fit > 0 or self._seen < SMALL_AFTER:
            return False
        n = self._n
        mx = self._x / n
        spread = max(0.0, self._xx / n - mx * mx) ** 0.5
        return mx + 2 * spread < SMALL_SHARE * self.max_tokens
