"""What the api-servers admitted since the scheduler last measured its queue (the admission
bound's blind second; admission.py): this replica's own admissions, and every replica's
as counted in Redis."""

from __future__ import annotations

from collections import deque

BUCKET_S = 0.25   # the group's count is kept in buckets this long: a figure's own bucket
                  # counts whole, so at most this much of what it holds is counted twice


def bucket_of(t: float) -> int:
    """The bucket of wall-clock time ``t`` (epoch s): part of its Redis key (shared/keys.py)."""
    return int(t // BUCKET_S)


class RecentAdmissions:
    """The prompt tokens and requests admitted after the scheduler measured its queue: they
    wait behind that queue, but the figure, read once a second, does not show them yet. A
    burst inside that second was admitted whole up to ``max_inflight`` (10,000 requests at
    once on 4 CPU ranks: 8,192 admitted, over an hour's work behind a 60 s bound,
    2026-12-07). Each is counted until a figure measured after it is read; none kept
    longer than ``horizon_s`` (a figure that old is no figure).

    Two counts, the larger of which is the answer (:attr:`tokens`, :attr:`requests`). This
    replica's own, to the request. And the group's: every replica adds what it admitted to
    a Redis hash of its ``BUCKET_S`` bucket in each submit round trip, whose reply (and the
    heartbeat's read of the recent buckets) says what all of them admitted. A burst split
    over N replicas, each counting only its own, could be admitted N times over. What this
    replica admitted since its last reply, the others are taken to have admitted as much
    of (``replicas``): a burst reaches every replica in the same moment, before any reply
    (3,000 requests at once on 2 replicas: each admitted 1,500, twice the bound's worth,
    with its own count alone). Pure: time passed in."""

    __slots__ = ("horizon_s", "replicas", "_own", "_q", "_group", "_floor", "_unsent", "_sending")

    def __init__(self, horizon_s: float, replicas: int = 1) -> None:
        self.horizon_s = horizon_s
        self.replicas = replicas                      # the api-servers sharing the group's queue
        self._own = [0, 0]                            # tokens, requests: the sums of what _q holds
        self._q: deque[tuple[float, int, int]] = deque()   # (when, prompt tokens, requests), oldest first
        self._group: dict[int, tuple[int, int]] = {}  # bucket -> every replica's (tokens, requests), as last read
        self._floor = 0                               # the oldest bucket a figure could miss
        self._unsent = [0, 0]                         # this replica's, not yet added to the group's count
        self._sending = [0, 0]                        # added in a round trip not yet answered

    @property
    def tokens(self) -> int:
        """Prompt tokens admitted since the last figure (by this replica, or by all as far
        as known, whichever is more)."""
        return self._since(0)

    @property
    def requests(self) -> int:
        """Requests (sequences: each choice of each prompt) admitted since the last figure."""
        return self._since(1)

    def _since(self, i: int) -> int:
        group = sum(v[i] for b, v in self._group.items() if b >= self._floor)
        # this replica's not yet in the group's count (since the figure, if at all), and as
        # much again from each other replica
        unconfirmed = min(self._own[i], self._unsent[i] + self._sending[i])
        return max(self._own[i], group + unconfirmed * max(1, self.replicas))

    def add(self, tokens: int, now: float, requests: int = 1) -> None:
        self._expire(now)
        self._q.append((now, tokens, requests))
        for acc in (self._own, self._unsent):
            acc[0] += tokens
            acc[1] += requests

    def measured(self, at: float) -> None:
        """A queue figure measured at ``at`` (epoch s) is in: what was admitted before it is in it."""
        self._pop(at)
        self._raise_floor(bucket_of(at))

    def take_unsent(self) -> tuple[int, int]:
        """This replica's (tokens, requests) not yet in the group's count, to add in the next
        round trip."""
        tokens, requests = self._unsent
        self._unsent = [0, 0]
        self._sending[0] += tokens
        self._sending[1] += requests
        return tokens, requests

    def sent(self, added: tuple[int, int], bucket: int | None = None,
             totals: tuple[int, int] | None = None) -> None:
        """The round trip that added ``added`` is answered: ``bucket`` now holds ``totals``
        (None: the add failed; this replica's own count still holds them)."""
        self._sending = [max(0, s - a) for s, a in zip(self._sending, added)]
        if bucket is not None and totals is not None:
            self.group_read({bucket: totals})

    def group_read(self, totals: dict[int, tuple[int, int]], now: float | None = None) -> None:
        """Every replica's (tokens, requests) by bucket, as read from Redis (counts only
        grow: an older read answered late never lowers one)."""
        if now is not None:
            self._expire(now)
        for b, v in totals.items():
            if b >= self._floor:
                old = self._group.get(b, (0, 0))
                self._group[b] = (max(old[0], v[0]), max(old[1], v[1]))

    def _expire(self, now: float) -> None:
        oldest = now - self.horizon_s
        self._pop(oldest)
        self._raise_floor(bucket_of(oldest))

    def _pop(self, at: float) -> None:
        q, own = self._q, self._own
        while q and q[0][0] <= at:
            _, tokens, requests = q.popleft()
            own[0] -= tokens
            own[1] -= requests

    def _raise_floor(self, floor: int) -> None:
        if floor > self._floor:
            self._floor = floor
            self._group = {b: v for b, v in self._group.items() if b >= floor}
