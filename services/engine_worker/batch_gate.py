"""Engine side of staggered batches: hold a batch's prefill until every rank has its share.

Pure (no I/O, time passed in). Every step the worker puts two numbers of this rank into
the step collective, and every rank then applies the same rule to the same rows, so the
ranks that share a batch release it in the same step:

* ``complete``: the highest batch number whose share for this rank has fully arrived.
  The scheduler writes batch n before batch n+1 and each inbox is FIFO, so a rank that
  completed n' >= n has also completed every earlier batch it has a share of.
* ``oldest_held``: the oldest batch number this rank still holds (0 = none).

Release of batch n (counts c, known to every rank with a share): when every rank r with
c[r] > 0 reports ``complete >= n`` (at arrival, without an exchange, when the only share is
this rank's own); or when the *leader* (rank 0) has seen the group's
oldest held batch stay held longer than ``timeout_s`` and announces ``release <= n`` in its
row of the next collective. Only one rank decides the timeout, so ranks can never disagree
(a per-rank timer would let one rank prefill while another waits: the FastDeploy deadlock).

Bookkeeping is bounded: a batch is forgotten once released (or once its share is complete
and nothing of it is held), so nothing grows with the number of batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine_worker.sequence import Sequence

GATED_DISPATCHER = "scheduler"   # batches of the scheduler (any incarnation) are gated (see docs)
INCARNATION_SHIFT = 40           # batch numbers per incarnation: 2**40; incarnations: 2**23 (int64 rows)


def batch_number(batch_id: str | None) -> int:
    """The batch's number, ordered across scheduler incarnations; 0 for no batch or a
    batch of another dispatcher.

    A leader's batch ids are ``scheduler.<incarnation>-<n>`` (incarnation = the leader's
    number from ``<ns>:incarnation``, n = 1, 2, ...): the number is
    ``incarnation << 40 | n``, so every batch of a new leader sorts after every batch of the
    old one and the ranks' ``complete`` marks of the old leader never cover a new batch.
    ``scheduler-17`` (no incarnation: the simulator's single scheduler) -> 17."""
    if not batch_id:
        return 0
    prefix, _, n = batch_id.rpartition("-")
    if not n.isdigit():
        return 0
    if prefix == GATED_DISPATCHER:
        inc = 0
    else:
        head, dot, tail = prefix.partition(".")
        if head != GATED_DISPATCHER or not dot or not tail.isdigit():
            return 0
        inc = int(tail)
    num = int(n)
    if num >= 1 << INCARNATION_SHIFT or inc >= 1 << (63 - INCARNATION_SHIFT):
        return 0   # out of range for the collective's int64 rows: not gated rather than wrong
    return inc << INCARNATION_SHIFT | num


@dataclass
class BatchGate:
    rank: int
    timeout_s: float = 0.1
    complete: int = 0                                          # highest batch with my share complete
    arrived: dict[int, int] = field(default_factory=dict)      # batch -> my requests seen so far
    expected: dict[int, int] = field(default_factory=dict)     # batch -> my share
    counts: dict[int, list[int]] = field(default_factory=dict)  # batch -> per-rank counts
    released: set[int] = field(default_factory=set)            # released, still with held seqs
    release_seen: int = 0                                       # the leader's latest timeout release
    # leader state
    _watch: tuple[int, float] = (0, 0.0)
    release_upto: int = 0                                       # leader's timeout decision to share
    # counters
    released_full: int = 0
    released_timeout: int = 0

    def on_arrival(self, seq: Sequence) -> None:
        n = batch_number(seq.batch)
        if not n or n in self.released or not seq.batch_counts:
            return
        counts = list(seq.batch_counts)
        share = counts[self.rank] if self.rank < len(counts) else 0
        self.counts[n] = counts
        self.expected[n] = share
        self.arrived[n] = self.arrived.get(n, 0) + 1
        if self.arrived[n] >= share:
            self.complete = max(self.complete, n)
            if share and not any(c for r, c in enumerate(counts) if r != self.rank):
                # Only this rank has a share (a lone request at low load): every rank would
                # reach the same verdict from the next exchange, so release it now and save
                # the extra collective round before its prefill.
                self.released.add(n)
                self.released_full += 1

    def may_prefill(self, seq: Sequence) -> bool:
        n = batch_number(seq.batch)
        return not n or n in self.released or n <= self.release_seen

    def oldest_held(self) -> int:
        pending = [n for n in self.counts if n not in self.released and n > self.release_seen]
        return min(pending) if pending else 0

    def row(self) -> tuple[int, int, int]:
        """(complete, oldest_held, release_upto) for this rank's row of the collective."""
        return self.complete, self.oldest_held(), self.release_upto if self.rank == 0 else 0

    def after_exchange(self, completes: list[int], oldest: list[int], leader_release: int, now: float) -> int:
        """Apply the group's numbers; returns how many batches were released."""
        released = 0
        if leader_release > self.release_seen:
            for n in list(self.counts):
                if n <= leader_release and n not in self.released:
                    self.released.add(n)
                    self.released_timeout += 1
                    released += 1
            self.release_seen = leader_release
        for n, counts in list(self.counts.items()):
            if n in self.released:
                continue
            if all(completes[r] >= n for r, c in enumerate(counts) if c > 0 and r < len(completes)):
                self.released.add(n)
                self.released_full += 1
                released += 1
        if self.rank == 0:
            held = [x for x in oldest if x > self.release_seen]
            m = min(held) if held else 0
            if not m:
                self._watch = (0, 0.0)
            elif self._watch[0] != m:
                self._watch = (m, now)
            elif now - self._watch[1] >= self.timeout_s:
                self.release_upto = max(self.release_upto, m)
        return released

    def forget_done(self, still_held: set[int]) -> None:
        """Drop released batches with nothing left held here (bounded bookkeeping)."""
        for n in list(self.counts):
            if n not in still_held and (n in self.released or n <= self.release_seen):
                self.counts.pop(n, None)
                self.arrived.pop(n, None)
                self.expected.pop(n, None)
                self.released.discard(n)
