"""The scheduler queue's wait, published with each snapshot for the api-servers'
admission bound (``max_queue_wait_s``, services/api_server/admission.py): how long the
oldest unplaced request has waited, and how long a request arriving now would wait. Pure:
time passed in; step_publisher.py feeds it."""

from __future__ import annotations

from typing import Any

from shared.rate_meter import RateMeter


def queue_wait_ms(policy: Any, now: float) -> int:
    """How long the longest-waiting unplaced request has waited here (0 when none): the
    api-servers answer 429 while it is above their ``max_queue_wait_s``."""
    oldest = getattr(policy, "oldest_unplaced", None)
    t = oldest() if oldest is not None else None
    return 0 if t is None else max(0, int((now - t) * 1000))


PLACEMENT_WINDOW_S = 5.0   # the placement rate behind the ETA: steadier than a step, quicker than a trend


def queue_eta_ms(unplaced: int, placed_per_s: float, head_wait_ms: int) -> int:
    """How long a request arriving now would wait unplaced: what is ahead of it over the
    rate the ranks take it (measured; :class:`QueueEta` gives both in prompt tokens). This
    is the figure the api-servers' ``max_queue_wait_s`` bounds. The head's own wait (how
    long the oldest has waited) looks back: above capacity it passes the bound only after
    the queue holds more than the bound's worth, and falls back under it only once refusing
    every request has emptied the queue, so admission swung between all and nothing with
    TTFT at about twice the bound (the load probe, 2026-12-05). With under one unit placed
    in the measuring window (the ranks took nothing lately, or the rate is what is left of
    one from long ago) there is no rate to divide by: the head's wait is the figure."""
    if unplaced <= 0:
        return 0
    if placed_per_s * PLACEMENT_WINDOW_S < 1.0:
        return head_wait_ms
    return int(unplaced / placed_per_s * 1000)


class QueueEta:
    """The queue's ETA: the prompt tokens waiting over the prompt tokens/s the ranks took
    *while requests waited*. Two ways a plain placements/s misled (live, 8 sim ranks at 1.2x
    capacity, a burst of 300 requests: an ETA of 57-80 s published for a queue that was gone
    in 16 s, and up to 9 of 600 requests refused with a 429, 2026-12-06):
    - with headroom the ranks take requests as they arrive, so placements are the arrival
      rate, whatever the ranks could take; a burst after a quiet spell met the quiet rate.
      So the meter starts when a backlog does and ends with it, and until the backlog has
      lasted a whole ``window_s`` the figure is the head's wait (a backlog that young is
      under ``window_s`` old: no bound above that refuses);
    - a burst is placed longest prompt first, so its first seconds place a few long prompts
      and read few requests/s. What a rank takes is prefill work, so the ETA counts prompt
      tokens, ahead and per second.
    Units are the caller's (requests where a policy does not count tokens). Pure: time
    passed in."""

    __slots__ = ("window_s", "_since", "_meter", "_seen")

    def __init__(self, window_s: float = PLACEMENT_WINDOW_S) -> None:
        self.window_s = window_s
        self._since: float | None = None    # when the current backlog began
        self._meter: RateMeter | None = None
        self._seen: int | None = None       # the placed counter at the last observation

    def observe(self, placed_total: int, waiting: int, now: float) -> None:
        """Record what was placed so far (a running total) and what waits, at ``now``."""
        new = 0 if self._seen is None else max(0, placed_total - self._seen)
        self._seen = placed_total
        if waiting <= 0:
            self._since = self._meter = None
            return
        if self._meter is None:   # a backlog begins: what was placed before it says nothing of the ranks
            self._since, self._meter = now, RateMeter(self.window_s)
            self._meter.add(0, now)
            return
        self._meter.add(new, now)

    def eta_ms(self, waiting: int, head_wait_ms: int, now: float, most_per_s: float | None = None,
               requests: int = 0, most_rps: float | None = None) -> int:
        """``most_per_s``: the most the ranks could take a second (:func:`full_step_prefill_tps`,
        in this meter's units), or None. A backlog younger than the window is not measured
        yet, but it cannot drain faster than that: of a burst of 10,000 requests on 4 CPU
        ranks 8,192 were admitted, over an hour's work, because the head had waited only
        seconds (2026-12-07). Nor can its ``requests`` go faster than the ranks' slots
        let requests finish (``most_rps``, :func:`full_step_seq_rps`): short prompts wait
        for a slot, not for prompt tokens."""
        if waiting <= 0:
            return 0
        least = max(least_wait_ms(waiting, most_per_s), least_wait_ms(requests, most_rps))
        if self._since is None or self._meter is None or now - self._since < self.window_s:
            return max(head_wait_ms, least)
        return max(queue_eta_ms(waiting, self._meter.rate(now), head_wait_ms), least)


