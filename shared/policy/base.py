"""What every dispatch policy offers, so the scheduler, the api-servers (client dispatch)
and the simulator drive the same objects. Policies are pure: no I/O, time passed in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shared.stats import Snapshot


@dataclass(slots=True, frozen=True)
class RequestInfo:
    """What a policy may know about a request when it places it."""

    id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float


@dataclass(slots=True, frozen=True)
class Assignment:
    """A placement decision: request -> rank, optionally as part of a staggered batch."""

    request_id: str
    rank: int
    batch: str | None = None
    batch_counts: tuple[int, ...] | None = None
    reason: str = "dispatch"
    dispatcher: str = ""      # who decided (scheduler id or api-server id)
    seq: int = 0              # per-(dispatcher, rank) sequence number; engines echo the
                              # highest one they received in RankStats.recv, so a policy
                              # knows exactly which of its dispatches a snapshot already shows


@runtime_checkable
class DispatchPolicy(Protocol):
    """Immediate placement: one request in, one rank out."""

    name: str

    def set_ranks(self, ranks: list[int]) -> None:
        """Live, non-drained ranks that may receive work."""

    def on_snapshot(self, snap: Snapshot) -> None:
        """A new step-consistent view replaces the local estimates."""

    def choose(self, req: RequestInfo, now: float) -> Assignment:
        """Pick a rank and add the request to the local view of that rank."""

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        """Record a request whose rank was fixed by the client (data_parallel_rank)."""


@runtime_checkable
class BatchingPolicy(Protocol):
    """Placement that keeps requests unplaced a while (waterfill, staggered batches) and releases them later."""

    name: str

    def set_ranks(self, ranks: list[int]) -> None: ...

    def on_snapshot(self, snap: Snapshot) -> None: ...

    def submit(self, req: RequestInfo, now: float) -> list[Assignment]:
        """Take a request; return any assignments released by it."""

    def poll(self, now: float) -> list[Assignment]:
        """Release what is due at ``now`` (wait bound, timeouts)."""

    def next_deadline(self) -> float | None:
        """When ``poll`` must next be called, or None when no request is unplaced."""

    def drop(self, request_id: str) -> bool:
        """Forget an unplaced request (its client aborted); True if it was here."""

    def oldest_unplaced(self) -> float | None:
        """The ``now`` the longest-waiting unplaced request was submitted at, or None when
        none waits (the api-servers' admission bound reads how long that is)."""

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        """Record a request whose rank was fixed by the client (data_parallel_rank)."""
