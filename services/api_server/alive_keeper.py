"""This api-server's heartbeat key, kept from a thread of its own while the event loop goes
round (as the scheduler's lease is: scheduler/lease_keeper.py).

Written only from the event loop, the key (3 s) lapsed whenever the loop stalled past
about 2 s, and the engines, finding it gone for 5 s, aborted every request of this replica
as a dead one's: a burst of 10,000 requests at once on a 2-core host (the loop ran
thousands of ready handlers a round) ended 127 admitted requests with a 503 while the
replica served on (2026-12-07). This thread writes the key every second as long as the loop
went round within ``STALL_BOUND_S``, so a slow replica keeps its requests and a wedged
one (or a dead process) still loses them."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from shared.bus import connect_sync

ALIVE_TTL_MS = 3000   # the key's life: 3 beats
BEAT_S = 1.0
STALL_BOUND_S = 30.0  # a loop that has not gone round this long is wedged: let the key lapse


class AliveKeeper:
    def __init__(self, redis_url: str, key: str, log: Any, stall_bound_s: float = STALL_BOUND_S) -> None:
        self.url, self.key, self.log, self.bound_s = redis_url, key, log, stall_bound_s
        self.progress_t = time.monotonic()

    def mark_progress(self) -> None:
        """The event loop went round (its heartbeat task ran)."""
        self.progress_t = time.monotonic()

    def start(self) -> Callable[[], None]:
        """Start the thread; returns what stops it (and waits for it, bounded)."""
        done = threading.Event()

        def keep() -> None:
            client = connect_sync(self.url, timeout_s=BEAT_S, connect_timeout_s=BEAT_S)
            stalled_said = False
            try:
                while not done.wait(BEAT_S):
                    stalled = time.monotonic() - self.progress_t
                    if stalled > self.bound_s:
                        if not stalled_said and self.log is not None:
                            self.log.error("api_server_stalled", stalled_s=round(stalled, 1), bound_s=self.bound_s)
                        stalled_said = True
                        continue
                    stalled_said = False
                    try:
                        client.set(self.key, str(time.time()), px=ALIVE_TTL_MS)
                    except Exception:  # noqa: BLE001 - Redis away: the loop's own heartbeat reports it
                        pass
            finally:
                client.close()

        thread = threading.Thread(target=keep, name="api-alive", daemon=True)
        thread.start()

        def stop() -> None:
            done.set()
            thread.join(timeout=2 * BEAT_S + 1)
        return stop
