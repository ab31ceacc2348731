"""Scheduler housekeeping against Redis: resume the work of dead ranks, trim acked entries.

Both run every couple of seconds from the scheduler's membership loop (and at once when
membership changes); both are safe to run twice.
"""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis

from services.scheduler.orphan_page import Page, plan_page
from shared import keys as K
from shared.bus import atomic, decode_entries, entry_id_key
from shared.replies import as_str, str_keys
from shared.messages import FIELD, Resume, encode, request_owner

RECOVERY_CONSUMER = "recovery"


PAGE = 1000   # entries claimed / read per round trip while resuming


async def recover_orphans(r: Redis, keys: K.Keys, ranks: list[int], live: set[int],
                          ever_alive: set[int]) -> dict[str, list[str]]:
    """Resume the requests of dead ranks on live ones; returns {api: request ids} resumed.

    Each engine incarnation reads its inbox under its own consumer name and acks a request
    only when it finishes, so whatever a dead incarnation had is still pending under its
    name. Those entries are claimed (atomically: one owner) by the ``recovery`` consumer,
    and then their api-servers' ``resume`` notices and the acks go in **one** MULTI/EXEC:
    an entry is acked only with its notice. A crash in between leaves the entries pending
    under ``recovery``, and the next scan resumes those first. Everything is paged
    (``PAGE`` entries a round trip) until nothing is left, and a dead consumer is deleted
    only once it holds nothing. Entries never delivered to a rank that died and stays dead
    are resumed too (read by ``recovery``, then the same notice + ack), but only up to the
    inbox's tail when the scan began, and retires go back to the inbox for the rank
    (services/scheduler/orphan_page.py).

    With no live rank it does nothing: resumed work could only be placed on a dead rank's
    inbox again (the scheduler's fallback), to be resumed again by the next scan, each
    time at the cost of a re-prefill, a new epoch and a retire. Waiting loses nothing:
    the entries stay pending or undelivered, a rank that comes back (a stall, a Redis
    failover that outlasted every heartbeat) goes on with its own work, and once any rank
    is live the next scan resumes the rest's on it."""
    if not live:
        return {}
    # Ranks whose undelivered entries are resumed. (A rank still starting up has not
    # died: its queue waits for it.)
    dead = [rank for rank in ranks if rank not in live and rank in ever_alive]
    pipe = r.pipeline(transaction=False)
    for rank in ranks:
        pipe.hget(keys.rank_info(rank), "consumer")
        pipe.xinfo_consumers(keys.inbox(rank), K.ENGINE_GROUP)
    for rank in dead:
        pipe.xrevrange(keys.inbox(rank), count=1)   # the scan's bound: the tail as it is now
    res = await pipe.execute(raise_on_error=False)
    tails = dict(zip(dead, res[2 * len(ranks):]))
    by_api: dict[str, list[str]] = {}
    for i, rank in enumerate(ranks):
        live_consumer, consumers = res[2 * i], res[2 * i + 1]
        if isinstance(consumers, Exception) or not consumers:
            continue
        alive = rank in live
        inbox = keys.inbox(rank)
        for c in consumers:
            c = str_keys(c)
            name = as_str(c["name"])
            if name == RECOVERY_CONSUMER:
                # Claimed by an earlier scan that stopped before its notices went out.
                if int(c.get("pending", 0)):
                    await _resume_pending(r, keys, inbox, RECOVERY_CONSUMER, by_api)
                continue
            if alive and (live_consumer is None or name == live_consumer.decode()):
                # the live incarnation's own, or (its identity not written yet: a Redis
                # restarted empty, a rank starting) possibly: never resumed from under it
                continue
            if int(c.get("pending", 0)):
                await _resume_pending(r, keys, inbox, name, by_api)
            await r.xgroup_delconsumer(inbox, K.ENGINE_GROUP, name)
        tail = tails.get(rank)
        if tail and not isinstance(tail, Exception):   # (an empty inbox: nothing to read)
            await _resume_undelivered(r, keys, inbox, tail[0][0], by_api)
    return by_api


