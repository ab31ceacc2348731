"""Where `lockstep up` records a running local cluster, so admin commands find it without
flags: ``$LOCKSTEP_STATE_DIR`` (default ``~/.local/state/lockstep``)/<namespace>.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shared.redis_server import pid_alive


class NoCluster(RuntimeError):
    pass


def state_dir() -> Path:
    base = os.environ.get("LOCKSTEP_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".local", "state", "lockstep")
    return Path(base)


def state_file(namespace: str) -> Path:
    return state_dir() / f"{namespace}.json"


def write(namespace: str, data: dict[str, Any]) -> Path:
    path = state_file(namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.chmod(tmp, 0o600)   # the URL may carry a password
    tmp.replace(path)
    return path


def read(namespace: str) -> dict[str, Any] | None:
    path = state_file(namespace)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not pid_alive(int(data.get("pid", 0))):
        return None   # a cluster that is gone: stale file
    return data


def remove(namespace: str, pid: int) -> None:
    path = state_file(namespace)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def resolve_redis_url(flag: str | None, namespace: str) -> str:
    """--redis-url, else LOCKSTEP_REDIS_URL, else the local cluster's; else a clear error."""
    if flag:
        return flag
    env = os.environ.get("LOCKSTEP_REDIS_URL")
    if env:
        return env
    data = read(namespace)
    if data:
        return data["redis_url"]
    raise NoCluster(f"no running local cluster in namespace {namespace!r} (looked in {state_file(namespace)}). "
                    "Start one with `scripts/run` (or `lockstep up`), or pass --redis-url / set LOCKSTEP_REDIS_URL.")
