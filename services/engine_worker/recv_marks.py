"""The highest dispatch sequence number this rank received from each dispatcher
incarnation (``RankStats.recv``), bounded.

Dispatcher ids carry an incarnation (``scheduler.<n>`` for a scheduler leader,
``api-<api id>`` for an api-server process in client dispatch), so a new incarnation
starts from 0 and its policy reconciles exactly what this rank has seen of *its* sends.
Without a bound the map would gain an entry per incarnation forever and every step report
would carry them all. An incarnation is forgotten when it sent nothing for ``idle_s``
(its policy has long since aged out what it had not seen reconciled: ``local_ttl_s``) or
when ``max_entries`` more recently active ones exist. A forgotten incarnation that sends
again simply starts a new entry at its new seq (seqs only grow).

Pure: time is passed in (any monotonic base).
"""

from __future__ import annotations

from collections import OrderedDict

MAX_ENTRIES = 64
IDLE_S = 600.0


class RecvMarks:
    __slots__ = ("max_entries", "idle_s", "_marks")

    def __init__(self, max_entries: int = MAX_ENTRIES, idle_s: float = IDLE_S) -> None:
        self.max_entries = max(1, int(max_entries))
        self.idle_s = idle_s
        self._marks: OrderedDict[str, tuple[int, float]] = OrderedDict()   # least recently sent first

    def note(self, dispatcher: str, seq: int, now: float) -> None:
        old = self._marks.pop(dispatcher, None)
        self._marks[dispatcher] = (max(seq, old[0] if old else 0), now)
        while len(self._marks) > self.max_entries:
            self._marks.popitem(last=False)
        self._expire(now)

    def as_dict(self, now: float | None = None) -> dict[str, int]:
        if now is not None:
            self._expire(now)
        return {d: seq for d, (seq, _) in self._marks.items()}

    def get(self, dispatcher: str, default: int = 0) -> int:
        m = self._marks.get(dispatcher)
        return m[0] if m else default

    def __len__(self) -> int:
        return len(self._marks)

    def _expire(self, now: float) -> None:
        while self._marks:
            d, (_, t) = next(iter(self._marks.items()))
            if now - t <= self.idle_s:
                return
            del self._marks[d]
