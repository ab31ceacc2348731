"""What the scheduler's jobs share while this process leads: the policy, the step
aggregator, the unplaced requests and where each request went, which ranks may get work. Plain
data, one object; each job file says which fields it writes."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shared.policy.aggregator import StepAggregator
from shared.messages import Request
from shared.stats import Snapshot


@dataclass
class SchedulerState:
    ranks: list[int]
    policy: Any
    agg: StepAggregator
    # The dispatcher id carries this leadership's incarnation (``scheduler.<n>``, set
    # when it becomes leader): engines echo what they received per incarnation, and a new
    # leader's batch numbers sort after the old one's (batch_gate.batch_number).
    dispatcher_id: str = "scheduler"
    counters: dict[str, int] = field(default_factory=lambda: {
        "dispatched": 0, "dispatched_tokens": 0, "explicit": 0, "aborts_routed": 0, "snapshots": 0,
        "bad_entries": 0})
    assigned: OrderedDict[str, int] = field(default_factory=OrderedDict)   # request id -> rank (aborts)
    # read, not placed yet (waterfill, staggered): id -> (stream entry, request)
    unplaced: dict[str, tuple[bytes, Request]] = field(default_factory=dict)
    live: list[int] = field(default_factory=list)
    drained: set[int] = field(default_factory=set)
    last_snapshot: Snapshot | None = None
    wake_batcher: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by any loop's Redis trouble: the request loop then re-takes what it read but did not ack.
    redis_trouble: bool = False

    @property
    def batching(self) -> bool:
        return hasattr(self.policy, "submit")

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
