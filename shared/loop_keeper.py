"""A Redis key kept from a thread of its own while an asyncio event loop goes round: the
scheduler's lease (scheduler/lease_keeper.py) and an api-server's heartbeat
(api_server/alive_keeper.py).

Written only from the loop, such a key lapses whenever the loop stalls past its life (a
burst, a host short of CPU), and what the key stands for is then taken for dead. The
thread renews it every ``period_s`` as long as the loop marked progress within
``bound_s``: a slow loop keeps it, a wedged one (or a dead process) loses it."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from shared.bus import connect_sync


class LoopKeeper:
    stalled_event = "loop_stalled"   # logged once per stall past the bound

    def __init__(self, redis_url: str, period_s: float, bound_s: float, log: Any, name: str) -> None:
        self.url, self.period_s, self.bound_s, self.log, self.name = redis_url, period_s, bound_s, log, name
        self.progress_t = time.monotonic()

    def mark_progress(self) -> None:
        """The event loop went round."""
        self.progress_t = time.monotonic()

    def renew(self, client: Any) -> None:
        """Write the key (from the thread, with its own synchronous client)."""
        raise NotImplementedError

    def start(self) -> Callable[[], None]:
        """Start the thread; returns what stops it (and waits for it, bounded)."""
        done = threading.Event()
        timeout = max(0.5, self.period_s)

        def keep() -> None:
            client = connect_sync(self.url, timeout_s=timeout, connect_timeout_s=timeout)
            stalled_said = False
            try:
                while not done.wait(self.period_s):
                    stalled = time.monotonic() - self.progress_t
                    if stalled > self.bound_s:
                        if not stalled_said and self.log is not None:   # let it lapse
                            self.log.error(self.stalled_event, stalled_s=round(stalled, 1), bound_s=self.bound_s)
                        stalled_said = True
                        continue
                    stalled_said = False
                    try:
                        self.renew(client)
                    except Exception:  # noqa: BLE001 - Redis away: the loop's own writes report it
                        pass
            finally:
                client.close()

        thread = threading.Thread(target=keep, name=self.name, daemon=True)
        thread.start()

        def stop() -> None:
            done.set()
            thread.join(2 * self.period_s + 1)
        return stop
