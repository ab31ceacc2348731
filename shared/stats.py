"""Per-rank step statistics and the step-consistent snapshot built from them.

msgspec Structs (shared/messages.py): their JSON is what ``ls:stats``, ``ls:step:*``,
``ls:rank:{r}:info`` ``stats``, ``ls:steps`` and ``ls:snapshot`` hold. Full key names, every
field always written: operators and the admin commands read these rows as plain JSON.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct, field

from shared import messages


class RankStats(Struct):
    """What one DP rank reports after each step (wave, step)."""

    rank: int
    wave: int
    step: int
    waiting: int = 0            # requests queued on the rank, not yet scheduled
    running: int = 0            # requests with KV allocated (prefilling or decoding)
    scheduled: int = 0          # tokens this step computed (prefill + decode)
    prefill: int = 0            # prefill tokens this step
    decode: int = 0             # decode tokens this step
    kv_used: int = 0            # KV blocks in use
    kv_total: int = 0           # KV blocks on the rank
    outstanding: int = 0        # prompt tokens not yet computed + output tokens still to come
    idle: bool = False          # ran a dummy forward while another rank had work
    dur_ms: float = 0.0         # wall time of the step
    t: float = 0.0              # wall clock (unix seconds) at the end of the step
    finished: int = 0           # requests finished this step
    held: int = 0               # prefills held by the staggered-batch gate
    recv: dict[str, int] = field(default_factory=dict)  # dispatcher -> highest Assignment.seq received
    extra: dict[str, Any] = field(default_factory=dict)
    prefill_pending: int = 0    # prompt tokens queued or mid-prefill on the rank, not yet computed
    kv_blocked: bool = False    # its next waiting request cannot start for want of KV blocks

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, d: Any) -> "RankStats":
        return messages.convert(d, cls)   # unknown keys ignored (a newer rank's), wrong types refused


def is_pause_report(d: Any) -> bool:
    """A rank's report (as a dict) of the step at which its group paused: its load, and
    nothing computed (engine_worker/outputs.py ``flush``). No step ran: step counts and
    step times leave it out."""
    return bool((d.get("extra") or {}).get("pause"))


class Snapshot(Struct):
    """A point-in-time load view: every live rank's stats for one finalized (wave, step)."""

    wave: int
    step: int
    t: float
    ranks: dict[int, RankStats]
    carried: tuple[int, ...] = ()  # ranks whose stats were carried from an older report
    seq: int = 0                   # increases by one per published snapshot

    @property
    def key(self) -> tuple[int, int]:
        return (self.wave, self.step)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self, str_keys=True)   # rank keys as JSON has them

    @classmethod
    def from_dict(cls, d: Any) -> "Snapshot":
        return messages.convert(d, cls, strict=False)   # not strict: the rank keys come as strings

    @classmethod
    def decode(cls, raw: bytes | str) -> "Snapshot":
        """From the published JSON, without an intermediate dict."""
        return messages.decode(raw, cls)
