"""Pausing when no rank has work, and waking together: sleep on one blocking read of the
inbox and ``<ns>:wave`` (no busy loop, no dummy forwards) until work or a wake-up notice for
this wave arrives; a replacement's notice asks the group to re-form instead."""

from __future__ import annotations

import asyncio
from typing import Any

from services.engine_worker.inbox_reader import InboxReader
from services.engine_worker.rank_state import RankState
from shared import keys as K
from shared import trace
from shared.bus import TRANSIENT, Recorder, decode_entries, retrying
from shared.messages import FIELD, MessageError, WaveNotice, encode, request_owner
from shared.settings import EngineSettings


class Pause:
    """Writes ``state.reform_requested``; what the pause read goes to the reader (prefetched)."""

    def __init__(self, r: Any, keys: K.Keys, settings: EngineSettings, state: RankState, reader: InboxReader,
                 member: Any, stopping: asyncio.Event, log: Any) -> None:
        self.r, self.keys, self.s, self.state, self.reader = r, keys, settings, state, reader
        self.member, self.stopping, self.log = member, stopping, log
        self.wave_last: bytes = b"0-0"     # last wake notice seen

    async def pause(self) -> None:
        """Nobody has work: sleep on Redis (no busy loop, no dummy forwards) until work
        reaches this rank's inbox or a wake-up notice for this wave arrives. Reads resume
        from the last ids seen, so an arrival between the decision and the read is never
        missed.

        Work read here is admitted at once (the consumer-group claim rides on the first
        step's round trip). The rank that found it wakes the others with a notice, unless
        the same read brought the dispatcher's notice (shared/wake.py): then every rank
        woke at the same moment and nobody waits for a second hop."""
        st = self.state
        if self.reader.fetched:
            # the claim on the way into this pause (outputs.flush) read past what it claimed:
            # work is here already, and a sleep would keep it waiting for someone else's
            await self.reader.execute(self.wake_notice())
            return
        inbox = self.keys.inbox(st.rank)
        arrived: list[tuple[bytes, dict[str, Any]]] = []
        notified = False
        while not (arrived or notified or st.reform_requested or self.stopping.is_set()):
            self.member.mark_progress()   # paused is legitimate: the read returns every heartbeat
            st.round_trips += 1
            try:
                resp = await retrying(lambda: self.r.xread({inbox: self.reader.inbox_last,
                                                            self.keys.wave: self.wave_last},
                                                           block=self.s.heartbeat_ms, count=16),
                                      log=self.log, what="pause", on_retry=self.reader.on_redis_retry,
                                      stop=self.stopping)
            except TRANSIENT:
                if not self.stopping.is_set():
                    raise
                # Told to stop while Redis is gone: no read, and nobody to wake; the step
                # loop's next round trip waits the outage out, bounded (inbox_reader.py).
                return
            for stream, eid, doc in decode_entries(resp):
                if stream.decode() == self.keys.wave:
                    self.wave_last = eid
                    try:
                        notice = WaveNotice.from_dict(doc)
                    except MessageError as exc:   # skipped: a bad notice must not stop a paused rank
                        self.log.error("bad_wave_notice", entry=eid.decode(), error=str(exc))
                        continue
                    if notice.reform and notice.r != st.rank and notice.reform >= self.member.gen:
                        st.reform_requested = True
                    elif notice.w >= st.wave:
                        notified = True
                else:
                    arrived.append((eid, doc))
        if not arrived:
            if self.stopping.is_set() and not notified and not st.reform_requested:
                # Stopping or leaving while the group sleeps: the others must meet this
                # rank's last step (where they learn it goes), not sleep on.
                await self.reader.execute(self.wake_notice())
            return   # woken by a notice, or stopping: the next step's round trip reads the inbox
        if trace.ENABLED:
            trace.mark(f"rank_wake:{st.rank}")
        for eid, doc in arrived:
            owner = request_owner(doc)
            self.reader.prefetched[eid] = owner[1] if owner is not None else None
            self.reader.fetch(eid, doc)
        if notified:
            return
        await self.reader.execute(self.wake_notice())

    def wake_notice(self) -> Recorder:
        st = self.state
        pipe = Recorder()
        pipe.xadd(self.keys.wave, {FIELD: encode(WaveNotice(st.wave, st.rank))},
                  maxlen=K.WAVE_STREAM_MAXLEN, approximate=True)
        pipe.delete(self.keys.paused)   # woken: a later dispatch must not send a notice too
        return pipe
