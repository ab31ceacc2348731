"""Scheduler housekeeping against Redis: resume the work of dead ranks, trim acked entries.

Both run every couple of seconds from the scheduler's membership loop (and at once when
membership changes); both are safe to run twice.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

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
    are resumed too (read by ``recovery``, then the same notice + ack)."""
    pipe = r.pipeline(transaction=False)
    for rank in ranks:
        pipe.hget(keys.rank_info(rank), "consumer")
        pipe.xinfo_consumers(keys.inbox(rank), K.ENGINE_GROUP)
    res = await pipe.execute(raise_on_error=False)
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
            if alive and live_consumer is not None and name == live_consumer.decode():
                continue
            if int(c.get("pending", 0)):
                await _resume_pending(r, keys, inbox, name, by_api)
            await r.xgroup_delconsumer(inbox, K.ENGINE_GROUP, name)
        if not alive and rank in ever_alive:
            # (A rank still starting up has not died: its queue waits for it.)
            while True:
                resp = await r.xreadgroup(K.ENGINE_GROUP, RECOVERY_CONSUMER, {inbox: ">"}, count=PAGE)
                entries = [(eid, fields) for _, batch in (resp or []) for eid, fields in batch]
                if not entries:
                    break
                await _notify_and_ack(r, keys, inbox, entries, by_api)
    return by_api


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
        # Ids whose entries were trimmed or deleted are acked too (nothing to resume).
        await _notify_and_ack(r, keys, inbox, [(eid, f) for eid, f in claimed if f], by_api, ack=ids)


async def _notify_and_ack(r: Redis, keys: K.Keys, inbox: str, entries: list[Any],
                          by_api: dict[str, list[str]], ack: list[Any] | None = None) -> None:
    page: dict[str, list[str]] = {}
    _collect(entries, page)
    pipe = atomic(r, inbox)   # on Redis Cluster: the notices first, then the ack (shared/bus.py)
    for api, ids in page.items():
        pipe.xadd(keys.out(api), {FIELD: encode(Resume(ids))},
                  maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
    ack = ack if ack is not None else [eid for eid, _ in entries]
    if ack:
        pipe.xack(inbox, K.ENGINE_GROUP, *ack)
    await pipe.execute()
    for api, ids in page.items():
        by_api.setdefault(api, []).extend(ids)


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
