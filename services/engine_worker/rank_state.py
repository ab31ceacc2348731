"""What the engine worker's jobs share: the rank's (wave, step) counters, its pure core
(EngineScheduler, BatchGate, RankStep), what it remembers per request, and the outputs
and acks waiting for the next round trip. Plain data, one object; each job file says which
fields it writes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.guided import Guides
from services.engine_worker.rank_step import RankStep
from services.engine_worker.recv_marks import RecvMarks
from services.engine_worker.sequence import Sequence
from services.engine_worker.slot_turnover import SlotTurnover
from services.engine_worker.step_logprobs import StepLogprobs


SLOW_ROUND_TRIP_S = 1.0   # a step's Redis round trip takes a millisecond or two


@dataclass
class RankState:
    rank: int
    core: EngineScheduler
    gate: BatchGate
    rs: RankStep                 # the step decisions: the simulator runs the same object
    wave: int = 0
    step: int = 0
    backend: Any = None          # set once the group formed (torch runner or SimBackend)
    turnover: SlotTurnover | None = None   # the requests it can finish a step (outputs.py reports it)
    metrics: Any = None
    # per request (ingest.py adds, forget() drops)
    entry_of: dict[str, bytes] = field(default_factory=dict)    # seq id -> inbox entry id (acked at finish)
    recv: RecvMarks = field(default_factory=RecvMarks)   # dispatcher incarnation -> highest seq received
    prompts: dict[str, list[int]] = field(default_factory=dict)
    eos_from: dict[str, float] = field(default_factory=dict)    # sim: first position EOS may end a request
    lp: StepLogprobs = field(default_factory=StepLogprobs)      # logprobs of the requests that ask for them
    guides: Guides = field(default_factory=Guides)              # grammar matchers of structured-output requests
    # for the next round trip (outputs.py writes them)
    acks: list[bytes] = field(default_factory=list)             # inbox entries to ack
    aborted: list[Sequence] = field(default_factory=list)       # aborted seqs whose final delta is pending
    # Aborts and retirements from the cancels list (shared/cancels.py) of requests not read
    # yet: applied as each is admitted, dropped as the inbox's own copy of the message is
    # read (it comes after the request). Bounded: the oldest go first (ingest.py)
    cancelled: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    early: list[Any] = field(default_factory=list)              # outputs decided at admission (rejections)
    # figures of the step loop
    round_trips: int = 0         # Redis round trips of the step loop (goal: one per step)
    idle_forwards: int = 0
    exchange_s: float = 0.0      # wall time in the step collective (incl. waiting for peers)
    reform_requested: bool = False   # a replacement's notice arrived while paused
    redis_failed_at: float = float("-inf")   # monotonic time of the step loop's last refused Redis round trip
    redis_waiting_since: float | None = None   # a step-loop round trip in flight since (monotonic), or None
    # monotonic time of the liveness thread's last failed beat (membership.py): set from that thread
    beat_failed_at: float = float("-inf")

    def redis_trouble_at(self, now: float) -> float:
        """When this rank last found Redis refusing its writes, or not answering them: a
        round trip in flight for over a second (a write pause, CLIENT PAUSE WRITE as a
        FAILOVER does, blocks writes where a full Redis refuses them) counts as now. The
        liveness thread's beats count too: a step loop waiting in the collective for a peer
        that is stuck on Redis makes no round trip at all, and judged by its own trouble
        alone, it took the api-servers' lapsed keys for dead api-servers (CI, a full Redis)."""
        since = self.redis_waiting_since
        if since is not None and now - since > SLOW_ROUND_TRIP_S:
            return now
        return max(self.redis_failed_at, self.beat_failed_at)

    def note_beat_failed(self, now: float) -> None:
        """The liveness thread's write was refused or timed out at monotonic ``now`` (called
        from that thread: one float store)."""
        self.beat_failed_at = now

    def forget(self, seq_id: str) -> bytes | None:
        """Drop what is kept for a finished request; its inbox entry id (to ack), if any."""
        self.prompts.pop(seq_id, None)
        self.rs.forget(seq_id)
        self.eos_from.pop(seq_id, None)
        self.lp.forget(seq_id)
        self.guides.forget(seq_id)
        free = getattr(self.backend, "free_seq", None)
        if free is not None:
            free(seq_id)
        return self.entry_of.pop(seq_id, None)
