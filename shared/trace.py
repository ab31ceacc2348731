"""Opt-in timestamps along the request path, for ``scripts/bench-path --breakdown``.

Off unless LOCKSTEP_TRACE_DIR is set (call sites test ``ENABLED`` first, so the cost when
off is one attribute read). When on, each process appends ``<unix time> <mark>`` lines to
``<dir>/<pid>.trace``, buffered and flushed every 64 marks and at exit. Wall-clock times,
so marks of different processes on one host line up.
"""

from __future__ import annotations

import atexit
import os
import time

DIR = os.environ.get("LOCKSTEP_TRACE_DIR", "")
ENABLED = bool(DIR)
_buf: list[str] = []


def mark(name: str) -> None:
    _buf.append(f"{time.time():.6f} {name}\n")
    if len(_buf) >= 64:
        flush()


def flush() -> None:
    if _buf and DIR:
        with open(os.path.join(DIR, f"{os.getpid()}.trace"), "a") as f:
            f.writelines(_buf)
        _buf.clear()


if ENABLED:
    atexit.register(flush)
