"""How every scheduler loop runs: iterations forever, Redis outages ridden out with
backoff, any other error logged and the loop going on (a loop that ended would leave the
leader holding the lease while doing nothing)."""

from __future__ import annotations

import asyncio
import traceback
from typing import Any, Awaitable, Callable

from shared.bus import retrying


async def resilient(what: str, iteration: Callable[[], Awaitable[None]], *, log: Any,
                    on_trouble: Callable[[], None]) -> None:
    """Run ``iteration`` forever. ``on_trouble`` is called on every Redis retry and every
    failed iteration (the request loop then re-takes what was read and not acked)."""
    async def note_trouble() -> None:
        on_trouble()

    failures = 0
    while True:
        try:
            await retrying(iteration, log=log, what=what, on_retry=note_trouble)
            failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in one iteration must not stop the service
            failures += 1
            on_trouble()
            if failures in (1, 2, 4, 8) or failures % 64 == 0:
                log.error("loop_iteration_failed", loop=what, error=repr(exc), failures=failures, where=where(exc))
            await asyncio.sleep(min(2.0, 0.05 * 2 ** min(failures, 6)))


def where(exc: BaseException) -> str:
    """The innermost frames of an error, for one log line (the JSON logs carry no tracebacks)."""
    return " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(exc.__traceback__)[-4:]))
