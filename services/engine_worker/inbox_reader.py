"""Reading this rank's inbox (``<ns>:rank:<r>:inbox``, group ``engine``) on the step
loop's round trips: new entries, or after a possibly lost reply this consumer's own pending
ones again, page by page; entries a wake-up read admitted before they were claimed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.engine_worker.rank_state import RankState
from shared import cancels
from shared import keys as K
from shared.bus import Recorder, decode_entries, ensure_group, entry_id_key, execute_recorded
from shared.messages import loads


# A rank told to stop (or leave) waits out a Redis outage this long, then exits: what it
# holds stays pending in its inbox, where the scheduler resumes it on another rank (the
# hand-over's bound too, hand_over.py). Forever was a rank that outlived its cluster.
STOPPING_REDIS_GRACE_S = 20.0


class InboxReader:
    """Writes ``state.acks`` (entries to ack without admitting them) and ``state.round_trips``."""

    def __init__(self, r: Any, keys: K.Keys, state: RankState, consumer: str, log: Any,
                 stopping: asyncio.Event | None = None) -> None:
        self.r, self.keys, self.state, self.consumer, self.log = r, keys, state, consumer, log
        self.stopping = stopping   # set: a Redis outage is waited out STOPPING_REDIS_GRACE_S at most
        self.inbox_last: bytes = b"0-0"     # last inbox entry delivered to this rank
        self.fetched: list[tuple[bytes, dict[str, Any]]] = []   # read, not yet admitted (ingest.py)
        # Inbox entries taken straight from the wake-up read, before this consumer claimed
        # them (entry id -> request id, None for an abort): the claim rides on the next
        # step's read, which must neither admit them twice nor leave a finished one pending.
        self.prefetched: dict[bytes, str | None] = {}
        # Aborts and retirements popped from this rank's cancels list (shared/cancels.py),
        # not yet applied (ingest.py)
        self.cancels: list[dict[str, Any]] = []
        self._reread_from: str | bytes | None = None   # after a Redis error: re-read our pending entries from here
        self._history_read = False                # the read in flight is such a re-read (paged until empty)

    async def execute(self, pipe: Recorder) -> list[Any]:
        """One round trip; through a Redis outage it backs off and replays (the work on
        this rank stays in memory; readers dedupe, so a replayed write is harmless)."""
        self.state.round_trips += 1
        self.state.redis_waiting_since = time.monotonic()
        try:
            return await execute_recorded(self.r, pipe, log=self.log, what="step", on_retry=self.on_redis_retry,
                                          stop=self.stopping, stop_grace_s=STOPPING_REDIS_GRACE_S)
        finally:
            self.state.redis_waiting_since = None

    async def on_redis_retry(self) -> None:
        self.state.redis_failed_at = time.monotonic()   # (the api-server watch discounts lapses now)
        # A reply may have been lost after the server delivered inbox entries to us: read
        # this consumer's pending entries once more (ingest ignores what it already has).
        # A restarted server may have lost the consumer group: recreate it.
        self._reread_from = "0"
        await ensure_group(self.r, self.keys.inbox(self.state.rank), K.ENGINE_GROUP, "0")

    def pop_cancels(self, pipe: Recorder) -> None:
        """Queue the pop of this rank's cancels list on ``pipe``; :meth:`take_cancels` takes
        its reply. Every step, whatever the inbox's backlog: that is the point of it."""
        pipe.lpop(self.keys.cancels(self.state.rank), cancels.POP_COUNT)

    def take_cancels(self, resp: Any) -> None:
        for blob in resp or ():
            try:
                doc = loads(blob)
            except Exception:  # noqa: BLE001 - the inbox holds the same message: it is read there
                continue
            if isinstance(doc, dict):
                self.cancels.append(doc)

    def take_all_cancels(self) -> list[dict[str, Any]]:
        got, self.cancels = self.cancels, []
        return got

    async def poll(self, wait_ms: float, count: int) -> None:
        """Wait ``wait_ms``, then take what reached the inbox meanwhile (a held group's
        rounds). The wait is a client-side sleep and the read does not block: a server-side
        BLOCK this short ends only at the server's next cron tick when nothing arrives,
        100 ms at Redis' and Valkey's default ``hz`` of 10 (a 2 ms hold round took 100)."""
        await asyncio.sleep(wait_ms / 1000.0)
        pipe = Recorder()
        self.pop_cancels(pipe)
        pipe.xreadgroup(K.ENGINE_GROUP, self.consumer, {self.keys.inbox(self.state.rank): self.read_from()},
                        count=count)
        got = await self.execute(pipe)
        self.take_cancels(got[-2])
        self.take(got[-1])

    def read_from(self) -> str | bytes:
        """'>' (new entries), or after a possibly lost reply this consumer's own pending
        entries, page by page from the last one read until a page comes back empty (each
        read takes at most ``count``: one page could strand the rest in our pending list)."""
        self._history_read = self._reread_from is not None
        return ">" if self._reread_from is None else self._reread_from

    def take(self, resp: Any) -> None:
        """The reply of a read issued with ``read_from()``."""
        if self._history_read:
            self._history_read = False
            raw = raw_entries(resp)
            self._reread_from = raw[-1][0] if raw else None   # next page after it; None: done
            # A pending entry deleted from the stream comes back without fields: ack it.
            self.state.acks.extend(eid for eid, fields in raw if fields is None)
        for _, eid, doc in decode_entries(resp):
            if eid in self.prefetched:
                # Admitted at wake-up; this read only made it ours. Already finished or an
                # abort: ack it now that the ack counts.
                rid = self.prefetched.pop(eid)
                if rid is None or self.state.entry_of.get(rid) != eid:
                    self.state.acks.append(eid)
                continue
            self.fetch(eid, doc)

    def fetch(self, eid: bytes, doc: dict[str, Any]) -> None:
        self.fetched.append((eid, doc))
        if entry_id_key(eid) > entry_id_key(self.inbox_last):
            self.inbox_last = eid

    def take_all(self) -> list[tuple[bytes, dict[str, Any]]]:
        """What was read and not yet admitted, now handed over."""
        fetched, self.fetched = self.fetched, []
        return fetched


def raw_entries(resp: Any) -> list[tuple[bytes, Any]]:
    """(id, fields) of an XREADGROUP reply for one stream (RESP2 list or RESP3 dict)."""
    if not resp:
        return []
    items = resp.items() if isinstance(resp, dict) else resp
    out: list[tuple[bytes, Any]] = []
    for _, entries in items:
        if entries and isinstance(entries[0], list) and not isinstance(entries[0][0], bytes):
            entries = entries[0]
        out.extend((eid, fields) for eid, fields in entries)
    return out
