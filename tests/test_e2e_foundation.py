"""End to end: `lockstep up --ranks 2 --api-servers 2 --backend sim` with the official openai client."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.stats import RankStats, Snapshot
from shared.tokenizer import encode
from tests.conftest import ROOT, start_cluster
from tests.helpers import poll_until, sim_expected_text, wait_until

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"


@pytest.fixture(scope="module")
def client(sim_cluster):
    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def aclient(sim_cluster):
    # Closed with its module: its pooled connections must not outlive the cluster.
    c = openai.AsyncOpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    await c.close()


def test_completion_non_stream(client):
    r = client.completions.create(model=MODEL, prompt="The lockstep step", max_tokens=24, seed=7,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(encode("The lockstep step"))
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == sim_expected_text(encode("The lockstep step"), 24, seed=7)


def test_x_request_id_is_echoed_or_names_the_completion(sim_cluster, client):
    # the client's correlation id comes back on every answer (it was dropped); without one,
    # the header names the completion's own id
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().choices
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=4)
    assert raw.headers["x-request-id"] == raw.parse().id
    with httpx.stream("POST", sim_cluster.api_url + "/completions", headers={"x-request-id": "s-1"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}, timeout=30) as r:
        assert r.headers["x-request-id"] == "s-1" and r.read().endswith(b"data: [DONE]\n\n")
    r = httpx.post(sim_cluster.api_url + "/completions", content=b"{", headers={"x-request-id": "bad-1"}, timeout=10)
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
    r = httpx.post(sim_cluster.api_url + "/completions", content=b"x" * (2 << 20),
                   headers={"x-request-id": "big-1", "content-type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.headers["x-request-id"] == "big-1"
    r = httpx.post(sim_cluster.api_url + "/completions", headers={"x-request-id": "x" * 300},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]   # too long: not echoed


def test_completion_stream_matches_non_stream(client):
    prompt = "stream me"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, seed=3, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == sim_expected_text(encode(prompt), 40, seed=3)
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].choices == []
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_chat_stream_and_non_stream(client):
    msgs = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, seed=1,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 16
    pieces = []
    roles = []
    for c in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, seed=1, stream=True,
                                            extra_body={"ignore_eos": True}):
        assert c.object == "chat.completion.chunk"
        if c.choices[0].delta.role:
            roles.append(c.choices[0].delta.role)
        pieces.append(c.choices[0].delta.content or "")
    assert roles == ["assistant"]
    assert "".join(pieces) == r.choices[0].message.content


def test_sse_wire_format(sim_cluster):
    """Exactly OpenAI's framing: `data: {json}` events separated by blank lines, then `data: [DONE]`."""
    body = {"model": MODEL, "prompt": "wire", "max_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", sim_cluster.api_url + "/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_bytes()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[len("data: "):])


def test_stream_never_splits_multibyte_characters(client):
    # The sim backend emits é, ü (2 bytes) and € (3 bytes); every chunk must be valid text on its own.
    seen_multibyte = False
    for seed in range(4):
        for c in client.completions.create(model=MODEL, prompt="utf8", max_tokens=120, seed=seed, stream=True,
                                           extra_body={"ignore_eos": True}):
            t = c.choices[0].text if c.choices else ""
            assert "\ufffd" not in t
            seen_multibyte |= any(ord(ch) > 127 for ch in t)
    assert seen_multibyte


def test_stop_string(client):
    full = sim_expected_text(encode("stop test"), 60, seed=11)
    stop = full[20:22]
    r = client.completions.create(model=MODEL, prompt="stop test", max_tokens=60, seed=11, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


async def test_200_concurrent_requests_exact_tokens(aclient):
    async def one(i: int):
        prompt = f"request number {i}"
        r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=32, seed=i,
                                             extra_body={"ignore_eos": True})
        return i, r

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 120)
    assert len(results) == 200
    for i, r in results:
        assert r.usage.completion_tokens == 32
        assert r.choices[0].text == sim_expected_text(encode(f"request number {i}"), 32, seed=i)


