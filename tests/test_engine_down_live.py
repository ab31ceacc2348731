"""An engine group short of a rank for longer than ``engine_down_timeout_s`` (it steps only
with all of them: every rank down or stalled, or one down and not replaced): the requests in
flight end with a 503 that says why and to retry, new ones get a 503 ``engine_unavailable``
with Retry-After, and once the group is whole again it serves, and no rank runs an
abandoned request for nobody. Before, each request waited out ``request_timeout_s`` (600 s)
with no word. Live: `lockstep up --backend sim`, the official openai client."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import start_cluster
from tests.helpers import poll_until

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"


def _status(cluster) -> dict:
    res = cluster.cli("status", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks, stalled, says", [(1, 0, "no engine rank of cluster"),
                                                   (2, 1, "only 1 of the 2 engine ranks")])
def test_a_group_short_of_a_rank_ends_the_wait_with_a_503_and_serves_once_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: int, stalled: int, says: str) -> None:
    monkeypatch.setenv("LOCKSTEP_HEARTBEAT_MS", "200")        # the alive key lapses 0.6 s into a stall
    monkeypatch.setenv("LOCKSTEP_ENGINE_DOWN_TIMEOUT_S", "2")
    cluster = start_cluster(tmp_path, "--ranks", str(ranks), "--spares", "0", "--api-servers", "1",
                            "--backend", "sim", namespace=f"ldown{ranks}")
    client = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    health = cluster.api_url.rsplit("/v1", 1)[0] + "/health"
    stopped = None
    try:
        poll_until(lambda: httpx.get(health, timeout=5).json().get("ranks_live") == ranks, 30, "every rank live")
        ready = health.rsplit("/", 1)[0] + "/ready"
        assert httpx.get(ready, timeout=5).status_code == 200
        pid = _status(cluster)["ranks"][stalled]["pid"]
        stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=3000, stream=True,
                                           extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices[0].finish_reason is None
        os.kill(pid, signal.SIGSTOP)                           # the group cannot step without it
        stopped = pid
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                assert chunk.choices[0].finish_reason is None  # 3,000 tokens: it cannot finish
        message = str(err.value.message)
        assert says in message and "retry" in message, message
        assert err.value.code == "engine_unavailable", err.value.body
        assert time.monotonic() - t0 < 30                      # not request_timeout_s (600 s)
        assert httpx.get(health, timeout=5).json()["ranks_live"] == ranks - 1
        # liveness stays 200 (restarting the api-server would not help); readiness says no
        assert httpx.get(health, timeout=5).status_code == 200
        not_ready = httpx.get(ready, timeout=5)
        assert not_ready.status_code == 503 and not_ready.json()["reason"] == "engine_group_incomplete"

        r = httpx.post(cluster.api_url + "/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable" and r.headers["retry-after"] == "5"
        assert says in r.json()["error"]["message"]

        os.kill(pid, signal.SIGCONT)                           # whole again: requests are served
        stopped = None
        poll_until(lambda: httpx.get(health, timeout=5).json().get("ranks_live") == ranks, 60, "every rank live again")
        assert httpx.get(ready, timeout=5).status_code == 200
        done = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
        # The abandoned request was aborted: it does not run on for nobody.
        poll_until(lambda: all(r["running"] == 0 for r in _status(cluster)["ranks"]), 60,
                   "the ranks drop the abandoned request")
        assert cluster.proc.poll() is None
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        cluster.stop()
    text = "".join(p.read_text() for p in Path(cluster.state_dir).rglob("api-*.log"))
    assert "requests_failed_engine_down" in text and "Traceback" not in text, text[-3000:]
