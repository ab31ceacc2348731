"""A Redis restart that loses the requests in flight (a server without persistence comes
back empty): each is resumed from the tokens its client has and completes exactly,
streaming or not, while requests sent to the server that is back run too. Before, each
failed with a retryable error (and earlier still, a submit that reached the new server
before the api-server's check of the data set skipped that check: the lost requests then
waited for ever). Live: `lockstep up` on a Redis server of the test's own, restarted
empty, and the official openai SDK."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from shared.redis_server import EmbeddedRedis, free_port
from tests.conftest import start_cluster
from shared.tokenizer import encode
from tests.helpers import poll_until, sim_expected_text

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"
LONG = {"ignore_eos": True}
TOKENS = 1500                    # ~1500 sim steps: still running when Redis restarts


@pytest.mark.timeout(300)
def test_requests_in_flight_when_redis_restarts_empty_complete_exactly(tmp_path):
    port = free_port()
    server = EmbeddedRedis(port=port).start()
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim",
                            "--time-scale", "2", "--redis-url", server.url)
    client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=120)
    texts: dict[str, str] = {}
    streaming = threading.Event()

    def plain() -> None:
        try:
            texts["plain"] = client.completions.create(model=MODEL, prompt="plain", max_tokens=TOKENS, seed=7,
                                                       extra_body=LONG).choices[0].text
        except openai.APIError as exc:
            texts["plain"] = f"error {exc.message}"

    def stream() -> None:
        out = []
        try:
            for chunk in client.completions.create(model=MODEL, prompt="stream", max_tokens=TOKENS, stream=True,
                                                   seed=8, extra_body=LONG):
                out.append(chunk.choices[0].text if chunk.choices else "")
                streaming.set()
            texts["stream"] = "".join(out)
        except openai.APIError as exc:
            texts["stream"] = f"error {exc.message}"

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
            t.join(200)
        sender.join(120)
        for prompt, seed in (("plain", 7), ("stream", 8)):   # resumed where the stream stopped: none lost or doubled
            assert texts.get(prompt) == sim_expected_text(encode(prompt), TOKENS, seed=seed), \
                (prompt, texts.get(prompt, "")[:200])
        assert "length" in fresh, fresh                    # served by the server that is back
    finally:
        client.close()
        cluster.stop()
        server.stop()
