"""Leaving alone (SIGTERM): what this rank still holds is handed over, resumed on the other
ranks by its api-servers (a ``resume`` notice on ``<ns>:out:<api>``), then acked."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from services.engine_worker.inbox_reader import InboxReader, raw_entries
from services.engine_worker.outputs import Outputs
from services.engine_worker.rank_state import RankState
from shared import keys as K
from shared.bus import atomic, decode_entries, retrying
from shared.messages import FIELD, dumps, request_owner

HAND_OVER_PAGE = 500
HAND_OVER_GIVE_UP_S = 20.0   # Redis down longer: leave anyway; the scheduler resumes what stays pending


class HandOver:
    def __init__(self, r: Any, keys: K.Keys, state: RankState, reader: InboxReader, outputs: Outputs,
                 log: Any) -> None:
        self.r, self.keys, self.state, self.reader, self.outputs, self.log = r, keys, state, reader, outputs, log

    async def hand_over(self) -> None:
        """Leaving alone (SIGTERM): what this rank still holds resumes on the others.

        Handed over, not finished here: a leave is then bounded by one step, whatever the
        requests' lengths (an orchestrator's grace period is seconds), and it is the path
        a crashed rank's requests already take, so it is exact in the same way: every
        delta this rank wrote precedes the resume notice in its api-server's stream, and
        the api-server resubmits the request with exactly the tokens the client has, so
        no token is lost or sent twice. The notices and the acks of each page go in one
        MULTI (ack after durable); everything pending under this consumer is paged
        through, including entries read but not yet admitted. Entries never read stay in
        the inbox for the slot's next owner."""
        try:
            await self.outputs.flush()
            n = await self._hand_over_pending()
        except Exception as exc:  # noqa: BLE001 - what is left stays pending: recovery resumes it
            self.log.error("hand_over_failed", error=str(exc)[:200])
            return
        self.log.warning("engine_left_group", handed_over=n, wave=self.state.wave, step=self.state.step)

    async def _hand_over_pending(self) -> int:
        inbox, start, n = self.keys.inbox(self.state.rank), "0", 0
        while True:
            resp = await retrying(lambda: self.r.xreadgroup(K.ENGINE_GROUP, self.reader.consumer, {inbox: start},
                                                            count=HAND_OVER_PAGE),
                                  log=self.log, what="hand_over", give_up_s=HAND_OVER_GIVE_UP_S)
            raw = raw_entries(resp)
            if not raw:
                return n
            start = raw[-1][0]
            by_api: dict[str, list[str]] = defaultdict(list)
            for _, _, doc in decode_entries([(inbox.encode(), [e for e in raw if e[1] is not None])]):
                owner = request_owner(doc)
                if owner is not None:
                    by_api[owner[0]].append(owner[1])

            async def send() -> None:
                pipe = atomic(self.r, inbox)   # Redis Cluster: the notices, then the ack (shared/bus.py)
                for api, ids in by_api.items():
                    pipe.xadd(self.keys.out(api), {FIELD: dumps({"k": "resume", "ids": ids})},
                              maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
                pipe.xack(inbox, K.ENGINE_GROUP, *[eid for eid, _ in raw])
                pipe.xdel(inbox, *[eid for eid, _ in raw])
                await pipe.execute()
            await retrying(send, log=self.log, what="hand_over", give_up_s=HAND_OVER_GIVE_UP_S)
            n += sum(len(v) for v in by_api.values())
