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

import time
from typing import Any

from shared.loop_keeper import LoopKeeper

ALIVE_TTL_MS = 3000   # the key's life: 3 beats
BEAT_S = 1.0
STALL_BOUND_S = 30.0  # a loop that has not gone round this long is wedged: let the key lapse


class AliveKeeper(LoopKeeper):
    stalled_event = "api_server_stalled"

    def __init__(self, redis_url: str, key: str, log: Any, stall_bound_s: float = STALL_BOUND_S) -> None:
        super().__init__(redis_url, BEAT_S, stall_bound_s, log, "api-alive")
        self.key = key

    def renew(self, client: Any) -> None:
        client.set(self.key, str(time.time()), px=ALIVE_TTL_MS)
