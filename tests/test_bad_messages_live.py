"""Malformed bus entries against a live cluster: every service logs them and carries on.

Garbage goes where each service reads (the wake stream, the request stream, every rank
inbox, the api-server's output stream); then a real request through the
openai client must complete exactly, with no process restarted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import orjson
import pytest

from shared import keys as K
from shared.bus import connect
from shared.messages import FIELD
from shared.tokenizer import encode
from tests.conftest import start_cluster
from tests.helpers import sim_expected_text, wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
MODEL = "lockstep-moe"


def _bad_request(owner: str, rid: str, **over) -> bytes:
    doc = {"k": "req", "id": rid, "api": owner, "p": "6869", "at": time.time(),
           "sp": {"mt": 4, "te": 1.0, "tp": 1.0, "sd": None, "st": [], "ie": False}}
    return orjson.dumps({**doc, **over})


def test_malformed_entries_are_logged_and_nothing_stops(tmp_path):
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim")
    logs = Path(cluster.state_dir) / cluster.namespace / "logs"
    try:
        asyncio.run(_inject(cluster.redis_url, K.Keys(cluster.namespace)))

        def logged() -> str:
            return "".join(p.read_text(errors="replace") for p in logs.glob("*.log"))

        deadline = time.monotonic() + 30
        # Each event, and the errors that say what is wrong: the first bad entry a service
        # logs need not be the one with that message (waiting for the names alone raced).
        want = ("bad_inbox_entry", "bad_output_entry", "bad_request_entry", "bad_wave_notice",
                "non-hexadecimal", "`$.sp.mt`")
        while not all(w in logged() for w in want) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = logged()
        assert all(w in text for w in want), [w for w in want if w not in text]

        client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=60)
        for i in range(4):   # both ranks serve
            r = client.completions.create(model=MODEL, prompt=f"after garbage {i}", max_tokens=6, seed=i,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == sim_expected_text(encode(f"after garbage {i}"), 6, seed=i)
        assert "restarted it" not in (tmp_path / "up.out").read_text()   # no service crashed
    finally:
        cluster.stop()


async def _inject(redis_url: str, keys: K.Keys) -> None:
    r = connect(redis_url)
    try:
        apis = await wait_until(lambda: _api_ids(r, keys), timeout=30)
        api = apis[0]
        # the wake stream paused ranks read
        await r.xadd(keys.wave, {FIELD: b'{"w": 1, "r": 9, "reform": "x"}'})
        # the scheduler's request stream
        for raw in (b"[1, 2]", b"{oops", _bad_request(api, "q1", sp={"mt": "many"}), b'{"k": "zz"}'):
            await r.xadd(keys.requests, {FIELD: raw})
        # every rank's inbox: a request with a bad prompt, one without its api, a bad abort, a list
        for rank in (0, 1):
            for raw in (_bad_request(api, f"i{rank}", p="zz"), _bad_request(api, f"j{rank}", api=None),
                        b'{"k": "abort", "id": 5}', b"[3]"):
                await r.xadd(keys.inbox(rank), {FIELD: raw})
        # the api-server's output stream
        for raw in (b"[1]", b'{"k": "out", "ds": [{"id": 1}]}', b'{"k": "resume", "ids": 5}'):
            await r.xadd(keys.out(api), {FIELD: raw})
    finally:
        await r.aclose()


async def _api_ids(r, keys: K.Keys) -> list[str]:
    prefix, suffix = keys.api_alive("").split("::")
    out = []
    async for key in r.scan_iter(match=keys.api_alive("*")):
        k = key.decode()
        out.append(k[len(prefix) + 1:-len(suffix) - 1])
    return out
