"""A request no service holds any more: the scheduler read its submission and acked it
without a dispatch (a write lost, or a bug: a full Redis once made the scheduler drop
entries it took for second copies). No rank will send a token, and its client would wait
out request_timeout_s (600 s) with no word. So every ``SILENT_CHECK_S`` the api-server
looks up the requests it has heard nothing of for that long, in one round trip, and
resumes those whose submission was delivered to the scheduler, is no longer pending there,
and has no record of that copy (``<ns>:req:<id>``, written in the same transaction as the
dispatch; a resumed copy's record carries its ``epoch``, so the record of the copy before
does not count). One still queued (not yet delivered), held by the batcher (pending) or
placed (recorded) is left be. Pure: the api-server (gateway.py) does the round trip.

Only what goes through the scheduler is judged: in client dispatch the api-server writes a
first submission to the inbox itself (a resumed one still goes to the scheduler)."""

from __future__ import annotations

from typing import Any, Iterable

from shared.bus import entry_id_key

SILENT_CHECK_S = 30.0    # a request that silent is looked up (a decode step takes milliseconds)
MAX_CHECKED = 256        # requests looked up per round (the longest silent first)


def due(channels: Iterable[Any], now: float, stream: str, silent_s: float = SILENT_CHECK_S,
        limit: int = MAX_CHECKED) -> list[Any]:
    """The channels to look up at monotonic ``now``: unfinished requests last submitted to
    ``stream`` whose last token (or submission, or last look) is ``silent_s`` old."""
    found = [ch for ch in channels
             if ch.finish is None and ch.entry is not None and ch.entry[0] == stream
             and now - max(ch.last_t, ch.quiet_t) >= silent_s]
    found.sort(key=lambda ch: max(ch.last_t, ch.quiet_t))
    return found[:limit]


def lost(checked: list[Any], last_delivered: bytes | str | None, pending: list[Any], records: list[Any]) -> list[str]:
    """Of the ``checked`` channels, the ids no service holds: given the scheduler group's
    last-delivered id, and for each channel its entry's pending row (empty when not
    pending) and its record's ``(state, epoch)`` (``state`` None: no record)."""
    if last_delivered is None:      # no group yet: nothing was read
        return []
    upto = entry_id_key(last_delivered)
    return [ch.id for ch, rows, rec in zip(checked, pending, records)
            if not rows and entry_id_key(ch.entry[1]) <= upto and not _records_copy(rec, ch.epoch)]


def _records_copy(record: Any, epoch: int) -> bool:
    """Whether a record ``(state, epoch)`` is of the copy ``epoch`` (or a later one)."""
    state, rec_epoch = record
    return state is not None and int(rec_epoch or 0) >= epoch
