"""Work left behind by dead ranks: every ``ORPHAN_SCAN_S`` (and at once when membership
changes) resume what a dead engine incarnation had (services/scheduler/housekeeping.py)
and trim what every rank has acked."""

from __future__ import annotations

import time
from typing import Any

from services.scheduler.housekeeping import recover_orphans, trim_acked
from services.scheduler.state import SchedulerState
from shared import keys as K

ORPHAN_SCAN_S = 2.0         # look for work left behind by dead ranks (and trim) this often, and at once on changes


class Recovery:
    """Forgets resumed requests in ``state.assigned``; counts them as ``resumed``."""

    def __init__(self, r: Any, keys: K.Keys, state: SchedulerState, log: Any) -> None:
        self.r, self.keys, self.state, self.log = r, keys, state, log
        self.ever_alive: set[int] = set()   # ranks seen alive: only those can have died
        self._next_scan = 0.0

    def soon(self) -> None:
        """Scan at the next chance rather than at the next interval."""
        self._next_scan = 0.0

    async def scan_if_due(self) -> None:
        if time.monotonic() < self._next_scan:
            return
        self._next_scan = time.monotonic() + ORPHAN_SCAN_S
        st = self.state
        by_api = await recover_orphans(self.r, self.keys, st.ranks, set(st.live), self.ever_alive)
        if by_api:
            for ids in by_api.values():
                for rid in ids:
                    st.assigned.pop(rid, None)
            n = sum(len(v) for v in by_api.values())
            st.count("resumed", n)
            self.log.warning("resuming_requests_of_dead_ranks", n=n)
        await trim_acked(self.r, self.keys, st.ranks)
