"""The scheduler's lease ``<ns>:leader``: campaign until this process leads (standbys wait
here), announce it, renew it every third of the lease and step down when another holds it.

A scheduler whose ``ranks`` contradict the cluster record ``<ns>:cluster`` never leads: it
rewrote the record as it took the lead (a standby started with LOCKSTEP_RANKS=8 took a
healthy 4-rank cluster down: every api-server answered 503 "4 of 8 ranks")."""

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


class ClusterMismatch(RuntimeError):
    """This scheduler's settings contradict the cluster record: it must not lead (exit 2)."""


class Leadership:
    """Writes ``state.dispatcher_id`` and ``state.policy`` (a fresh one per incarnation)."""

    def __init__(self, r: Any, keys: K.Keys, settings: SchedulerSettings, owner: str, state: SchedulerState,
                 make_policy: Callable[[str], Any], log: Any, stop: asyncio.Event) -> None:
        self.r, self.keys, self.s, self.id = r, keys, settings, owner
        self.state, self.make_policy, self.log, self.stop = state, make_policy, log, stop
        # The cluster record as this scheduler last read it: written back whole (backend and
        # port too, which no scheduler setting holds) when a restarted Redis lost it.
        self.record: dict[str, str] = {}
        self.keeper: Any = None   # the lease's thread (lease_keeper.py), once leading: told of each round

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
        # Checked at every try, before the lease: a scheduler that must not lead never holds
        # it (and a standby started with the wrong settings exits at once, not at a failover).
        await self._check_record()
        # Ours already: a previous try took the lease and lost the connection after it.
        won = (await self.r.set(self.keys.leader, self.id, nx=True, px=self.s.lease_ms)
               or await self.r.get(self.keys.leader) == self.id.encode())
        if won:
            self.state.dispatcher_id = f"scheduler.{await self.r.incr(self.keys.incarnation)}"
            # nothing placed yet: a fresh view, under the new id
            self.state.policy = self.make_policy(self.state.dispatcher_id)
            self._warn_differences()
            await self._announce()
        return bool(won)

    async def _check_record(self) -> None:
        """Raise ClusterMismatch where the record names another rank count than this
        scheduler's: `lockstep up`/`init` wrote it for the cluster that runs (a restart with
        another rank count writes it anew before starting the scheduler)."""
        rec = {as_str(k): as_str(v) for k, v in (await self.r.hgetall(self.keys.cluster)).items()}
        if rec.get("ranks") and rec["ranks"] != str(self.s.ranks):
            raise ClusterMismatch(
                f"this scheduler's LOCKSTEP_RANKS is {self.s.ranks} but the cluster record {self.keys.cluster} "
                f"says {rec['ranks']} ranks (written by `lockstep init`, `lockstep up` or the scheduler that led "
                f"first): it does not lead, for leading would rewrite the record and every api-server would wait "
                f"for {self.s.ranks} ranks. Start it with LOCKSTEP_RANKS={rec['ranks']}; if the cluster now has "
                f"{self.s.ranks} ranks, run `lockstep init` with LOCKSTEP_RANKS={self.s.ranks} first")
        if rec:   # none (a Redis restarted empty): the one read before, if any, is written back
            self.record = rec

    def _warn_differences(self) -> None:
        """Settings that do not break the cluster: this scheduler runs its own, the record
        keeps what `lockstep init`/`up` wrote (rerun `lockstep init` to change it)."""
        mine = {"policy": self.s.policy, "dispatch": self.s.dispatch, "api_servers": str(self.s.num_api_servers)}
        differ = {f: f"{self.record[f]} (record) vs {v} (this scheduler)" for f, v in mine.items()
                  if self.record.get(f) and self.record[f] != v}
        if differ:
            self.log.warning("cluster_record_differs", record=self.keys.cluster, **differ,
                             fix="give every scheduler the same settings, or rerun `lockstep init` with them")

    async def _announce(self) -> None:
        """Record who leads, and the cluster record: the one this scheduler read (whole,
        again after a restarted server lost it), its own settings only where it had none."""
        mine = {"ranks": self.s.ranks, "policy": self.s.policy, "dispatch": self.s.dispatch,
                "api_servers": self.s.num_api_servers}
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys.scheduler, mapping={"leader": self.id, "pid": os.getpid(), "policy": self.s.policy,
                                                "dispatcher": self.state.dispatcher_id, "since": time.time()})
        pipe.hset(self.keys.cluster, mapping={**mine, **self.record})
        await pipe.execute()

    async def renew_lease(self) -> None:
        """One renewal, after a third of the lease; also writes the leader's counters."""
        await asyncio.sleep(self.s.lease_ms / 3000)
        if self.keeper is not None:
            self.keeper.mark_progress()
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
