"""Admission: answer 429 with Retry-After before the queue grows past what a client accepts.

An engine group short of a rank for longer than ``engine_down_timeout_s`` (it steps only
with all of them) answers 503 (code ``engine_unavailable``) at once: nothing could serve
the request. Then two bounds, both settings of the api-server: ``max_queue_wait_s`` —
while a new request would wait longer than this before its prefill starts (the scheduler's
estimate: the prompt tokens ahead of it, unplaced and in the ranks' own queues, over the
rate the ranks take them, published with each snapshot and read once a second by the
replica's heartbeat; services/scheduler/queue_eta.py; plus what the replicas admitted since
that figure was measured, recent_admissions.py), it is refused; and ``max_inflight`` — requests
in flight on this replica.
Above capacity the first bound holds TTFT near ``max_queue_wait_s`` plus the prefill, where
the second alone would let it grow to ``replicas x max_inflight / capacity``."""

from __future__ import annotations

import math
import time
from typing import Any

from services.api_server.errors import ApiError
from services.api_server.gateway import engine_down_message

MAX_RETRY_AFTER_S = 60
ENGINE_DOWN_RETRY_AFTER_S = 5   # ranks restarted by a supervisor are back within seconds


SHUTTING_DOWN = "this api-server is shutting down; retry the request (another replica, or this one once restarted)"


def ran_out(gw: Any, timeout_s: float) -> tuple[str, ApiError]:
    """Why a request's wait for its tokens ended before they did (the abort reason, and what
    the client gets): this replica shutting down (503), or the request's own timeout (504);
    both say to retry."""
    if gw.closing:
        return "shutdown", ApiError(503, SHUTTING_DOWN, code="shutting_down")
    return "timeout", ApiError(504, f"no completion within {timeout_s:g}s (the api-server's request_timeout_s); "
                                    "retry later", code="request_timeout")


def not_completed(ch: Any) -> ApiError:
    """What the client gets for a request that ended in an error or an abort (every path,
    stream or not, one choice or several): a 503 that says why, with the cause's code."""
    return ApiError(503, f"the request could not be completed: {ch.error or ch.finish}; retry it", code=ch.code)


def expected_wait_s(gw: Any) -> float | None:
    """A new request's wait before its prefill starts: the scheduler's last figure, plus what
    the replicas admitted since over the most the ranks take a second, in prompt tokens or,
    where the sequence slots bound it first, in requests (None: neither known).
    An idle group publishes no figure (no step, no snapshot), so a burst after a quiet spell
    found none and was admitted whole: then what it admitted is the whole wait."""
    tps, rps = gw.prefill_tps, gw.seq_rps
    if not tps and not rps:
        return gw.queue_wait_s
    since = max(gw.admitted.tokens / tps if tps else 0.0, gw.admitted.requests / rps if rps else 0.0)
    return (gw.queue_wait_s or 0.0) + since


def admission_view(gw: Any) -> dict[str, Any]:
    """What this replica judges new requests by, as of its last heartbeat (``GET /health``):
    the queue's wait, the rates, what was admitted since, the wait a new request would
    have; null where not known."""
    wait = expected_wait_s(gw)
    return {"queue_wait_s": gw.queue_wait_s, "prefill_tps": gw.prefill_tps or None,
            "seq_rps": gw.seq_rps or None, "admitted_tokens": gw.admitted.tokens,
            "admitted_requests": gw.admitted.requests, "expected_wait_s": None if wait is None else round(wait, 3)}


def admit(gw: Any, settings: Any, need: int = 1, tokens: int = 0) -> None:
    """Raise the 429 for a request that needs ``need`` in-flight slots, if it must wait
    (the 503 of a replica that is shutting down); count its ``tokens`` (prompt tokens, every
    choice's) as admitted if not."""
    if getattr(gw, "closing", False):
        raise ApiError(503, SHUTTING_DOWN, code="shutting_down")
    down_s = gw.down_for(time.monotonic()) if hasattr(gw, "down_for") else 0.0
    if settings.engine_down_timeout_s > 0 and down_s > settings.engine_down_timeout_s:
        message = engine_down_message(gw.ranks_live or 0, gw.num_ranks, down_s, gw.keys.ns)
        raise ApiError(503, message + "; retry after the Retry-After delay", code="engine_unavailable",
                       headers={"Retry-After": str(ENGINE_DOWN_RETRY_AFTER_S)})
    if need > settings.max_inflight:   # never admissible: retrying cannot help, so not a 429
        raise ApiError(400, f"this request needs {need} in-flight slots (prompts x n, or best_of), more than this "
                       f"server's max_inflight ({settings.max_inflight}); send fewer choices or prompts per request",
                       param="n")
    wait, bound = expected_wait_s(gw), settings.max_queue_wait_s
    if bound > 0 and wait is not None and wait > bound:
        raise ApiError(429, f"server busy: a new request would wait about {wait:.1f} s queued before its prefill, "
                       f"longer than this server's max_queue_wait_s ({bound:g} s); retry after the Retry-After delay",
                       code="overloaded", headers={"Retry-After": str(retry_after_s(wait, bound))})
    if len(gw.channels) + need > settings.max_inflight:
        what = f"{settings.max_inflight} requests in flight" if need == 1 else \
            f"this request needs {need} of {settings.max_inflight} in-flight slots"
        raise ApiError(429, f"server busy: {what} on this replica; retry after the Retry-After delay",
                       code="overloaded", headers={"Retry-After": "1"})
    gw.admitted.add(tokens, time.time(), need)


def retry_after_s(wait_s: float, bound_s: float) -> int:
    """Whole seconds until the queue's head is likely back under the bound (it waits no
    longer once new requests stop joining): the excess, 1 to ``MAX_RETRY_AFTER_S``."""
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait_s - bound_s)))
