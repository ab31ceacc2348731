"""The admin commands find a starting cluster as soon as its API answers. `lockstep up`
used to record the cluster (``$LOCKSTEP_STATE_DIR/<ns>.json``) only after the spares were
up, a few seconds after /v1/models answered (the readiness check operations.md suggests),
so a `lockstep status` or `lockstep bench` run right then said "no running local cluster".
Live: `lockstep up --backend sim`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from shared.redis_server import free_port
from tests.conftest import ROOT
from tests.helpers import poll_until

pytestmark = pytest.mark.slow


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_status_finds_the_cluster_as_soon_as_the_api_answers(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "LOCKSTEP_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    env.pop("LOCKSTEP_REDIS_URL", None)
    log = open(tmp_path / "up.out", "w")
    up = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "up", "--port", str(port), "--namespace",
                           "st", "--backend", "sim", "--ranks", "2", "--api-servers", "1", "--spares", "2"],
                          stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        poll_until(lambda: _answers(f"http://127.0.0.1:{port}/v1/models") or up.poll() is not None, 120,
                   "the API answers")
        assert up.poll() is None, (tmp_path / "up.out").read_text()
        res = subprocess.run([sys.executable, "-m", "services.admin.cli", "status", "--json", "--namespace", "st"],
                             capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        assert [r["rank"] for r in json.loads(res.stdout)["ranks"]] == [0, 1]
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()
    assert not (tmp_path / "state" / "st.json").exists()   # removed on the way out
