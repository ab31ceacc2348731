"""`lockstep bench` says when requests failed, and its exit status is 1 then: a run that
lost requests is not a result to quote (before, it printed its figures and exited 0). A
429 from admission control is counted (``rejected``) but is no error: a cluster above
capacity refusing work, as designed. Live: `lockstep up --backend sim`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import start_cluster

pytestmark = pytest.mark.slow


def _trace(path: Path, outputs: list[int]) -> str:
    path.write_text("".join(json.dumps({"t": 0.0, "prompt_tokens": 16, "output_tokens": n}) + "\n"
                            for n in outputs))
    return str(path)


@pytest.mark.timeout(180)
def test_bench_exits_1_when_requests_failed_and_0_when_only_refused(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_REQUEST_TIMEOUT_S", "3")  # 3,000 tokens take longer: a 504
    monkeypatch.setenv("LOCKSTEP_MAX_INFLIGHT", "2")      # a third request at once is a 429
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim", namespace="lbexit")
    try:
        res = cluster.cli("bench", "--trace", _trace(tmp_path / "long.jsonl", [4, 3000]), "--json", timeout=120)
        doc = json.loads(res.stdout)
        assert (doc["completed"], doc["failed"], doc["rejected"]) == (1, 1, 0), doc
        assert res.returncode == 1, res.stderr
        assert "1 of 2 requests failed" in res.stderr and "error: no completion within 3s" in res.stderr, res.stderr

        res = cluster.cli("bench", "--trace", _trace(tmp_path / "many.jsonl", [8] * 6), "--json", timeout=120)
        doc = json.loads(res.stdout)
        assert doc["completed"] >= 2 and doc["rejected"] == doc["failed"] >= 1, doc
        assert res.returncode == 0, res.stderr
        assert "refused with 429" in res.stderr, res.stderr
    finally:
        cluster.stop()


def _bench(cluster, *args: str):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT
    env = {**os.environ, "LOCKSTEP_STATE_DIR": cluster.state_dir}
    env.pop("LOCKSTEP_REDIS_URL", None)
    return subprocess.Popen([sys.executable, "-m", "services.admin.cli", "bench", *args, "--json",
                             "--namespace", cluster.namespace], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)


def _under_way(proc, needle: str, timeout: float = 60) -> None:
    """Wait (bounded) until the run is under way: its requests reached the api-server."""
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        time.sleep(0.1)
        if needle():
            return
    raise AssertionError("the bench never got under way")


@pytest.mark.timeout(240)
def test_bench_keeps_its_figures_when_redis_goes_away_or_it_is_interrupted(tmp_path: Path) -> None:
    # Both threw the whole run away: Redis lost mid-run ended in "fix --redis-url" and an
    # empty stdout; Ctrl-C in a traceback ("Task exception was never retrieved").
    import signal

    import httpx

    from shared.redis_server import EmbeddedRedis
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim", namespace="lbgone")
    spread = tmp_path / "spread.jsonl"
    spread.write_text("".join(json.dumps({"t": i * 0.25, "prompt_tokens": 16, "output_tokens": 8}) + "\n"
                              for i in range(24)))

    def served() -> int:    # tokens the api-server has returned so far (8 a request)
        text = httpx.get(cluster.api_url.rsplit("/v1", 1)[0] + "/metrics", timeout=5).text
        return sum(int(float(line.split()[-1])) for line in text.splitlines()
                   if line.startswith("lockstep_api_completion_tokens_total"))
    try:
        stats = EmbeddedRedis().start()     # the step stats read from a Redis that then goes away
        try:
            base = served()
            proc = _bench(cluster, "--trace", str(spread), "--redis-url", stats.url)
            _under_way(proc, lambda: served() > base + 16)
        finally:
            stats.stop()
        out, err = proc.communicate(timeout=120)
        doc = json.loads(out)
        assert doc["completed"] == 24 and doc["throughput_tok_s"] > 0, doc
        assert doc["balance_ratio"] is None and "went away mid-run" in doc["error"], doc
        assert proc.returncode == 1 and "Traceback" not in err, err

        base = served()
        proc = _bench(cluster, "--trace", str(spread))
        _under_way(proc, lambda: served() > base + 16)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        doc = json.loads(out)
        assert doc["interrupted"] and 0 < doc["completed"] < 24 and doc["not_finished"] > 0, doc
        assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err
    finally:
        cluster.stop()
