"""What an api-server admitted since the scheduler last measured its queue (the admission
bound's blind second; admission.py)."""

from __future__ import annotations

from collections import deque


class RecentAdmissions:
    """The prompt tokens this replica admitted after the scheduler measured its queue: they
    wait behind that queue, but the figure, read once a second, does not show them yet. A
    burst inside that second was admitted whole up to ``max_inflight`` (10,000 requests at
    once on 4 CPU ranks: 8,192 admitted, over an hour's work behind a 60 s bound,
    2026-12-07). Each is counted until a figure measured after it is read; none kept
    longer than ``horizon_s`` (a figure that old is no figure). Pure: time passed in."""

    __slots__ = ("horizon_s", "tokens", "_q")

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.tokens = 0                               # the sum of what _q holds
        self._q: deque[tuple[float, int]] = deque()   # (when, prompt tokens), oldest first

    def add(self, tokens: int, now: float) -> None:
        self.measured(now - self.horizon_s)
        self._q.append((now, tokens))
        self.tokens += tokens

    def measured(self, at: float) -> None:
        """A queue figure measured at ``at`` (epoch s) is in: what was admitted before it is in it."""
        q = self._q
        while q and q[0][0] <= at:
            self.tokens -= q.popleft()[1]
