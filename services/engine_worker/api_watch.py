"""Whose requests run here: an api-server that stopped beating has no reader for their
tokens, so its requests on this rank are aborted instead of running to the end (after a
grace that outlasts a Redis failover: api_liveness.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from services.engine_worker.api_liveness import ApiLiveness
from shared import keys as K


async def watch_api_servers(r: Any, keys: K.Keys, core: Any, heartbeat_s: float,
                            on_aborted: Callable[[Any], None], log: Any,
                            writes_failed_at: Callable[[], float] = lambda: float("-inf")) -> None:
    """Every heartbeat, check the alive keys of the api-servers owning ``core``'s requests;
    abort those of the dead ones (``on_aborted`` gets each aborted sequence).
    ``writes_failed_at``: when the rank's step loop last had a write refused or stuck (a
    lapse then is Redis's, not the api-server's: api_liveness.py)."""
    liveness = ApiLiveness(grace_s=max(5.0, 5 * heartbeat_s))
    while True:
        apis = sorted({q.api for q in (*core.running, *core.waiting)})
        if apis:
            try:
                pipe = r.pipeline(transaction=False)
                for api in apis:
                    pipe.exists(keys.api_alive(api))
                res = await pipe.execute()
                dead = liveness.observe(time.monotonic(), {api: bool(alive) for api, alive in zip(apis, res)},
                                        writes_failed_at())
                if dead:
                    _abort_owned_by(core, dead, on_aborted, log, liveness.grace_s)
            except Exception as exc:  # noqa: BLE001 - checked again next beat
                log.warning("api_server_check_failed", error=str(exc)[:200])
        await asyncio.sleep(heartbeat_s)


def _abort_owned_by(core: Any, dead_apis: set[str], on_aborted: Callable[[Any], None], log: Any,
                    grace_s: float = 5.0) -> None:
    ids = [q.id for q in (*core.running, *core.waiting) if q.api in dead_apis]
    for sid in ids:
        seq = core.abort(sid, time.time())
        if seq is not None:
            # what its client reads if the api-server was only stalled (a long GC pause)
            seq.error = (f"aborted on its rank: the api-server serving it stopped answering for over "
                         f"{grace_s:g} s")
            on_aborted(seq)
    if ids:
        log.warning("aborted_requests_of_dead_api_server", apis=sorted(dead_apis), n=len(ids))
