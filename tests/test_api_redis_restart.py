"""A Redis restart that loses the requests in flight: each fails with one clear, retryable
error, streaming or not (commit 44bd204: the message said "retry it" twice on the
non-streaming path and not at all on the streaming one), while requests sent to the
server that is back run (they were sent on at once, and a submit that reached the new
server before the api-server's check of the data set used to skip that check: the lost
requests then waited for ever). Live: `lockstep up` on a Redis server of the test's own,
restarted empty, and the official openai SDK."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from shared.redis_server import EmbeddedRedis, free_port
from tests.conftest import start_cluster
from tests.helpers import poll_until

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"
LONG = {"ignore_eos": True}      # ~4000 sim steps: still running when Redis restarts


@pytest.mark.timeout(300)
def test_requests_lost_in_a_redis_restart_say_retry_it_once(tmp_path):
    port = free_port()
    server = EmbeddedRedis(port=port).start()
    cluster = start_cluster(tmp_path, "--ranks", "1", "--api-servers", "1", "--backend", "sim",
                            "--time-scale", "2", "--redis-url", server.url)
    client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=120)
    errors: dict[str, str] = {}
    streaming = threading.Event()

    def plain() -> None:
        try:
            client.completions.create(model=MODEL, prompt="plain", max_tokens=4000, extra_body=LONG)
            errors["plain"] = "completed"
        except openai.APIStatusError as exc:
            errors["plain"] = f"{exc.status_code} {exc.response.json()['error']['message']}"

    def stream() -> None:
        try:
            for _ in client.completions.create(model=MODEL, prompt="stream", max_tokens=4000, stream=True,
                                               extra_body=LONG):
                streaming.set()
            errors["stream"] = "completed"
        except openai.APIError as exc:
            errors["stream"] = exc.message

    threads = [threading.Thread(target=plain, daemon=True), threading.Thread(target=stream, daemon=True)]
    try:
        for t in threads:
            t.start()
        assert streaming.wait(60), "the streaming request sent no token"
        health = cluster.api_url.rsplit("/v1", 1)[0] + "/health"
        poll_until(lambda: httpx.get(health, timeout=5).json().get("inflight") == 2, 30, "both requests in flight")
        server.stop()
        server = EmbeddedRedis(port=port).start()   # a new, empty server on the same address
        fresh: list[str] = []

        def send_fresh() -> None:   # new requests at once, while the api-server checks the data set
            quick = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=60)
            end = time.monotonic() + 3
            while time.monotonic() < end:
                try:
                    r = quick.completions.create(model=MODEL, prompt="fresh", max_tokens=2, extra_body=LONG)
                    fresh.append(r.choices[0].finish_reason)
                except openai.APIError as exc:
                    fresh.append(f"error {exc.message}")
            quick.close()

        sender = threading.Thread(target=send_fresh, daemon=True)
        sender.start()
        for t in threads:
            t.join(120)
        sender.join(120)
        assert errors["plain"].startswith("503 ") and "restarted and lost this request" in errors["plain"], errors
        assert "restarted and lost this request" in errors["stream"], errors
        for path, message in errors.items():
            assert message.count("retry it") == 1, (path, message)
        assert "length" in fresh, fresh                    # served by the server that is back
        assert not any("restarted and lost" in f for f in fresh), fresh
    finally:
        client.close()
        cluster.stop()
        server.stop()
