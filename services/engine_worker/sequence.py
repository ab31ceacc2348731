"""One request as the engine's local scheduler sees it (one DP rank)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.messages import Request, SamplingParams
from shared.stop import StopChecker


class SeqStatus(enum.IntEnum):
    WAITING = 0     # queued on the rank, no KV blocks (new, held by the gate, or preempted)
    RUNNING = 1     # admitted: KV blocks held, prefilling or decoding
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Sequence:
    """A generation request on this rank.

    ``generated`` may start non-empty: a request resumed from another rank re-prefills
    prompt + generated and continues at ``len(generated)``. ``streamed`` counts the
    generated tokens already emitted (a resumed request's tokens were emitted by the old
    rank), so nothing is ever emitted twice, across preemption or resume.
    """

    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = 0.0
    generated: list[int] = field(default_factory=list)
    api: str = ""                       # owning api-server (deltas go to its stream)
    batch: str | None = None            # staggered batch id
    batch_counts: list[int] | None = None
    dispatcher: str = ""                # Assignment.dispatcher
    dispatch_seq: int = 0               # Assignment.seq
    held: bool = False                  # prefill held by the staggered-batch gate last step
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0        # tokens whose KV is in the cache
    prefill_target: int = 0             # num_tokens when last admitted: prefill ends there
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error"
    error: str | None = None
    streamed: int = -1                  # -1: set to len(generated) in __post_init__
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_checker: StopChecker | None = None
    epoch: int = 0                      # resume epoch (Request.epoch), echoed in every delta

    def __post_init__(self) -> None:
        if self.streamed < 0:
            self.streamed = len(self.generated)
        if self.stop_checker is None and self.params.stop:
            self.stop_checker = StopChecker(self.params.stop)
            self.stop_checker.prime(self.generated)

    @classmethod
    def from_request(cls, req: Request, dispatcher: str = "", dispatch_seq: int = 0) -> "Sequence":
        return cls(id=req.id, prompt=list(req.prompt), params=req.params, arrival=req.arrival,
                   generated=list(req.generated), api=req.api, batch=req.batch,
                   batch_counts=req.batch_counts, dispatcher=dispatcher,
                   dispatch_seq=dispatch_seq, epoch=req.epoch)

    # -- sizes -------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def remaining_output(self) -> int:
        """Output tokens still to generate (max_tokens - len(generated))."""
        return self.params.max_tokens - len(self.generated)

    @property
    def max_total_tokens(self) -> int:
        """prompt + max_tokens: the most tokens this sequence can ever reach."""
        return len(self.prompt) + self.params.max_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def pending_prefill(self) -> int:
        """Tokens this sequence still has to prefill (all of them while it waits)."""
        if self.status is SeqStatus.WAITING:
            return self.num_tokens
        if self.status is SeqStatus.RUNNING:
            return max(0, self.prefill_target - self.num_computed_tokens)
        return 0

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_tokens[start:end] without building all_tokens."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.generated[start - p:end - p]
        return self.prompt[start:] + self.generated[:end - p]

    def __repr__(self) -> str:
        return (f"Sequence({self.id!r}, {self.status.name}, prompt={len(self.prompt)}, "
                f"gen={len(self.generated)}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, finish={self.finish_reason})")
