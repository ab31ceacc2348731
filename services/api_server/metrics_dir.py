"""Where the api-server replicas of one cluster share their metrics (prometheus_client's
multiprocess mode), so a scrape of the shared port reports the whole port.

The replicas of one port run on one host (SO_REUSEPORT), under one `lockstep up` run,
which stamps the cluster record in Redis with its start time: the directory is
``<tmp>/lockstep-metrics/<namespace>-<port>-<started>``, so every replica of a run agrees
on it without being told, and a new run never adds up an old run's counters (whose
directories it removes). ``PROMETHEUS_MULTIPROC_DIR``, when set, wins. Without a cluster
record (a replica started alone) each replica reports only its own values.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from shared import keys as K
from shared.bus import connect
from shared.replies import as_str
from shared.redis_server import pid_alive

ROOT = Path(tempfile.gettempdir()) / "lockstep-metrics"


def prepare(namespace: str, port: int, started: str) -> str:
    """Create this run's directory, drop older runs' of the same namespace and port, and
    retire the live gauges of replicas that died (a restarted replica has a new pid)."""
    from prometheus_client import multiprocess
    prefix = f"{namespace}-{port}-"
    path = ROOT / f"{prefix}{started}"
    path.mkdir(parents=True, exist_ok=True)
    for old in ROOT.glob(prefix + "*"):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
    for f in path.glob("gauge_live*_*.db"):
        pid = f.stem.rsplit("_", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            multiprocess.mark_process_dead(int(pid), str(path))
    return str(path)


def remove_runs(namespace: str, port: int) -> None:
    """Drop the shared directories of ``namespace``'s api-servers on ``port`` (``lockstep
    up`` as it stops: its replicas are gone, and the port is free for another run)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return   # the operator's own directory
    for old in ROOT.glob(f"{namespace}-{port}-*"):
        shutil.rmtree(old, ignore_errors=True)


async def for_cluster(redis_url: str, namespace: str, port: int) -> str | None:
    """This replica's shared metrics directory, or None (per-replica metrics)."""
    env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return env
    r = connect(redis_url)
    try:
        started = await r.hget(K.Keys(namespace).cluster, "started")
    finally:
        await r.aclose()
    if not started:
        return None
    return prepare(namespace, port, as_str(started))