async def test_200_concurrent_streams_exact_tokens(aclient):
    async def one(i: int):
        prompt = f"stream number {i}"
        text, usage = [], None
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=24, seed=i, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        async for c in stream:
            if c.choices:
                text.append(c.choices[0].text)
            if c.usage:
                usage = c.usage
        return i, "".join(text), usage

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 120)
    for i, text, usage in results:
        assert usage.completion_tokens == 24
        assert text == sim_expected_text(encode(f"stream number {i}"), 24, seed=i)


def test_models_health_metrics(sim_cluster, client):
    cards = client.models.list().data
    assert [m.id for m in cards] == [MODEL]
    assert time.time() - 3600 < cards[0].created <= time.time()   # a real time, as OpenAI's (it was 0)
    base = sim_cluster.api_url.rsplit("/v1", 1)[0]
    assert httpx.get(base + "/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)   # a labelled counter shows once counted
    metrics = httpx.get(base + "/metrics").text
    assert "lockstep_api_requests_total" in metrics


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "lockstep-moe"}', 400, "prompt"),
    (b'{"model": "nope", "prompt": "x"}', 404, "model"),
    (b'{"model": "lockstep-moe", "prompt": ""}', 400, "prompt"),
    (b'{"model": "lockstep-moe", "prompt": "x", "max_tokens": -5}', 400, "max_tokens"),
    (b'{"model": "lockstep-moe", "prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "lockstep-moe", "prompt": "x", "max_tokens": 10000000}', 400, "max_tokens"),
    (b'{"model": "lockstep-moe", "prompt": "x", "temperature": 9}', 400, "temperature"),
    (b'{"model": "lockstep-moe", "prompt": "x", "n": 0}', 400, "n"),
    (b'{"model": "lockstep-moe", "prompt": "x", "logprobs": 21}', 400, "logprobs"),
    (b'{"model": "lockstep-moe", "prompt": "x", "data_parallel_rank": 7}', 400, "data_parallel_rank"),
])
def test_bad_input_gets_openai_errors(sim_cluster, body, status, param):
    r = httpx.post(sim_cluster.api_url + "/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param


def test_chat_bad_input(sim_cluster):
    url = sim_cluster.api_url + "/chat/completions"
    cases = [
        ({"model": MODEL, "messages": []}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function"}]}, 400),                                   # a tool with no function
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}, 400),  # over the context
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ]
    for body, status in cases:
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == status, (body, r.text)
        assert "error" in r.json()


