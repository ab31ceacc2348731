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

import threading
import time
from typing import Any, Callable

from shared import lease
from shared.bus import connect_sync


def stall_bound_s(lease_ms: int) -> float:
    """Longest the loop may go without a round and still lead: 5 s, or 5 leases."""
    return max(5.0, 5 * lease_ms / 1000)


class LeaseKeeper:
    def __init__(self, redis_url: str, key: str, token: str, lease_ms: int, log: Any) -> None:
        self.url, self.key, self.token, self.lease_ms, self.log = redis_url, key, token, lease_ms, log
        self.bound_s = stall_bound_s(lease_ms)
        self.progress_t = time.monotonic()

    def mark_progress(self) -> None:
        """The event loop went round (its renewal task ran)."""
        self.progress_t = time.monotonic()

    def start(self) -> Callable[[], None]:
        """Start the thread; returns what stops it (and waits for it, bounded)."""
        done = threading.Event()
        period = self.lease_ms / 3000

        def keep() -> None:
            client = connect_sync(self.url, timeout_s=max(0.5, period), connect_timeout_s=max(0.5, period))
            stalled_said = False
            try:
                while not done.wait(period):
                    stalled = time.monotonic() - self.progress_t
                    if stalled > self.bound_s:
                        if not stalled_said:     # let it lapse: a standby leads
                            self.log.error("scheduler_stalled", stalled_s=round(stalled, 1), bound_s=self.bound_s)
                            stalled_said = True
                        continue
                    stalled_said = False
                    try:   # lost, or lapsed: left alone (the loop steps down, or takes it back and says so)
                        lease.renew(client, self.key, self.token, self.lease_ms, reacquire=False)
                    except Exception:  # noqa: BLE001 - Redis away: the loop's own renewal reports it
                        pass
            finally:
                client.close()

        thread = threading.Thread(target=keep, name="lease-keeper", daemon=True)
        thread.start()

        def stop() -> None:
            done.set()
            thread.join(2 * period + 1)
        return stop
