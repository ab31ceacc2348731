"""Issue #15: one /metrics for the whole port. The api-server replicas share one port
(SO_REUSEPORT), so each scrape reaches one at random; every scrape must still report the
whole cluster's totals, in the lockstep_* series and vLLM's. A live 2-replica `--backend sim`
cluster, requests sent with the official openai SDK over fresh connections (so they
spread over the replicas), scrapes over fresh connections too."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.api_server.metrics import ApiMetrics, unplaced
from services.api_server.metrics_dir import prepare
from shared import keys as K
from shared.bus import connect
from tests.helpers import poll_until

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"
N = 16


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _scrape(root: str) -> dict[tuple[str, tuple], float]:
    with httpx.Client(timeout=10) as c:        # a new connection: any replica may answer
        r = c.get(root + "/metrics")
    assert r.status_code == 200
    return _samples(r.text)


def _get(s: dict, name: str, **labels) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def test_every_scrape_reports_the_whole_port(sim_cluster):
    root = sim_cluster.api_url.rsplit("/v1", 1)[0]
    ids = set()
    for _ in range(24):
        with httpx.Client(timeout=10) as c:
            ids.add(c.get(root + "/health").json()["api_id"])
    assert len(ids) == 2, ids                  # the port's connections do reach both replicas

    before = _scrape(root)
    prompt_tokens = 0
    for i in range(N):
        with openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=30) as c:
            r = c.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=5, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        prompt_tokens += r.usage.prompt_tokens
    m = {"model_name": MODEL}
    for _ in range(6):
        s = _scrape(root)

        def delta(name: str, **labels) -> float:
            return _get(s, name, **labels) - _get(before, name, **labels)

        assert delta("vllm:request_success_total", finished_reason="length", **m) == N
        assert delta("vllm:generation_tokens_total", **m) == 5 * N
        assert delta("vllm:prompt_tokens_total", **m) == prompt_tokens
        assert delta("vllm:e2e_request_latency_seconds_count", **m) == N
        assert delta("vllm:time_to_first_token_seconds_count", **m) == N
        assert delta("vllm:time_per_output_token_seconds_count", **m) == N
        assert delta("vllm:request_generation_tokens_sum", **m) == 5 * N
        assert delta("lockstep_api_requests_total", endpoint="completions", status="200") == N
        assert delta("lockstep_api_completion_tokens_total") == 5 * N
        assert _get(s, "lockstep_api_inflight") == 0
        assert _get(s, "lockstep_api_engine_ranks") == _get(s, "lockstep_api_engine_ranks_live") > 0
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert (gauge, tuple(m.items())) in s, gauge


def test_waiting_counts_the_requests_the_scheduler_has_not_placed(sim_cluster):
    """vllm:num_requests_waiting: every request accepted and not yet running, including
    those still on the scheduler's stream. The scheduler is stopped (SIGSTOP) while
    requests arrive, so they stay unplaced for as long as the test looks; then it resumes
    and every request completes."""
    import os
    import signal
    import threading

    import redis

    root = sim_cluster.api_url.rsplit("/v1", 1)[0]
    r = redis.Redis.from_url(sim_cluster.redis_url)
    keys = K.Keys(sim_cluster.namespace)
    pid = int(r.hget(keys.scheduler, "pid"))
    m = {"model_name": MODEL}
    results: list[int] = []

    def one(i: int) -> None:
        with openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60) as c:
            results.append(c.completions.create(model=MODEL, prompt=f"held {i}", max_tokens=3,
                                                extra_body={"ignore_eos": True}).usage.completion_tokens)

    def unread() -> int:
        groups = {g["name"]: g for g in r.xinfo_groups(keys.requests)}
        g = groups[K.SCHEDULER_GROUP.encode()]
        return int(g["pending"]) + int(g["lag"] or 0)

    n = 5
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    os.kill(pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        poll_until(lambda: unread() == n, 30, "the requests on the scheduler's stream")
        for _ in range(3):                      # any replica answers, each says the same
            s = _scrape(root)
            assert _get(s, "vllm:num_requests_waiting", **m) == n
            assert _get(s, "vllm:num_requests_running", **m) == 0
    finally:
        os.kill(pid, signal.SIGCONT)
        for t in threads:
            t.join(60)
    assert results == [3] * n
    poll_until(lambda: _get(_scrape(root), "vllm:num_requests_waiting", **m) == 0, 30, "waiting back to 0")


async def test_unplaced_is_the_groups_pending_and_lag(redis_url, namespace):
    """Entries read and not acked (unplaced) and entries not read yet both count; acked ones
    (placed) do not; no stream yet is 0."""
    r = connect(redis_url)
    keys = K.Keys(namespace)
    try:
        assert await unplaced(r, keys) == 0
        await r.xgroup_create(keys.requests, K.SCHEDULER_GROUP, id="0", mkstream=True)
        ids = [await r.xadd(keys.requests, {"d": b"{}"}) for _ in range(4)]
        await r.xreadgroup(K.SCHEDULER_GROUP, "c", {keys.requests: ">"}, count=3)   # 3 read, 1 not
        await r.xack(keys.requests, K.SCHEDULER_GROUP, ids[0])                      # 1 placed
        assert await unplaced(r, keys) == 3
    finally:
        await r.delete(keys.requests)
        await r.aclose()


def test_a_dead_replicas_live_gauge_is_retired(tmp_path, monkeypatch):
    """Unit: prepare() drops older runs' directories and a dead pid's live gauges."""
    import prometheus_client.values as values

    from services.api_server import metrics_dir

    monkeypatch.setattr(metrics_dir, "ROOT", tmp_path)
    # ApiMetrics sets PROMETHEUS_MULTIPROC_DIR in this process: recorded unset here, so the
    # teardown unsets it. (A delenv after it recorded the path and the teardown put it back:
    # every cluster a later test started then shared this directory's metrics.)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")   # (a delenv of an unset name records nothing)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    old = tmp_path / "ns-1-100"
    old.mkdir()
    path = prepare("ns", 1, "200")
    assert not old.exists() and path.endswith("ns-1-200")
    saved = values.ValueClass
    try:
        m = ApiMetrics("x", path)
        m.inflight.inc(3)
        dead = tmp_path / "ns-1-200" / "gauge_livesum_999999999.db"
        (tmp_path / "ns-1-200" / f"gauge_livesum_{__import__('os').getpid()}.db").rename(dead)
        prepare("ns", 1, "200")
        assert not dead.exists()
    finally:
        values.ValueClass = saved


def test_the_multiprocess_setting_does_not_outlive_the_test_that_made_it():
    # runs after test_a_dead_replicas_live_gauge_is_retired (file order)
    import os
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


def test_a_client_gone_mid_body_is_a_counted_499_not_an_unhandled_error(sim_cluster):
    # it was an ERROR "unhandled_error ClientDisconnect()" and a 500 built for nobody, in no metric
    import socket
    from urllib.parse import urlsplit

    root = sim_cluster.api_url.rsplit("/v1", 1)[0]
    url = urlsplit(root)
    before = _scrape(root)
    for _ in range(4):
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"model\": ")
    def gone() -> bool:
        s = _scrape(root)
        return _get(s, "lockstep_api_requests_total", endpoint="completions", status="499") \
            - _get(before, "lockstep_api_requests_total", endpoint="completions", status="499") == 4
    poll_until(gone, 15, "four 499s counted")


def test_a_scrape_that_reads_the_same_snapshot_again_does_not_count_it_again(tmp_path, monkeypatch):
    """Unit: in scheduler dispatch each scrape reads the latest snapshot; the counter of
    snapshots counted every scrape (1, 2, 3, 4 against seq 408 .. 11194)."""
    import os

    import prometheus_client.values as values

    from services.api_server import metrics_dir
    from shared.stats import Snapshot

    monkeypatch.setattr(metrics_dir, "ROOT", tmp_path)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    saved = values.ValueClass
    try:
        m = ApiMetrics("x", prepare("ns", 1, str(os.getpid())))
        for seq in (7, 7, 7, 8, 8):
            m.observe_snapshot(Snapshot(wave=1, step=seq, t=0.0, ranks={}, seq=seq))
        assert m.snapshots._value.get() == 2
    finally:
        values.ValueClass = saved