def test_oversized_body_is_413(sim_cluster):
    r = httpx.post(sim_cluster.api_url + "/completions", content=b"x" * (2 << 20),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # the same without a Content-Length (chunked): the same 413 (it had code null)
    chunks = (b"x" * (1 << 16) for _ in range(40))
    r = httpx.post(sim_cluster.api_url + "/completions", content=chunks,
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # ... and the server is still up.
    assert httpx.get(sim_cluster.api_url.rsplit("/v1", 1)[0] + "/health").status_code == 200


async def test_client_disconnect_frees_the_request(sim_cluster):
    keys = Keys(sim_cluster.namespace)
    r = aioredis.Redis.from_url(sim_cluster.redis_url)
    try:
        body = {"model": MODEL, "prompt": "long one", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", sim_cluster.api_url + "/completions", json=body) as resp:
                lines = resp.aiter_lines()
                first = await asyncio.wait_for(anext(lines), 10)
                while not first.startswith("data: "):
                    first = await asyncio.wait_for(anext(lines), 10)
                rid = json.loads(first[6:])["id"]
        # The engine aborts it: the request record says so, and no rank keeps it running.
        async def aborted():
            rec = await r.hgetall(keys.req(rid))
            return rec.get(b"finish") == b"abort" and rec
        rec = await wait_until(aborted, timeout=15)
        assert int(rec[b"tokens"] if b"tokens" in rec else 0) < 2000

        # ... and the load view says so while the group pauses: the scheduler's snapshot and
        # each rank's info (what `lockstep status` shows) hold no running request and no KV.
        # (The abort empties the group before any step reports it, so the pause reports it;
        # the view used to show the request running until the next request came.)
        async def view_empty():
            raw = await r.hget(keys.snapshot, "json")
            infos = [await r.hget(keys.rank_info(k), "stats") for k in range(2)]
            if not raw or not all(infos):
                return False
            views = [*Snapshot.decode(raw).ranks.values(), *(RankStats.from_dict(orjson.loads(b)) for b in infos)]
            return len(views) == 4 and all(v.running == v.outstanding == v.kv_used == 0 for v in views)
        assert await wait_until(view_empty, timeout=15)
    finally:
        await r.aclose()


def test_status_json(sim_cluster):
    res = sim_cluster.cli("status", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["cluster"]["ranks"] == 2 and data["cluster"]["policy"] == "waterfill"   # numbers as numbers
    assert all(r["alive"] and r["pid"] > 0 for r in data["ranks"])
    assert data["scheduler"]["leader"]
    assert data["scheduler"]["counters"].get("dispatched", 0) >= 0
    # what is queued, not the stream's length (the trim keeps the last entry read: "1 entries")
    assert data["queues"]["requests_unread"] == data["queues"]["requests_unacked"] == 0, data["queues"]
    # (these were strings: "1234", "[0, 1]")
    assert isinstance(data["scheduler"]["pid"], int) and isinstance(data["scheduler"]["since"], float)
    poll_until(lambda: "live" in json.loads(sim_cluster.cli("status", "--json").stdout)["scheduler"], 30,
               "the leader's first renewal")
    sched = json.loads(sim_cluster.cli("status", "--json").stdout)["scheduler"]
    assert sched["live"] == [0, 1] and sched["drained"] == []
    # Piped, the table keeps its columns whole (rich's 80 columns cut them to "wait…", "runni…")
    table = sim_cluster.cli("status")
    assert table.returncode == 0 and "waiting" in table.stdout and "running" in table.stdout, table.stdout
    assert "requests queued 0" in " ".join(table.stdout.split()), table.stdout
    assert "…" not in table.stdout, table.stdout


def test_unreachable_redis_is_one_clear_line(tmp_path):
    env = {"LOCKSTEP_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for args in (["status", "--redis-url", "redis://127.0.0.1:1/0"],
                 ["up", "--redis-url", "redis://127.0.0.1:1/0", "--backend", "sim"]):
        res = subprocess.run([sys.executable, "-m", "services.admin.cli", *args], capture_output=True, text=True,
                             timeout=60, env=env, cwd=ROOT)
        assert res.returncode != 0
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("lockstep:")]
        assert any("redis://127.0.0.1:1/0" in ln for ln in lines), res.stderr


def test_status_without_cluster_says_what_to_do(tmp_path):
    env = {"LOCKSTEP_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "services.admin.cli", "status"], capture_output=True, text=True,
                         timeout=30, env=env, cwd=ROOT)
    assert res.returncode == 2
    assert "scripts/run" in res.stderr


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigterm_stops_everything(tmp_path):
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim")
    data = json.loads(cluster.cli("status", "--json").stdout)
    pids = [r["pid"] for r in data["ranks"]]
    redis_port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    assert cluster.stop(signal.SIGTERM) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            import os
            os.kill(pid, 0)
    assert not _port_open(cluster.port)
    assert not _port_open(redis_port)
    # The local-cluster record is gone with it, and its api-servers' shared metrics directory
    # (one was left in /tmp per run: hundreds on a busy machine)
    assert cluster.cli("status").returncode == 2
    from services.api_server import metrics_dir
    assert not list(metrics_dir.ROOT.glob(f"{cluster.namespace}-{cluster.port}-*"))
