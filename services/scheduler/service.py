"""The scheduler service (imperative shell): campaign for the lease, then run one loop per
job until stopped. The jobs share one ``SchedulerState`` (state.py):

- leadership.py: the lease ``<ns>:leader`` (campaign, renewal, stepping down);
- intake.py: the request stream -> policy -> inbox_writer.py (inboxes, records, acks);
- batching.py: staggered batches released by deadline;
- step_publisher.py: step reports -> StepAggregator -> snapshots (with queue_eta.py's wait);
- membership.py: heartbeats and drained ranks -> which ranks may get work;
- recovery.py: dead ranks' work resumed, acked entries trimmed.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from services.scheduler.batching import BatchReleaser
from services.scheduler.inbox_writer import InboxWriter
from services.scheduler.intake import Intake
from services.scheduler.leadership import ClusterMismatch, Leadership
from services.scheduler.lease_keeper import LeaseKeeper
from services.scheduler.loops import resilient
from services.scheduler.membership import Membership
from services.scheduler.recovery import Recovery
from services.scheduler.state import SchedulerState
from services.scheduler.step_publisher import StepPublisher
from shared import keys as K
from shared import lease
from shared.bus import TRANSIENT, ensure_group, open_service_connection
from shared.logging import configure
from shared.policy.aggregator import StepAggregator
from shared.policy.registry import make_policy
from shared.policy.waterfill import level_for
from shared.settings import SchedulerSettings


RELEASE_TIMEOUT_S = 2.0   # a stopping scheduler's last write (its lease): not worth a longer wait


class SchedulerService:
    def __init__(self, settings: SchedulerSettings) -> None:
        self.s = settings
        self.keys = K.Keys(settings.namespace)
        self.id = f"sched-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.log = configure("scheduler", settings.log_level, scheduler=self.id)
        self.ranks = list(range(settings.ranks))
        agg = StepAggregator(self.ranks, grace_s=settings.grace_ms / 1000,
                             min_interval_s=settings.snapshot_min_interval_ms / 1000)
        self.state = SchedulerState(self.ranks, self._make_policy("scheduler"), agg, live=list(self.ranks))
        self.stop = asyncio.Event()
        self.metrics: Any = None

    def _make_policy(self, dispatcher_id: str) -> Any:
        s = self.s
        extra = ({"max_wait_ms": s.max_wait_ms} if s.policy == "staggered" else
                 {"level_tokens": s.level_tokens or level_for(None), **s.waterfill_kwargs()}
                 if s.policy == "waterfill" else {})
        return make_policy(s.policy, dispatcher_id=dispatcher_id, num_api_servers=s.num_api_servers,
                           ranks=self.ranks, **extra)

    def attach(self, r: Any) -> None:
        """Build the jobs on Redis client ``r`` (``run`` does; tests drive one job alone)."""
        self.r = r
        st, keys, log = self.state, self.keys, self.log
        self.leadership = Leadership(r, keys, self.s, self.id, st, self._make_policy, log, self.stop)
        self.writer = InboxWriter(keys, self.s, st, log)
        self.intake = Intake(r, keys, self.s, self.id, st, self.writer, log)
        self.batches = BatchReleaser(r, keys, st, self.writer)
        self.steps = StepPublisher(r, keys, st, log)
        self.recovery = Recovery(r, keys, st, log)
        self.membership = Membership(r, keys, st, self.recovery, log,
                                     follow_step_tokens=self.s.policy == "waterfill" and not self.s.level_tokens)

    # What metrics.py and the tests read.
    policy = property(lambda self: self.state.policy)
    agg = property(lambda self: self.state.agg)
    counters = property(lambda self: self.state.counters)
    live = property(lambda self: self.state.live)
    drained = property(lambda self: self.state.drained)
    unplaced = property(lambda self: self.state.unplaced)
    last_snapshot = property(lambda self: self.state.last_snapshot)
    dispatcher_id = property(lambda self: self.state.dispatcher_id)

    async def run(self) -> int:
        r = await open_service_connection(self.s.redis_url, self.log, self.stop, self.s.redis_wait_s)
        if r is None:
            return 2
        self.attach(r)
        await ensure_group(self.r, self.keys.requests, K.SCHEDULER_GROUP, "0")
        try:
            if not await self.leadership.become_leader():
                return 0
        except ClusterMismatch as exc:   # a setting: a restart cannot help
            self.log.error("scheduler_refused", error=str(exc))
            await self.r.aclose()
            return 2
        self.log.info("scheduler_leading", policy=self.s.policy, ranks=self.s.ranks,
                      dispatcher=self.state.dispatcher_id)
        self.leadership.keeper = LeaseKeeper(self.s.redis_url, self.keys.leader, self.id, self.s.lease_ms, self.log)
        stop_keeper = self.leadership.keeper.start()
        try:
            from services.scheduler.metrics import start_metrics
            self.metrics = self.writer.metrics = start_metrics(self, self.s.metrics_port, self.s.metrics_host,
                                                               self.log)
            # First what this consumer (or a dead predecessor) read but never acked.
            self.state.redis_trouble = True
            loops = {"requests": self.intake.iteration, "stats": self.steps.iteration,
                     "membership": self.membership.iteration, "lease": self.leadership.renew_lease}
            if self.state.batching:
                loops["batches"] = self.batches.iteration
            tasks = [asyncio.create_task(self._loop(what, it)) for what, it in loops.items()]
            stopper = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in done:
                if t is not stopper and t.exception():
                    self.log.error("scheduler_failed", error=repr(t.exception()))
        finally:   # before the release: it must not extend the lease after it
            stop_keeper()
        try:   # only if still ours; Redis may be gone (then the lease lapses after lease_ms)
            await asyncio.wait_for(lease.release(self.r, self.keys.leader, self.id), RELEASE_TIMEOUT_S)
        except (TimeoutError, *TRANSIENT) as exc:
            self.log.warning("lease_not_released", error=str(exc)[:200] or "timeout", lapses_in_ms=self.s.lease_ms)
        finally:
            await self.r.aclose()
        return 0

    async def _loop(self, what: str, iteration: Any) -> None:
        def trouble() -> None:
            self.state.redis_trouble = True
        await resilient(what, iteration, log=self.log, on_trouble=trouble)


def main(settings: SchedulerSettings) -> int:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(SchedulerService(settings).run())
