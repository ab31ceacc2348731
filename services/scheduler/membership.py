"""Which ranks may get work: every 250 ms read the ranks' heartbeats, their consumer names
and ``<ns>:drained``; on a change tell the aggregator and the policy, and have dead ranks'
work resumed at once (also when a spare replaced a rank before a heartbeat went missing).
The same read brings each rank's step size (``step_tokens``, its max_num_batched_tokens),
which waterfill's level follows unless an operator set ``level_tokens``, and its sequence
slots (``max_seqs``, its max_num_seqs), which waterfill uses to bind nothing to a full rank."""

from __future__ import annotations

import asyncio
from typing import Any

from services.scheduler.recovery import Recovery
from services.scheduler.state import SchedulerState
from shared import keys as K
from shared.policy.waterfill import level_for

POLL_S = 0.25


class Membership:
    """Writes ``state.live`` and ``state.drained``."""

    def __init__(self, r: Any, keys: K.Keys, state: SchedulerState, recovery: Recovery, log: Any,
                 follow_step_tokens: bool = False) -> None:
        self.r, self.keys, self.state, self.recovery, self.log = r, keys, state, recovery, log
        self.follow_step_tokens = follow_step_tokens   # set the policy's level from the ranks' step size
        self.consumers: dict[int, bytes | None] = {}   # rank -> consumer name of its current incarnation
        self._slots: dict[int, int] = {}                # rank -> max_num_seqs, as last given to the policy

    async def iteration(self) -> None:
        st = self.state
        pipe = self.r.pipeline(transaction=False)
        for r in st.ranks:
            pipe.exists(self.keys.rank_alive(r))
            pipe.hmget(self.keys.rank_info(r), ["consumer", "step_tokens", "max_seqs"])
        pipe.smembers(self.keys.drained)
        res = await pipe.execute()
        live = [r for r, alive in zip(st.ranks, res[:-1:2]) if alive]
        self.recovery.ever_alive.update(live)
        drained = {int(x) for x in res[-1]}
        info = dict(zip(st.ranks, res[1:-1:2]))
        if self.follow_step_tokens:
            self._follow([info[r][1] for r in live])
        self._follow_slots({r: info[r][2] for r in live})
        # A new incarnation of a rank (a hot spare took the slot of a dead process before
        # this loop saw it empty): what the old one had is resumed now, not at the next scan.
        consumers = {r: v[0] for r, v in info.items()}
        new = [r for r, c in consumers.items() if self.consumers.get(r) not in (None, c)]
        if new:
            self.recovery.soon()
            for r in new:   # its reports begin a new sequence (the aggregator's restarted)
                st.agg.restarted(r)
        self.consumers = consumers
        if live != st.live or drained != st.drained:
            self.log.info("ranks_changed", live=live, drained=sorted(drained))
            st.live, st.drained = live, drained
            st.agg.set_live(live)
            eligible = [r for r in live if r not in drained] or [r for r in st.ranks if r not in drained]
            st.policy.set_ranks(eligible or st.ranks)
            if st.batching:
                st.wake_batcher.set()   # fewer ranks can make the unplaced requests a full batch
            self.recovery.soon()
        await self.recovery.scan_if_due()
        await asyncio.sleep(POLL_S)

    def _follow(self, step_tokens: list[Any]) -> None:
        """Waterfill's level from the live ranks' step size (checked every poll: a new
        leader's policy starts at the default engine's)."""
        policy = self.state.policy
        if not any(step_tokens) or not hasattr(policy, "set_level"):
            return
        level = level_for(step_tokens)
        if policy.level != level:
            policy.set_level(level)
            self.log.info("level_tokens_follows_engines", level_tokens=level)

    def _follow_slots(self, max_seqs: dict[int, Any]) -> None:
        """Each live rank's sequence slots, for a policy that binds nothing to a full rank."""
        policy = self.state.policy
        if not hasattr(policy, "set_max_seqs"):
            return
        slots = {r: int(m) for r, m in max_seqs.items() if m}
        if slots != self._slots:
            self._slots = slots
            policy.set_max_seqs(slots)
