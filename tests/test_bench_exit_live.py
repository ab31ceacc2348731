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
