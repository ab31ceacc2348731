"""The sizes of the group's last prompts, kept sorted for a quantile: how long the longest
recent prompts are, which sets how long a shorter one may wait for company (rank_step.py,
docs/benchmarks.md "How the default decides", item 3). Every rank fills its window from the
same rows, so every rank holds the same window. Pure."""

from __future__ import annotations

import bisect
from collections import deque

# fewer samples than this say nothing about the longest 1 % (one rank's own ~100 prompts
# did not: on log-normal prompts its 99th percentile was its largest one or two, and it
# lengthened waits where no long prompts were)
MIN_SAMPLES = 100


class PromptWindow:
    """The last ``size`` prompt lengths (tokens), in arrival order and sorted."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a prompt window holds at least one prompt")
        self.size = size
        self._fifo: deque[int] = deque()
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._fifo)

    def add(self, tokens: int) -> None:
        """One prompt arrived (O(size): a rank sees a prompt per many steps)."""
        bisect.insort(self._sorted, tokens)
        self._fifo.append(tokens)
        if len(self._fifo) > self.size:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def add_many(self, tokens: int, count: int) -> None:
        """``count`` prompts of ``tokens`` each (more than the window holds count as a full window)."""
        for _ in range(min(count, self.size)):
            self.add(tokens)

    def quantile(self, q: float) -> int | None:
        """The ``q`` quantile of the window (the sample at rank ``q`` x n), or None while it
        holds fewer than ``min(MIN_SAMPLES, size)`` prompts."""
        xs = self._sorted
        if len(xs) < min(MIN_SAMPLES, self.size):
            return None
        return xs[min(len(xs) - 1, int(q * len(xs)))]
