"""Scheduler housekeeping against Redis: resume the work of dead ranks, trim acked entries.

Both run every couple of seconds from the scheduler's membership loop (and at once when
membership changes); both are safe to run twice.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from shared import keys as K
from shared.bus import decode_entries, entry_id_key
from shared.messages import FIELD, dumps

RECOVERY_CONSUMER = "recovery"


async def recover_orphans(r: Redis, keys: K.Keys, ranks: list[int], live: set[int],
                          ever_alive: set[int]) -> dict[str, list[str]]:
    """Resume the requests of dead ranks on live ones; returns {api: request ids} resumed.

    Each engine incarnation reads its inbox under its own consumer name and acks a request
    only when it finishes, so whatever a dead incarnation held is still pending under its
    name. Those entries are claimed (atomically: one owner), acked, and their api-servers
    get a ``resume`` notice: they resubmit the requests with the tokens already streamed,
    and the new rank re-prefills prompt + those tokens and continues where the stream
    stopped. Entries never delivered to a rank that died and stays dead are resumed too."""
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
            c = {(k.decode() if isinstance(k, bytes) else k): v for k, v in c.items()}
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == RECOVERY_CONSUMER or (alive and live_consumer is not None and name == live_consumer.decode()):
                continue
            if int(c.get("pending", 0)):
                pending = await r.xpending_range(inbox, K.ENGINE_GROUP, min="-", max="+", count=10_000,
                                                 consumername=name)
                ids = [p["message_id"] for p in pending]
                if ids:
                    claimed = await r.xclaim(inbox, K.ENGINE_GROUP, RECOVERY_CONSUMER, min_idle_time=0,
                                             message_ids=ids)
                    _collect(claimed, by_api)
                    await r.xack(inbox, K.ENGINE_GROUP, *ids)
            await r.xgroup_delconsumer(inbox, K.ENGINE_GROUP, name)
        if not alive and rank in ever_alive:
            # (A rank still starting up has not died: its queue waits for it.)
            resp = await r.xreadgroup(K.ENGINE_GROUP, RECOVERY_CONSUMER, {inbox: ">"}, count=10_000)
            entries = [(eid, fields) for _, batch in (resp or []) for eid, fields in batch]
            if entries:
                _collect(entries, by_api)
                await r.xack(inbox, K.ENGINE_GROUP, *[eid for eid, _ in entries])
    if by_api:
        pipe = r.pipeline(transaction=False)
        for api, ids in by_api.items():
            pipe.xadd(keys.out(api), {FIELD: dumps({"k": "resume", "ids": ids})},
                      maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
        await pipe.execute()
    return by_api


def _collect(entries: list[Any], by_api: dict[str, list[str]]) -> None:
    for _, _, doc in decode_entries([(b"inbox", entries)]):
        if doc.get("k") == "req":
            by_api.setdefault(doc["api"], []).append(doc["id"])


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
            g = {(k.decode() if isinstance(k, bytes) else k): v for k, v in g.items()}
            if g["name"] in (group, group.encode()):
                delivered = g["last-delivered-id"]
        if delivered is None:
            continue
        floor = delivered
        if pending and pending.get("pending") and pending.get("min"):
            floor = min(floor, pending["min"], key=entry_id_key)
        pipe.xtrim(stream, minid=floor, approximate=False)
    await pipe.execute(raise_on_error=False)