async def _resume_undelivered(r: Redis, keys: K.Keys, inbox: str, bound: Any,
                              by_api: dict[str, list[str]]) -> None:
    """Read, page by page, what the dead rank never got, up to ``bound``; each page's
    notices, requeues and acks in one transaction."""
    while True:
        resp = await r.xreadgroup(K.ENGINE_GROUP, RECOVERY_CONSUMER, {inbox: ">"}, count=PAGE)
        entries = [(eid, fields) for _, batch in (resp or []) for eid, fields in batch]
        if not entries:
            return
        page = plan_page(entries, bound, _now_ms())
        await _notify_and_ack(r, keys, inbox, page, by_api)
        if page.at_bound:
            return


async def _resume_pending(r: Redis, keys: K.Keys, inbox: str, consumer: str,
                          by_api: dict[str, list[str]]) -> None:
    """Claim, page by page, everything pending under ``consumer`` for ``recovery``; each
    page's resume notices and acks in one transaction. Ends when nothing is pending."""
    while True:
        pending = await r.xpending_range(inbox, K.ENGINE_GROUP, min="-", max="+", count=PAGE,
                                         consumername=consumer)
        ids = [p["message_id"] for p in pending]
        if not ids:
            return
        # (recovery's own leftovers too: XCLAIM returns the entries of the ids it owns)
        claimed = await r.xclaim(inbox, K.ENGINE_GROUP, RECOVERY_CONSUMER, min_idle_time=0, message_ids=ids)
        page = plan_page([(eid, f) for eid, f in claimed if f], None, _now_ms())
        # Ids whose entries were trimmed or deleted are acked too (nothing to resume).
        page.ack = ids
        await _notify_and_ack(r, keys, inbox, page, by_api)


async def _notify_and_ack(r: Redis, keys: K.Keys, inbox: str, page: Page,
                          by_api: dict[str, list[str]]) -> None:
    notices: dict[str, list[str]] = {}
    _collect(page.resume, notices)
    pipe = atomic(r, inbox)   # on Redis Cluster: the notices first, then the rest (shared/bus.py)
    for api, ids in notices.items():
        pipe.xadd(keys.out(api), {FIELD: encode(Resume(ids))},
                  maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
    for fields in page.requeue:   # (the inbox's slot: in the transaction with the ack)
        pipe.xadd(inbox, fields)
    if page.ack:
        pipe.xack(inbox, K.ENGINE_GROUP, *page.ack)
    await pipe.execute()
    for api, ids in notices.items():
        by_api.setdefault(api, []).extend(ids)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _collect(entries: list[Any], by_api: dict[str, list[str]]) -> None:
    for _, _, doc in decode_entries([(b"inbox", entries)]):
        owner = request_owner(doc)
        if owner is not None:
            by_api.setdefault(owner[0], []).append(owner[1])


async def trim_acked(r: Redis, keys: K.Keys, ranks: list[int]) -> None:
    """Keep the request stream and the inboxes bounded: drop entries both delivered and
    acked (older than the group's oldest pending entry and its last delivered one)."""
    streams = [(keys.requests, K.SCHEDULER_GROUP)] + [(keys.inbox(rank), K.ENGINE_GROUP) for rank in ranks]
    pipe = r.pipeline(transaction=False)
    for stream, group in streams:
        pipe.xinfo_groups(stream)
        pipe.xpending(stream, group)
    res = await pipe.execute(raise_on_error=False)
    pipe = r.pipeline(transaction=False)
    for i, (stream, group) in enumerate(streams):
        groups, pending = res[2 * i], res[2 * i + 1]
        if isinstance(groups, Exception) or isinstance(pending, Exception):
            continue
        delivered = None
        for g in groups:
            g = str_keys(g)
            if g["name"] in (group, group.encode()):
                delivered = g["last-delivered-id"]
        if delivered is None:
            continue
        floor = delivered
        if pending and pending.get("pending") and pending.get("min"):
            floor = min(floor, pending["min"], key=entry_id_key)
        pipe.xtrim(stream, minid=floor, approximate=False)
    await pipe.execute(raise_on_error=False)
