"""What one step's collective says: the columns of every rank's row and the decision all
ranks take from the same rows (run, idle forward, hold, pause or stop).

Pure and free of torch, so the simulator drives it without importing the collective
(services/engine_worker/lockstep.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Columns of the step tensor.
F_HAS_WORK = 0       # rank has waiting or running sequences
F_TOKENS = 1         # tokens it will compute this step
F_MAX_CTX = 2        # largest context it attends over (cost model)
F_GATE = 3           # staggered batches: highest batch whose share fully arrived here
F_GATE_HELD = 4      # oldest batch whose prefill this rank still holds (0 = none)
F_RELEASE = 5        # rank 0 only: release held batches up to this one (shared timeout)
F_STOP = 6           # rank is shutting down: the group must stop together
F_DECODE = 7         # token alignment: decode tokens among F_TOKENS (never capped)
F_MUST = 8           # token alignment: tokens this rank's prefill deadlines need this step
F_ALIGN = 9          # token alignment enabled here (applied only when every rank has it)
F_QUEUED = 10        # token alignment: prefill tokens pending on this rank (the group's backlog)
F_FORCED = 11        # token alignment: this rank's prefill was capped max_capped_steps in a row: it runs
F_BUSY = 12          # token alignment, flags (rank 0's are applied): BUSY_FLAG the group looks busy to this
                     # rank; TAIL_FLAG it is spreading a backlog's last prefill; LULL_FLAG no prompt has
                     # reached the group for a while (rank_step.py)
F_ARRIVED = 13       # token alignment: prompt tokens that reached this rank since its last row
F_LONGEST = 14       # token alignment: the longest of those prompts (tokens)
F_ARRIVED_N = 15     # token alignment: how many prompts those were
F_COMPANY = 16       # token alignment (rank 0's is applied): how far, in thousandths, prompts reach the
                     # group less often than waiting for company pays (rank_step.company_shortfall)
FIELDS = 17
# The rows' layout and meaning, as one number: rank 0 publishes it at the rendezvous and a
# rank that reads another refuses to join (membership.py). Bump it with any change to the
# columns above or to what a rank decides from them.
STEP_PROTOCOL = 2
BUSY_FLAG, TAIL_FLAG, LULL_FLAG = 1, 2, 4


class Action(Enum):
    RUN = "run"          # compute my tokens
    IDLE = "idle"        # I have nothing, others do: join the collectives with zero tokens
    HOLD = "hold"        # work exists but all of it is held by the batch gate: no forward
    PAUSE = "pause"      # nobody has work: everyone sleeps until work arrives anywhere
    STOP = "stop"        # a rank is leaving: everyone stops


@dataclass(slots=True)
class StepView:
    """What one step's collective told every rank. ``memo`` holds per-step results that
    are a pure function of the rows (computed once, whichever rank asks first)."""

    rows: list[list[int]]
    memo: dict[str, Any] = field(default_factory=dict)

    def _summary(self) -> tuple[bool, bool, int]:
        s = self.memo.get("summary")
        if s is None:
            rows = self.rows
            s = self.memo["summary"] = (any(r[F_STOP] for r in rows),
                                        any(r[F_HAS_WORK] or r[F_TOKENS] for r in rows),
                                        max(r[F_TOKENS] for r in rows))
        return s

    @property
    def any_work(self) -> bool:
        return self._summary()[1]

    @property
    def max_tokens(self) -> int:
        return self._summary()[2]

    @property
    def mean_tokens(self) -> float:
        """The ranks' mean tokens this step (what a step's shared part follows)."""
        m = self.memo.get("mean_tokens")
        if m is None:
            m = self.memo["mean_tokens"] = sum(r[F_TOKENS] for r in self.rows) / max(1, len(self.rows))
        return m

    @property
    def max_ctx(self) -> int:
        return max(r[F_MAX_CTX] for r in self.rows)

    def column(self, field: int) -> list[int]:
        """One field of every row (computed once per view; do not modify the list)."""
        col = self.memo.get(field)
        if col is None:
            col = self.memo[field] = [r[field] for r in self.rows]
        return col

    def set_column(self, field: int, values: list[int]) -> None:
        for row, v in zip(self.rows, values):
            row[field] = v
        self.memo.pop("summary", None)
        self.memo.pop("mean_tokens", None)
        self.memo.pop(field, None)

    def action(self, rank: int) -> Action:
        stop, any_work, max_tokens = self._summary()
        if stop:
            return Action.STOP
        if not any_work:
            return Action.PAUSE
        if max_tokens == 0:
            return Action.HOLD
        return Action.RUN if self.rows[rank][F_TOKENS] > 0 else Action.IDLE
