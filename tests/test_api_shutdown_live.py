"""Stopping a cluster with requests in flight (Ctrl-C on `lockstep up`, SIGTERM to an
api-server): each request ends within ``shutdown_grace_s`` with a 503 that says to retry —
a stream with an error event and ``[DONE]``, not a connection cut mid-body — and the
api-server logs no traceback. Before, uvicorn cut the open streams when its own 5 s ran out
(the client saw "peer closed connection without sending complete message body").
Live: `lockstep up --backend sim`, the official openai client for the stream."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import start_cluster
from tests.helpers import poll_until

MODEL = "lockstep-moe"
LONG = {"max_tokens": 3000, "extra_body": {"ignore_eos": True}}   # far longer than the grace


@pytest.mark.slow
def test_shutdown_ends_requests_in_flight_with_a_503(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_SHUTDOWN_GRACE_S", "1")
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim")
    try:
        client = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                stream=True, **LONG)
        first = next(iter(stream))
        assert first.choices[0].finish_reason is None
        two = client.completions.create(model=MODEL, prompt="hi", n=2, stream=True, **LONG)   # several choices
        assert next(iter(two)).choices[0].finish_reason is None

        plain: dict[str, httpx.Response] = {}

        def non_stream() -> None:
            plain["r"] = httpx.post(cluster.api_url + "/completions", timeout=60, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 3000, "ignore_eos": True})
        t = threading.Thread(target=non_stream, daemon=True)
        t.start()
        health = cluster.api_url.rsplit("/v1", 1)[0] + "/health"
        poll_until(lambda: httpx.get(health, timeout=5).json().get("inflight", 0) >= 4, 30, "every request in flight")

        stopper = threading.Thread(target=cluster.stop, daemon=True)   # Ctrl-C, as an operator stops it
        t0 = time.monotonic()
        stopper.start()
        # The stream runs on through the grace, then says why it ends, and ends cleanly.
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                assert chunk.choices[0].finish_reason is None   # it cannot finish: 3,000 tokens
        assert "shutting down" in str(err.value.message) and "retry" in str(err.value.message)
        with pytest.raises(openai.APIError) as err:
            for chunk in two:
                assert chunk.choices[0].finish_reason is None
        assert "shutting down" in str(err.value.message)
        assert time.monotonic() - t0 < 15
        t.join(30)
        r = plain["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        stopper.join(60)
        assert cluster.proc.poll() is not None
    finally:
        cluster.stop()
    logs = Path(cluster.state_dir).rglob("api-*.log")
    text = "".join(p.read_text() for p in logs)
    assert text and "Traceback" not in text, text[-3000:]
