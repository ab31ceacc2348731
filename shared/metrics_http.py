"""Serve a Prometheus registry on a port that a predecessor may still hold for a moment.

A scheduler that takes the lead from a dead one, or a rank that replaces a dead process,
binds the port the dead one served: where the old socket is not yet closed, binding again
in the background (every second, for ``RETRY_S``) serves the metrics as soon as it is free,
instead of crashing the service or losing its metrics for good."""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

RETRY_S = 60.0


def serve(port: int, addr: str, registry: CollectorRegistry, log: Any = None) -> bool:
    """True if serving now; False if still trying in the background."""
    try:
        start_http_server(port, addr=addr, registry=registry)
        return True
    except OSError as exc:
        if log is not None:
            log.warning("metrics_port_busy", port=port, addr=addr, error=str(exc)[:200], retrying_s=RETRY_S)

    def retry() -> None:
        deadline = time.monotonic() + RETRY_S
        while time.monotonic() < deadline:
            time.sleep(1.0)
            try:
                start_http_server(port, addr=addr, registry=registry)
            except OSError:
                continue
            if log is not None:
                log.info("metrics_serving", port=port, addr=addr)
            return
        if log is not None:
            log.error("metrics_not_served", port=port, addr=addr,
                      hint="another process holds the port: free it or set LOCKSTEP_METRICS_PORT to a free one")

    threading.Thread(target=retry, name="metrics-bind", daemon=True).start()
    return False
