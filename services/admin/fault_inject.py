"""Fault injection for the recovery tests and benchmark: kill a rank at a known point.

What a client has read says little about where the engines are (a loaded client lags
them by seconds), so the trigger follows the rank's own step reports on the stats
stream. Blocking and synchronous on purpose: run it in a thread of its own, where a busy
event loop cannot delay it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from shared.bus import connect_sync
from shared.keys import Keys
from shared.messages import FIELD, loads


def kill_rank_mid_decode(redis_url: str, namespace: str, rank: int, pid: int, min_running: int,
                         max_tokens: int, timeout: float = 120.0) -> float | None:
    """SIGKILL ``pid`` (the process of ``rank``) at the first step report after it has at
    least ``min_running`` requests running, a fifth or more of their ``max_tokens`` out on
    average and a tenth or more still to come. Returns the time of the kill (``time.time()``),
    or None if that point did not come within ``timeout`` seconds."""
    r = connect_sync(redis_url)   # any URL form (shared/bus.py)
    stream, last = Keys(namespace).stats, "$"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for _, entries in r.xread({stream: last}, block=1000, count=500) or []:
                for eid, fields in entries:
                    last = eid
                    st = loads(fields[FIELD])
                    running = st["running"]
                    if (st["rank"] == rank and running >= min_running
                            and running * max_tokens // 10 <= st["outstanding"] <= running * max_tokens * 4 // 5):
                        os.kill(pid, signal.SIGKILL)
                        return time.time()
    finally:
        r.close()
    return None


def kill_rank_mid_decode_in_background(*args: object, **kwargs: object) -> Callable[[float], float | None]:
    """Run kill_rank_mid_decode (same arguments) in a thread of its own; returns what waits
    for it (at most the given seconds) and gives its result: the kill time, or None."""
    result: list[float | None] = []
    thread = threading.Thread(target=lambda: result.append(kill_rank_mid_decode(*args, **kwargs)),  # type: ignore[arg-type]
                              daemon=True)
    thread.start()

    def join(timeout: float) -> float | None:
        thread.join(timeout)
        return result[0] if result else None
    return join
