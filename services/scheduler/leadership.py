"""The scheduler's lease ``<ns>:leader``: campaign until this process leads (standbys wait
here), announce it, renew it every third of the lease and step down when another holds it."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Callable

from services.scheduler.state import SchedulerState
from shared import keys as K
from shared import lease
from shared.bus import retrying
from shared.messages import dumps
from shared.replies import as_str
from shared.settings import SchedulerSettings


class Leadership:
    """Writes ``state.dispatcher_id`` and ``state.policy`` (a fresh one per incarnation)."""

    def __init__(self, r: Any, keys: K.Keys, settings: SchedulerSettings, owner: str, state: SchedulerState,
                 make_policy: Callable[[str], Any], log: Any, stop: asyncio.Event) -> None:
        self.r, self.keys, self.s, self.id = r, keys, settings, owner
        self.state, self.make_policy, self.log, self.stop = state, make_policy, log, stop

    async def become_leader(self) -> bool:
        """Campaign until the lease is ours (True) or we stop (False). Redis going away
        meanwhile is waited out with backoff like everywhere else: a standby that exited
        on it (as one did at every Redis restart of the chaos run) is no standby."""
        while not self.stop.is_set():
            try:
                if await retrying(self._campaign, log=self.log, what="leader_campaign", stop=self.stop):
                    return True
            except Exception:  # noqa: BLE001 - only raised once stopping (retrying gives up then)
                if self.stop.is_set():
                    return False
                raise
            try:
                await asyncio.wait_for(self.stop.wait(), self.s.lease_ms / 3000)
            except TimeoutError:
                pass
        return False

    async def _campaign(self) -> bool:
        # Ours already: a previous try took the lease and lost the connection after it.
        won = (await self.r.set(self.keys.leader, self.id, nx=True, px=self.s.lease_ms)
               or await self.r.get(self.keys.leader) == self.id.encode())
        if won:
            self.state.dispatcher_id = f"scheduler.{await self.r.incr(self.keys.incarnation)}"
            # nothing placed yet: a fresh view, under the new id
            self.state.policy = self.make_policy(self.state.dispatcher_id)
            await self._announce()
        return bool(won)

    async def _announce(self) -> None:
        """Record who leads and the cluster settings this scheduler knows (again after a
        restarted server lost them)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys.scheduler, mapping={"leader": self.id, "pid": os.getpid(), "policy": self.s.policy,
                                                "dispatcher": self.state.dispatcher_id, "since": time.time()})
        pipe.hset(self.keys.cluster, mapping={"ranks": self.s.ranks, "policy": self.s.policy,
                                              "dispatch": self.s.dispatch, "api_servers": self.s.num_api_servers})
        await pipe.execute()

    async def renew_lease(self) -> None:
        """One renewal, after a third of the lease; also writes the leader's counters."""
        await asyncio.sleep(self.s.lease_ms / 3000)
        # Fenced (shared/lease.py): extended only while it is ours, taken back only if free
        # (a restarted server, a long outage); another leader's lease is never overwritten.
        before = await self.r.get(self.keys.leader)
        holder = await lease.renew(self.r, self.keys.leader, self.id, self.s.lease_ms)
        if before is None and lease.is_holder(holder, self.id):
            self.log.warning("lease_reacquired")
            await self._announce()
        if not lease.is_holder(holder, self.id):
            self.log.error("leadership_lost", holder=None if holder is None else as_str(holder))
            self.stop.set()
            return
        st = self.state
        await self.r.hset(self.keys.scheduler, mapping={
            "counters": dumps({**st.counters, **_agg_counters(st)}), "t": time.time(), "leader": self.id,
            "policy": self.s.policy, "live": dumps(st.live), "drained": dumps(sorted(st.drained))})


def _agg_counters(st: SchedulerState) -> dict[str, int]:
    out = {f"agg_{k}": v for k, v in st.agg.counters().items()}
    # stats() first: a batching policy's include its unplaced requests (`lockstep watch`)
    policy_counters = getattr(st.policy, "stats", None) or getattr(st.policy, "counters")
    out.update({f"policy_{k}": v for k, v in policy_counters().items()})
    return out
