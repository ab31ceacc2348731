"""What the scheduler's recovery does with one page of a dead rank's inbox entries (pure;
services/scheduler/housekeeping.py does the I/O).

Every entry read is acked. Requests are resumed (their api-servers get a ``resume``
notice). Two kinds go back to the inbox's tail instead, as a new entry:

* a ``retire``: it is for the rank, which may only have stalled and come back to run the
  stale copy it names; recovery must not consume it. It lives ``RETIRE_KEEP_S`` from its
  first write (kept in its ``since``), so one for a rank that never comes back does not
  circle for ever; a rank back after a longer stall runs such a copy to its end (its
  api-server ignores its deltas);
* any entry after ``bound``, the inbox's tail when the scan began: a scan reads only what
  was there when it started, so work resumed onto this (dead) inbox during the scan waits
  for the next scan instead of cycling through resume after resume in one scan.

Each page is read by one ``XREADGROUP``, which may read past ``bound``: that is what the
second case catches; a requeued entry lands past ``bound`` and is not read again in this scan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.bus import decode_entries, entry_id_key
from shared.messages import FIELD, MessageError, Retire, encode

RETIRE_KEEP_S = 600.0   # how long a retire waits in the inbox of a rank taken for dead


@dataclass
class Page:
    resume: list[tuple[Any, Any]] = field(default_factory=list)   # (id, fields) of entries to resume
    requeue: list[dict[bytes, bytes]] = field(default_factory=list)  # fields to add at the tail, in order
    ack: list[Any] = field(default_factory=list)                  # every id read
    at_bound: bool = False                                        # the scan has read up to its bound


def plan_page(entries: list[tuple[Any, Any]], bound: Any | None, now_ms: int) -> Page:
    """``entries``: (id, fields) as read. ``bound``: the last entry id to take in this
    scan (None: no bound, e.g. entries already pending). ``now_ms``: wall clock, for the
    age of a retire."""
    page = Page()
    docs = {eid: doc for _, eid, doc in decode_entries([(b"inbox", entries)])}
    for eid, fields in entries:
        page.ack.append(eid)
        if fields is None:                   # deleted while pending: nothing to resume
            continue
        if bound is not None and entry_id_key(eid) >= entry_id_key(bound):
            page.at_bound = True
        past = bound is not None and entry_id_key(eid) > entry_id_key(bound)
        doc = docs.get(eid)
        if doc is not None and doc.get("k") == "retire":
            kept = _kept_retire(eid, doc, now_ms)
            if kept is not None:
                page.requeue.append({FIELD: kept})
        elif past:
            page.requeue.append(fields)
        else:
            page.resume.append((eid, fields))
    return page


def _kept_retire(eid: Any, doc: dict[str, Any], now_ms: int) -> bytes | None:
    """The retire to write back (its first write's time in ``since``), or None when it has
    waited ``RETIRE_KEEP_S`` or is malformed (the rank would drop it too)."""
    try:
        rt = Retire.from_dict(doc)
    except MessageError:
        return None
    if not rt.since:
        rt.since = entry_id_key(eid)[0]
    if now_ms - rt.since > RETIRE_KEEP_S * 1000:
        return None
    return encode(rt)
