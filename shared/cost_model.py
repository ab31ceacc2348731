"""Device cost model of one lockstep step, shared by the sim backend and the simulator.

In DP+EP every rank joins the same all-to-alls, so a step lasts as long as its most
loaded rank:

    step_ms = fixed_ms                          # launches + 2 all-to-alls per MoE layer
            + token_ms   * max_r tokens_r       # dense + expert FLOPs of the busiest rank
            + ctx_ms_per_1k * max_r ctx_r / 1000  # attention; ctx_r: rank r's longest context
            + shared_token_ms * mean_r tokens_r   # work that follows the group's total (0 by default)

``shared_token_ms`` models what no rank computes alone: experts whose load is every rank's
tokens (an EP group whose routing spreads evenly), or ranks that share one device or CPU.
The bundled profiles leave it at 0, the busiest-rank model above; a ``--cost-model`` file
sets it to ask how the policies fare when part of the step is shared (docs/benchmarks.md,
"What the simulator does not model").

The defaults are illustrative, not a measurement (a DeepSeek-V3-class shape): a
128-sequence decode at 1k context costs 8 + 7.7 + 0.05 = ~16 ms, a 2,048-token prefill
chunk 8 + 122.9 + 0.1 = ~131 ms. The context term sees one sequence, not the KV the whole
batch reads (docs/calibration.md: what this misses on a real device). Calibrated constants come with the simulator's profiles
(services/simulator/profiles/, ``lockstep simulate --profile``) or ``--cost-model FILE``
(JSON with these field names).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class CostModel:
    fixed_ms: float = 8.0
    token_ms: float = 0.06
    ctx_ms_per_1k: float = 0.05
    idle_ms: float = 8.0          # a dummy forward still pays the launches and all-to-alls
    shared_token_ms: float = 0.0  # per token of the ranks' mean: cost that follows the group's total

    def step_ms(self, max_tokens: float, max_ctx: int = 0, mean_tokens: float = 0.0) -> float:
        """Modeled wall time of one lockstep step given the busiest rank's load (and the
        ranks' mean tokens, for the shared term)."""
        if max_tokens <= 0 and max_ctx <= 0:
            return self.idle_ms
        return (self.fixed_ms + self.token_ms * max_tokens + self.ctx_ms_per_1k * max_ctx / 1000.0
                + self.shared_token_ms * mean_tokens)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        return cls.checked(data, str(path))

    @classmethod
    def checked(cls, data: Any, where: str, what: str = "cost-model") -> "CostModel":
        """From a JSON object (a ``--cost-model`` file, a profile's ``cost``), refusing what
        is no model of a device: unknown fields, and values that are not finite ms >= 0."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a cost model is a JSON object of {sorted(cls.__dataclass_fields__)}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: unknown {what} fields {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        bad = [k for k, v in data.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0]
        if bad:
            raise ValueError(f"{where}: {', '.join(f'{k}={data[k]!r}' for k in bad)}: every {what} field "
                             "is a finite number of milliseconds >= 0")
        return cls(**{k: float(v) for k, v in data.items()})
