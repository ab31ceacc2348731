"""A SIGKILL of `lockstep up` leaves nothing behind. Its children get PDEATHSIG (SIGTERM);
the embedded Redis goes with it, so the engine ranks are told to leave while Redis is gone
for good. They used to retry their paused read forever (a rank that outlived its cluster by
hours); a rank told to stop now waits a Redis outage out for a bounded time
(inbox_reader.STOPPING_REDIS_GRACE_S) and exits. Live: `lockstep up --backend sim`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest

from services.engine_worker.inbox_reader import STOPPING_REDIS_GRACE_S
from tests.conftest import start_cluster
from tests.helpers import poll_until

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigkill_of_up_leaves_no_process_behind(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim")
    kids: list[int] = []
    try:
        client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=30)
        r = client.completions.create(model="lockstep-moe", prompt="hi", max_tokens=4)
        assert r.usage.completion_tokens == 4   # the group ran, then paused (its ranks sleep on Redis)
        kids = _children(cluster.proc.pid)
        assert len(kids) >= 5, kids   # Redis, scheduler, 2 ranks, a spare, an api-server
        cluster.proc.send_signal(signal.SIGKILL)
        cluster.proc.wait(10)
        poll_until(lambda: not any(_alive(p) for p in kids), STOPPING_REDIS_GRACE_S + 40,
                   "every child of the killed `lockstep up` exited")
        # ... each the way it means to: the paused ranks' stop path raised a NameError before
        logs = {p.name: p.read_text() for p in Path(cluster.state_dir).rglob("*.log")
                if p.name.startswith(("engine-", "spare-"))}
        assert logs and not [n for n, t in logs.items() if "Traceback" in t], \
            {n: t[-2000:] for n, t in logs.items() if "Traceback" in t}
    finally:
        for p in kids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
