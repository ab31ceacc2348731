"""Step finalization: turn per-rank, step-tagged reports into step-consistent snapshots.

Every DP rank reports its stats after each step, tagged with ``(wave, step)``. The ranks run
in lockstep, so they all go through the same ``(wave, step)`` sequence, but their reports
reach the scheduler in any order, some late, some twice, some never. This object decides
when a step is *final* and what the published snapshot of it contains (DESIGN §5):

* A step is final when every live rank has reported it, or as soon as a *newer* step is
  final (the older one is superseded: at most one snapshot per step, never an older one),
  or ``grace_s`` after the step's first report. Ranks missing from a final step are
  *carried*: the snapshot holds their newest report older than the step, and lists them
  in ``Snapshot.carried``.
* Order is judged **per rank**, never by one global clock. A report older than the same
  rank's previous report is stale (``stale_dropped``); one equal to it is a duplicate
  (``duplicates``). A slower rank's report for a step that is already final is *valid*:
  it becomes that rank's freshest data for the next snapshot (``late``). vLLM judged
  order with one global (wave, step) and called such reports out of order (#52936).
* A rank whose newest report is for a step *after* a pending step has moved past it (its
  report for that step was lost or arrived out of its own order): it is not waited for.
* Waves reset step counters; ``(wave, step)`` tuples compare lexicographically, which is
  all the ordering needs.
* Liveness comes from outside (heartbeats): :meth:`set_live`. A dead rank is forgotten and
  its later reports are dropped (``not_live``). A rank that *joins* a running cluster is not
  waited for until its first report, so a new rank can never hold finalization back.
  Ranks passed to the constructor (or joining an empty cluster) are waited for from the
  start, bounded by the grace period.
* A rank's new incarnation (another process took its slot: :meth:`restarted`) starts a
  new sequence of reports, judged from its first one, as a joining rank's. Where every
  live rank is new (restarted, or live again after it was dead), the group's counters may
  have gone back (every rank died at once and Redis lost what they recorded; the engines
  otherwise continue them): the final step is forgotten too, so their steps are published
  rather than read as stale or late.
* ``min_interval_s`` rate-limits publication: a step finalized too soon after the last
  publication waits (``ready``); a newer one replaces it (``coalesced``); the ready one is published
  by :meth:`tick` at :meth:`next_deadline`.

Pure: no I/O and no clock; every call takes ``now`` (seconds, any monotonic origin).
The cost is O(1) per report plus O(ranks) per finalized step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.stats import RankStats, Snapshot

Key = tuple[int, int]  # (wave, step)
_BEFORE_ALL: Key = (-(1 << 62), 0)  # older than any real (wave, step)


@dataclass(slots=True)
class _Pending:
    """A step some rank has reported and that is not final yet."""

    key: Key
    first: float                  # when its first report arrived: the grace period starts here
    reports: dict[int, RankStats]
    have: int                     # required ranks that reported this step or moved past it


class StepAggregator:
    """Collects step-tagged reports and publishes one snapshot per finalized step."""

    def __init__(self, ranks: Iterable[int], grace_s: float = 0.05, min_interval_s: float = 0.0) -> None:
        if grace_s < 0 or min_interval_s < 0:
            raise ValueError("grace_s and min_interval_s must be >= 0")
        self.grace_s = float(grace_s)
        self.min_interval_s = float(min_interval_s)
        self._live: set[int] = set(ranks)
        self._live_sorted: list[int] = sorted(self._live)
        self._joining: set[int] = set()          # live, not heard from since joining: not waited for
        self._required = len(self._live)         # live ranks waited for: len(live - joining)
        self._last_key: dict[int, Key] = {}      # rank -> key of its newest accepted report
        self._base: dict[int, RankStats] = {}    # rank -> its newest report at or before the final step
        self._pending: dict[Key, _Pending] = {}
        self._oldest_first = float("inf")       # earliest `first` among pending steps
        self._final_key: Key | None = None
        self._fresh: set[int] = set()            # live ranks new since the final step (restarted or back)
        self._ready: Snapshot | None = None      # final, waiting out min_interval_s
        self._last_pub_t = float("-inf")
        # counters (shown by `lockstep status --json` and /metrics)
        self.reports = 0          # reports fed in
        self.accepted = 0         # reports newer than their rank's previous one
        self.stale_dropped = 0    # older than the same rank's previous report
        self.duplicates = 0       # same (wave, step) as the same rank's previous report
        self.not_live = 0         # from a rank outside the live set
        self.late = 0             # valid, but for a step already final: kept for the next snapshot
        self.finalized = 0        # steps finalized (published or coalesced)
        self.grace_expired = 0    # of those, finalized by the grace period with ranks missing
        self.superseded = 0       # pending steps skipped because a newer step became final
        self.carried_total = 0    # sum over finalized steps of len(Snapshot.carried)
        self.coalesced = 0        # finalized snapshots replaced before min_interval_s let them out
        self.published = 0        # snapshots returned to the caller
        self.restarts = 0         # times every live rank was new and the sequence began again

    # ---------------------------------------------------------------- queries

    @property
    def final_key(self) -> Key | None:
        """The newest finalized (wave, step), published or not."""
        return self._final_key

    def last_key(self, rank: int) -> Key | None:
        """(wave, step) of the rank's newest accepted report."""
        return self._last_key.get(rank)

    def pending_steps(self) -> int:
        return len(self._pending)

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (
            "reports", "accepted", "stale_dropped", "duplicates", "not_live", "late",
            "finalized", "grace_expired", "superseded", "carried_total", "coalesced", "published", "restarts")}

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must next be called, or None when nothing is waiting."""
        due: float | None = None
        if self._ready is not None:
            due = self._last_pub_t + self.min_interval_s
        required = self._required
        for p in self._pending.values():
            # complete (possible after set_live) -> due at once; else at grace expiry
            t = p.first if p.have >= required else p.first + self.grace_s
            if due is None or t < due:
                due = t
        return due

    # ---------------------------------------------------------------- inputs

    def report(self, stats: RankStats, now: float) -> Snapshot | None:
        """Feed one rank's report. Returns the snapshot published at ``now``, if any."""
        self.reports += 1
        r = stats.rank
        if r not in self._live:
            self.not_live += 1
            return self._advance(now)
        key = (stats.wave, stats.step)
        prev = self._last_key.get(r)
        if prev is None:
            prev = _BEFORE_ALL
            if r in self._joining:  # first word from a joining rank: wait for it from now on
                self._joining.discard(r)
                self._required += 1
        elif key <= prev:
            if key == prev:
                self.duplicates += 1
            else:
                self.stale_dropped += 1
            return self._advance(now)
        self.accepted += 1
        self._last_key[r] = key
        fk = self._final_key
        if fk is not None and key <= fk:
            # In order for this rank, but its step is already final (the rank was carried).
            # Every pending step is newer than fk, so no pending count changes.
            self._base[r] = stats
            self.late += 1
            return self._advance(now)
        # The rank now counts for every pending step in (prev, key]: reported or moved past.
        required = self._required
        complete = False
        for p in self._pending.values():
            if prev < p.key <= key:
                p.have += 1
                if p.have >= required:
                    complete = True
        p = self._pending.get(key)
        if p is None:
            have = sum(1 for k in self._last_key.values() if k >= key)  # includes this rank
            p = self._pending[key] = _Pending(key, now, {}, have)
            if have >= required:
                complete = True
            if now < self._oldest_first:
                self._oldest_first = now
        p.reports[r] = stats
        # fast path: nothing complete, nothing past its grace, nothing ready
        if not complete and self._ready is None and now < self._oldest_first + self.grace_s:
            return None
        return self._advance(now)

    def tick(self, now: float) -> Snapshot | None:
        """Finalize what the grace period lets go and publish what min_interval_s lets out."""
        return self._advance(now)

    def set_live(self, ranks: Iterable[int]) -> None:
        """Replace the live set. Dead ranks are forgotten; joining ranks are not waited for
        until they first report. A step that only waited for a now-dead rank becomes due:
        :meth:`next_deadline` says so and the next :meth:`tick` finalizes it."""
        new = set(ranks)
        cold = not self._live
        if self._final_key is not None:
            self._fresh |= new - self._live     # back from the dead: its reports may begin anew
        for r in self._live - new:
            self._last_key.pop(r, None)
            self._base.pop(r, None)
            self._joining.discard(r)
            for p in self._pending.values():
                p.reports.pop(r, None)
        if not cold:
            self._joining |= new - self._live
        self._live = new
        self._fresh &= new
        self._begin_again_if_all_fresh()
        self._live_sorted = sorted(new)
        self._joining &= new
        self._recount()

    def restarted(self, rank: int) -> None:
        """Another process now holds ``rank``: forget its reports and wait for it again
        from its first one. Once every live rank is new, begin the sequence again."""
        if rank not in self._live:
            return
        self._last_key.pop(rank, None)
        self._base.pop(rank, None)
        for p in self._pending.values():
            p.reports.pop(rank, None)
        self._joining.add(rank)
        self._fresh.add(rank)
        self._begin_again_if_all_fresh()
        self._recount()

    def _recount(self) -> None:
        """The ranks waited for, and each pending step's count of them, after the live or
        joining set changed."""
        self._required = len(self._live) - len(self._joining)
        for p in self._pending.values():
            p.have = sum(1 for r, k in self._last_key.items() if k >= p.key and r not in self._joining)

    def _begin_again_if_all_fresh(self) -> None:
        """Every live rank new (restarted, or back after it was dead): nobody's reports
        continue the old sequence, which may be ahead of theirs. Forget its final step."""
        if self._live and self._live <= self._fresh:
            self._final_key = None
            self._pending.clear()
            self._oldest_first = float("inf")
            self._fresh.clear()
            self.restarts += 1

    # ---------------------------------------------------------------- internals

    def _advance(self, now: float) -> Snapshot | None:
        if self._pending:
            required = self._required
            best: _Pending | None = None
            for p in self._pending.values():
                if (p.have >= required or now >= p.first + self.grace_s) and (best is None or p.key > best.key):
                    best = p
            if best is not None:
                self._finalize(best, now, graced=best.have < required)
        ready = self._ready
        if ready is not None and now >= self._last_pub_t + self.min_interval_s:
            self._ready = None
            self._last_pub_t = now
            self.published += 1
            ready.seq = self.published
            return ready
        return None

    def _finalize(self, final: _Pending, now: float, graced: bool) -> None:
        key = final.key
        older = sorted(k for k in self._pending if k <= key)
        base = self._base
        live = self._live
        for k in older:  # oldest first, so base ends with each rank's newest report <= key
            for r, st in self._pending.pop(k).reports.items():
                if r in live:
                    base[r] = st
        self.superseded += len(older) - 1
        self._oldest_first = min((p.first for p in self._pending.values()), default=float("inf"))
        ranks: dict[int, RankStats] = {}
        carried: list[int] = []
        wave, step = key
        for r in self._live_sorted:
            st = base.get(r)
            if st is None:
                continue  # never heard from: nothing to carry
            ranks[r] = st
            if st.step != step or st.wave != wave:
                carried.append(r)
        self._final_key = key
        self.finalized += 1
        self.grace_expired += graced
        self.carried_total += len(carried)
        if self._ready is not None:
            self.coalesced += 1
        self._ready = Snapshot(wave=wave, step=step, t=now, ranks=ranks, carried=tuple(carried))
