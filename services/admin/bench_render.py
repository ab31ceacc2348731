"""The ``lockstep bench`` report as a table (``--json`` prints the document itself)."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def render(doc: dict[str, Any]) -> Any:
    """A rich Table of the headline figures of one run's document."""
    from rich.table import Table

    t = Table(title=f"lockstep bench: {doc['trace']}, {doc['requests']} requests at {doc['url']}",
              title_justify="left")
    t.add_column("measure")
    t.add_column("value", justify="right")
    failed = f"{doc['failed']}" + (f" ({doc['rejected']} refused: 429)" if doc.get("rejected") else "")
    rows = [("completed / failed", f"{doc['completed']} / {failed}"),
            ("throughput (tok/s)", _fmt(doc["throughput_tok_s"])),
            ("TTFT p50 / p90 / p99 (ms)", " / ".join(_fmt(doc[f"ttft_p{p}_ms"]) for p in (50, 90, 99))),
            ("ITL p50 / p90 / p99 (ms)", " / ".join(_fmt(doc[f"itl_p{p}_ms"]) for p in (50, 90, 99))),
            ("e2e p50 / p99 (ms)", " / ".join(_fmt(doc[f"e2e_p{p}_ms"]) for p in (50, 99))),
            ("balance ratio", _fmt(doc["balance_ratio"], ".3f")),
            ("idle-forward fraction", _fmt(doc["idle_forward_fraction"], ".3f"))]
    if "per_rank_requests" in doc:
        rows.append(("requests per rank", " ".join(str(v) for v in doc["per_rank_requests"].values())))
        rows.append(("steps (with work)", f"{doc['steps']} ({doc['work_steps']})"))
    for k, v in rows:
        t.add_row(k, v)
    return t
