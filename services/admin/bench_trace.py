"""The requests ``lockstep bench`` sends: the simulator's trace (generated or a JSONL file),
as send times from zero, and prompts whose byte length is their token count."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(slots=True)
class Item:
    t: float
    prompt_tokens: int
    output_tokens: int
    api: int = -1


def build_trace(workload: str, requests: int, rate: float, seed: int, trace: Optional[Path],
                max_model_len: int = 4096) -> tuple[str, list[Item], int]:
    """The requests to send: from ``trace`` when given, else generated; and how many of them
    were cut to fit ``max_model_len`` (the served model's)."""
    from services.simulator.workload import generate, load_jsonl

    # A line's api_server is recorded, not used (every replica shares one port): any index
    # is kept, as many as the trace names (load_jsonl's default of 1 refused all but 0).
    tr = (load_jsonl(trace, api_servers=None, seed=seed, max_model_len=max_model_len) if trace is not None
          else generate(workload, requests, rate, seed, max_model_len=max_model_len))
    items = [Item(float(tr.t[i]), int(tr.prompt[i]), int(tr.output[i]), int(tr.api[i])) for i in range(len(tr))]
    t0 = items[0].t if items else 0.0
    for it in items:
        it.t -= t0
    return tr.name, items, tr.clipped


def prompt_text(n: int, i: int) -> str:
    """``n`` ASCII bytes (= ``n`` tokens), different per request."""
    head = f"req {i}: "
    body = (head + "lockstep balances data-parallel ranks. ") * (n // 40 + 2)
    return body[:n]
