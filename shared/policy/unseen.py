"""One dispatcher's sends to one rank that no snapshot shows yet (seq/recv reconciliation).

Every Assignment carries ``dispatcher`` and a per-(dispatcher, rank) ``seq`` from 1; an
engine echoes the highest seq it has received in ``RankStats.recv[dispatcher]``, in the
same report whose waiting/outstanding already count those requests. So on a snapshot the
sends with ``seq <= recv`` are dropped (the snapshot counts them) and the rest stay as
local load: no double counting, nothing forgotten. Used by every policy (dispatch.py,
staggered.py)."""

from __future__ import annotations

from collections import deque


class UnseenSends:
    """Sends in seq order with the load each adds (``amount``, and ``blocks`` of KV) and
    their running sums; ``t`` is the sender's clock, for expiring sends never echoed."""

    __slots__ = ("seq", "sends", "amount", "blocks")

    def __init__(self) -> None:
        self.seq = 0                                              # last seq sent
        self.sends: deque[tuple[int, float, int, float]] = deque()  # (seq, amount, blocks, t)
        self.amount: float = 0
        self.blocks = 0

    def __len__(self) -> int:
        return len(self.sends)

    def send(self, amount: float, blocks: int = 0, t: float = 0.0) -> int:
        """Record one send; returns its seq."""
        seq = self.seq = self.seq + 1      # (the dispatch hot path: locals, no needless adds)
        self.sends.append((seq, amount, blocks, t))
        self.amount += amount
        if blocks:
            self.blocks += blocks
        return seq

    def reconcile(self, recv: int, sent_before: float | None = None) -> tuple[int, int]:
        """Drop the sends the engine has echoed (``seq <= recv``) and, with ``sent_before``,
        older ones (an engine that restarted or never echoes). Returns (seen, expired)."""
        q = self.sends
        seen = expired = 0
        while q and (q[0][0] <= recv or (sent_before is not None and q[0][3] < sent_before)):
            seq, amount, blocks, _ = q.popleft()    # (drop_oldest, inlined: once per send)
            self.amount -= amount
            self.blocks -= blocks
            if seq <= recv:
                seen += 1
            else:
                expired += 1
        if not q:
            self.amount, self.blocks = 0, 0   # no float drift
        return seen, expired

    def drop_oldest(self) -> int:
        seq, amount, blocks, _ = self.sends.popleft()
        self.amount -= amount
        self.blocks -= blocks
        return seq

    def clear(self) -> None:
        """Forget every send, keeping the seq counter (the engine's recv keeps counting)."""
        self.sends.clear()
        self.amount, self.blocks = 0, 0
