"""Writes an outage lost while the data set survived (a replica that took over before
they reached it, a restart from an older snapshot): a request whose submission is gone
would wait for a dispatch that never comes, to its timeout. The api-server looks up the
requests that stay silent after the reconnect and resumes the lost ones. Live: `lockstep
up` on a Redis server of the test's own; the loss is made by hand (the request's entry
deleted while the scheduler is stopped, the api-server's connections killed), since a
real failover loses a write only by chance."""

from __future__ import annotations

import os
import signal
import threading

import openai
import pytest
import redis

from shared import keys as K
from shared.redis_server import EmbeddedRedis
from shared.tokenizer import encode
from tests.conftest import start_cluster
from tests.helpers import poll_until, sim_expected_text

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"


@pytest.mark.timeout(240)
def test_a_request_whose_submission_an_outage_lost_is_resumed(tmp_path):
    server = EmbeddedRedis().start()
    cluster = start_cluster(tmp_path, "--ranks", "1", "--api-servers", "1", "--backend", "sim",
                            "--redis-url", server.url)
    r = redis.Redis.from_url(server.url)
    keys = K.Keys(cluster.namespace)
    client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=60)
    pid = int(r.hget(keys.scheduler, "pid"))
    out: dict[str, str] = {}

    def ask() -> None:
        try:
            out["text"] = client.completions.create(model=MODEL, prompt="lost write", max_tokens=12, seed=4,
                                                    extra_body={"ignore_eos": True}).choices[0].text
        except openai.APIError as exc:
            out["text"] = f"error {exc.message}"

    def kill_clients(prefix: str) -> None:
        ids = [c["id"] for c in r.client_list() if c["name"].startswith(prefix)]
        assert ids, r.client_list()
        for cid in ids:
            r.client_kill_filter(_id=cid)

    th = threading.Thread(target=ask, daemon=True)
    os.kill(pid, signal.SIGSTOP)          # the request stays on the scheduler's stream, unread:
    try:
        kill_clients("lockstep-scheduler")   # (a blocked read would still take it into the stopped process)
        th.start()
        entries = poll_until(lambda: r.xrange(keys.requests), 30, "the request on the scheduler's stream")
        r.xdel(keys.requests, *[eid for eid, _ in entries])     # the write the outage lost
        kill_clients("lockstep-api-server")                      # the outage, as the api-server sees it
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        th.join(90)
        assert out.get("text") == sim_expected_text(encode("lost write"), 12, seed=4), out
    finally:
        client.close()
        cluster.stop()
        server.stop()