def least_wait_ms(waiting: float, most_per_s: float | None) -> int:
    """How long ``waiting`` takes at the most the ranks can take a second (0 when unknown)."""
    return int(waiting / most_per_s * 1000) if most_per_s else 0


def full_step_prefill_tps(snap: Any) -> float | None:
    """The prompt tokens/s the group computes in full steps: each rank's ``prefill_tps`` (its
    full-step rate, step_clock.py ``full_rate_tps``; engine_worker/outputs.py),
    summed, a rank that has measured none counted at the others' mean. The most any backlog
    drains at. None until a rank has measured a full step (or with coordinated prefill off,
    where no rank measures one)."""
    return _summed(snap, "prefill_tps")


def full_step_seq_rps(snap: Any) -> float | None:
    """The requests/s the group's sequence slots let it finish: each rank's ``seq_rps``
    (engine_worker/slot_turnover.py), summed the same way (None until a rank has finished
    a request and knows a full step's time)."""
    return _summed(snap, "seq_rps")


def _summed(snap: Any, field: str) -> float | None:
    """The ranks' ``field`` (a rate in their report's extra) summed, a rank that has
    measured none counted at the others' mean; None when none has."""
    if snap is None or not snap.ranks:
        return None
    rates = [float(v) for v in (r.extra.get(field) for r in snap.ranks.values())
             if isinstance(v, (int, float)) and v > 0]
    return sum(rates) / len(rates) * len(snap.ranks) if rates else None


class RanksQueueEta:
    """How long a request would wait in the ranks' own queues before its prefill starts: the
    prompt tokens waiting or mid-prefill there over the prompt tokens/s the ranks computed
    while requests waited, by the same rules as :class:`QueueEta` (measured only while a
    backlog lasts; nothing until it has lasted ``window_s``). Where requests are placed at
    once (client-dispatch mode, ``least_score``, ``least_tokens``, ``round_robin``) the
    whole queue is there and the scheduler's own ETA stays 0: the admission bound never
    refused, and TTFT grew with the queue to ``replicas x max_inflight / capacity``.
    Under ``waterfill`` the ranks hold about two steps: a few hundred ms."""

    __slots__ = ("_eta", "_computed")

    def __init__(self, window_s: float = PLACEMENT_WINDOW_S) -> None:
        self._eta = QueueEta(window_s)
        self._computed = 0    # prompt tokens the ranks computed, a running total

    def update(self, snaps: list[Any], now: float, most_per_s: float | None = None,
               most_rps: float | None = None) -> int:
        """Take the snapshots finalized since the last call (oldest first); the ETA in ms
        (``most_per_s``: the group's full-step prompt tokens/s, ``most_rps`` the requests/s
        its slots let it finish, as for :class:`QueueEta`)."""
        for snap in snaps:   # a carried rank's row is an old report again: counted once
            self._computed += sum(r.prefill for rank, r in snap.ranks.items() if rank not in snap.carried)
        newest = snaps[-1].ranks.values() if snaps else ()
        queued = sum(r.waiting for r in newest)
        self._eta.observe(self._computed, queued, now)
        return self._eta.eta_ms(sum(r.prefill_pending for r in newest) if queued else 0, 0, now, most_per_s,
                                queued, most_rps)
