"""The leading scheduler's lease, kept from a thread of its own while the event loop goes
round (as an engine's rank slot is: engine_worker/membership.py ``start_liveness``).

Renewed only from the event loop, a 1 s lease lapsed whenever the loop stalled past about
0.7 s: a burst of dispatches, or a host short of CPU. A standby then took over, the old
leader was restarted and every request in flight was claimed and placed again: on a busy
two-core host, several failovers a minute with nothing wrong. This thread extends the
lease every third of it as long as the loop marked progress within ``stall_bound_s``, so
a slow loop keeps leading and a wedged one (or a dead process) still loses the lease.

It only extends a lease this scheduler holds: taking a free one back, and stepping down
for another holder, stay the event loop's (Leadership.renew_lease), which announces the
one and stops the service for the other."""

from __future__ import annotations

from typing import Any

from shared import lease
from shared.loop_keeper import LoopKeeper


def stall_bound_s(lease_ms: int) -> float:
    """Longest the loop may go without a round and still lead: 5 s, or 5 leases."""
    return max(5.0, 5 * lease_ms / 1000)


class LeaseKeeper(LoopKeeper):
    stalled_event = "scheduler_stalled"

    def __init__(self, redis_url: str, key: str, token: str, lease_ms: int, log: Any) -> None:
        super().__init__(redis_url, lease_ms / 3000, stall_bound_s(lease_ms), log, "lease-keeper")
        self.key, self.token, self.lease_ms = key, token, lease_ms

    def renew(self, client: Any) -> None:
        # lost, or lapsed: left alone (the loop steps down, or takes it back and says so)
        lease.renew(client, self.key, self.token, self.lease_ms, reacquire=False)
