"""Live proofs of "DP+EP engine ranks in lockstep", on real `lockstep up` clusters.

1. Work on one rank only: the other ranks run an idle forward in exactly the steps where
   that rank computes tokens, and in no other step (read from the per-step stats).
2. No work anywhere: the engine processes sleep (CPU near zero) and wake for a request.
3. KV exhaustion on a rank preempts and recovers without losing or duplicating a token.
4. Greedy output on the torch backend is identical across runs with the same placement.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import defaultdict
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.messages import FIELD
from shared.stats import is_pause_report
from shared.tokenizer import encode
from tests.conftest import Cluster, start_cluster
from tests.helpers import sim_expected_text, wait_until

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"
WORLD = 4
BUSY = 1          # the only rank that gets work in the idle-forward proof


def _ns(tag: str) -> str:
    return f"live{tag}{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def torch_cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("torch4")
    cluster = start_cluster(tmp, "--ranks", str(WORLD), "--api-servers", "1", "--backend", "torch",
                            "--log-level", "warning", namespace=_ns("t"), timeout=300)
    yield cluster
    cluster.stop()


# ---------------------------------------------------------------------- helpers
async def _stats_after(r: aioredis.Redis, keys: Keys, after: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    out = []
    for eid, fields in await r.xrange(keys.stats, min=after, max="+"):
        d = orjson.loads(fields[FIELD])
        if eid != after and not is_pause_report(d):   # steps only (a pause reports the load, no step)
            out.append((eid, d))
    return out


async def _stats_mark(r: aioredis.Redis, keys: Keys) -> tuple[bytes, tuple[int, int]]:
    """The stats stream's last id and the newest (wave, step) among its recent entries."""
    recent = await r.xrevrange(keys.stats, count=64)
    if not recent:
        return b"0-0", (-1, -1)
    newest = max((d["wave"], d["step"]) for d in (orjson.loads(f[FIELD]) for _, f in recent))
    return recent[0][0], newest


async def _rank_counters(r: aioredis.Redis, keys: Keys, n: int) -> list[dict[str, int]]:
    out = []
    for i in range(n):
        info = await r.hgetall(keys.rank_info(i))
        out.append({"idle_forwards": int(info.get(b"idle_forwards", 0) or 0),
                    "wave": int(info.get(b"wave", 0) or 0), "step": int(info.get(b"step", 0) or 0)})
    return out


def _body(prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **kw}


async def _complete(http: httpx.AsyncClient, cluster: Cluster, body: dict[str, Any]) -> dict[str, Any]:
    resp = await http.post(cluster.api_url + "/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); utime, stime are fields 14, 15 of the whole process.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- 1. idle forwards
async def test_idle_forward_exactly_in_steps_where_another_rank_works(torch_cluster: Cluster):
    keys = Keys(torch_cluster.namespace)
    r = aioredis.Redis.from_url(torch_cluster.redis_url)
    try:
        mark, newest = await _stats_mark(r, keys)
        before = await _rank_counters(r, keys, WORLD)
        async with httpx.AsyncClient(timeout=240) as http:
            results = await asyncio.wait_for(asyncio.gather(*(
                _complete(http, torch_cluster, _body(f"only rank {BUSY} works {i}", 12 + 4 * i,
                                                     temperature=0, data_parallel_rank=BUSY))
                for i in range(4))), 240)
        assert [res["usage"]["completion_tokens"] for res in results] == [12, 16, 20, 24]

        # Every step of the run window reported by every rank (the others' reports of the
        # last step may land just after the response): poll until complete.
        async def window():
            steps: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)
            for _, d in await _stats_after(r, keys, mark):
                if (d["wave"], d["step"]) > newest:
                    assert d["rank"] not in steps[(d["wave"], d["step"])], f"rank reported a step twice: {d}"
                    steps[(d["wave"], d["step"])][d["rank"]] = d
            counters = await _rank_counters(r, keys, WORLD)
            idle = [c["idle_forwards"] - b["idle_forwards"] for c, b in zip(counters, before)]
            done = steps and all(len(v) == WORLD for v in steps.values()) and \
                all(idle[i] == len(steps) for i in range(WORLD) if i != BUSY)
            return done and (steps, idle, counters)

        steps, idle, counters = await wait_until(window, timeout=30)
        # Rank BUSY computed tokens in every published step; every other rank ran an idle
        # forward in each of those steps and computed nothing.
        for key, by_rank in sorted(steps.items()):
            assert by_rank[BUSY]["scheduled"] > 0 and not by_rank[BUSY]["idle"], (key, by_rank[BUSY])
            for i in range(WORLD):
                if i != BUSY:
                    assert by_rank[i]["idle"] and by_rank[i]["scheduled"] == 0, (key, i, by_rank[i])
        # The ranks' own counters agree: one idle forward per such step, none elsewhere
        # (not while the group paused before or after the work), none on the busy rank.
        print(f"steps with work on rank {BUSY}: {len(steps)}; idle forwards per rank: {idle}")
        assert idle[BUSY] == 0
        assert all(idle[i] == len(steps) for i in range(WORLD) if i != BUSY), (idle, len(steps))
        # Lockstep: within each wave every rank went through the same steps, 0..n-1.
        by_wave: dict[int, set[int]] = defaultdict(set)
        for w, s in steps:
            by_wave[w].add(s)
        for w, ss in by_wave.items():
            if w > newest[0]:
                assert ss == set(range(max(ss) + 1)), (w, sorted(ss))
        # Tokens: 4 prefills + decodes. Each request's first token comes from its prefill.
        decode = sum(d[BUSY]["decode"] for d in steps.values())
        assert decode == sum(res["usage"]["completion_tokens"] - 1 for res in results)

        # Nobody has work now: no further steps, so no idle forwards either.
        await asyncio.sleep(1.0)   # an observation window, not a synchronisation
        assert await _rank_counters(r, keys, WORLD) == counters
        later = await _stats_after(r, keys, mark)
        assert len([d for _, d in later if (d["wave"], d["step"]) > newest]) == len(steps) * WORLD
    finally:
        await r.aclose()


# ---------------------------------------------------------------------- 2. pause
async def test_paused_engines_use_no_cpu_and_wake_for_a_request(torch_cluster: Cluster):
    keys = Keys(torch_cluster.namespace)
    res = torch_cluster.cli("status", "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    pids = [rk["pid"] for rk in json.loads(res.stdout)["ranks"]]
    assert len(pids) == WORLD and all(pids)
    r = aioredis.Redis.from_url(torch_cluster.redis_url)
    try:
        async with httpx.AsyncClient(timeout=240) as http:
            # A short request first, so the window starts right after a real wave ended.
            await _complete(http, torch_cluster, _body("warm", 4, temperature=0))

            async def settled():   # the wave's last reports are in: nothing moves any more
                a = (await _stats_mark(r, keys), await _rank_counters(r, keys, WORLD))
                await asyncio.sleep(0.3)
                b = (await _stats_mark(r, keys), await _rank_counters(r, keys, WORLD))
                return a == b and a
            (mark, _), counters = await wait_until(settled, timeout=30)

            window = 5.0
            cpu0 = [_cpu_seconds(p) for p in pids]
            t0 = time.monotonic()
            await asyncio.sleep(window)   # the measurement window itself
            elapsed = time.monotonic() - t0
            cpu = [_cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
            # No steps (no idle forwards, no stats) and no busy loop while nobody has work.
            assert await _rank_counters(r, keys, WORLD) == counters
            assert await _stats_after(r, keys, mark) == []
            print(f"paused engines' CPU over {elapsed:.1f} s: {[round(u / elapsed, 4) for u in cpu]} of a core")
            for pid, used in zip(pids, cpu):
                assert used / elapsed < 0.05, f"engine pid {pid} used {used:.3f} s CPU in {elapsed:.1f} s while paused"

            # ... and the group wakes for a request sent after the pause.
            t1 = time.monotonic()
            out = await asyncio.wait_for(_complete(http, torch_cluster, _body("after the pause", 8, temperature=0)), 120)
            assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"
            after = await _stats_after(r, keys, mark)
            assert after, "the request completed without any step"
            assert all(d["wave"] > max(c["wave"] for c in counters) for _, d in after)  # a new wave
            assert time.monotonic() - t1 < 120
    finally:
        await r.aclose()


async def test_repeated_pause_and_wake_from_any_rank(torch_cluster: Cluster):
    """Every rank can wake the paused group, alone or two at once (two wake notices for
    one wave); each time the group runs in lockstep and pauses again."""
    keys = Keys(torch_cluster.namespace)
    r = aioredis.Redis.from_url(torch_cluster.redis_url)
    try:
        async def paused():   # rank 0 sets the key as the group pauses; the wake deletes it
            return await r.exists(keys.paused)

        mark, newest = await _stats_mark(r, keys)
        async with httpx.AsyncClient(timeout=240) as http:
            for k in range(2 * WORLD):
                # each wake starts from a paused group: sent at once after the last answer,
                # it could land before the group paused and share its wave (a loaded CI box)
                assert await wait_until(paused, timeout=30), k
                wakers = [k % WORLD] if k < WORLD else [k % WORLD, (k + 1) % WORLD]
                outs = await asyncio.wait_for(asyncio.gather(*(
                    _complete(http, torch_cluster, _body(f"wake {k} {w}", 3, temperature=0, data_parallel_rank=w))
                    for w in wakers)), 120)
                assert all(o["usage"]["completion_tokens"] == 3 for o in outs)

        async def all_reported():
            steps: dict[tuple[int, int], set[int]] = defaultdict(set)
            for _, d in await _stats_after(r, keys, mark):
                if (d["wave"], d["step"]) > newest:
                    steps[(d["wave"], d["step"])].add(d["rank"])
            return steps and all(len(v) == WORLD for v in steps.values()) and steps
        steps = await wait_until(all_reported, timeout=30)
        waves = {w for w, _ in steps}
        assert len(waves) >= 2 * WORLD, sorted(waves)   # a pause between consecutive wakes
    finally:
        await r.aclose()


# ---------------------------------------------------------------------- 4. greedy determinism
async def test_greedy_output_identical_across_runs_same_placement(torch_cluster: Cluster):
    body = _body("The experts of every rank", 24, temperature=0, data_parallel_rank=2)
    async with httpx.AsyncClient(timeout=240) as http:
        runs = [await asyncio.wait_for(_complete(http, torch_cluster, body), 120) for _ in range(3)]
        texts = [x["choices"][0]["text"] for x in runs]
        assert all(x["usage"]["completion_tokens"] == 24 for x in runs)
        assert texts[0] and texts.count(texts[0]) == 3, texts
        # Same placement, while the other ranks are busy with their own requests (the
        # all-to-alls then carry other ranks' tokens through the same experts).
        noise = [_complete(http, torch_cluster, _body(f"neighbour {i}", 24, temperature=0, data_parallel_rank=i))
                 for i in range(WORLD) if i != 2]
        busy = await asyncio.wait_for(asyncio.gather(_complete(http, torch_cluster, body), *noise), 240)
        assert busy[0]["choices"][0]["text"] == texts[0]


# ---------------------------------------------------------------------- 3. KV exhaustion
KV_BLOCKS, BLOCK = 24, 4          # 96 tokens of KV per rank


@pytest.fixture()
def tiny_kv_cluster(tmp_path, monkeypatch):
    # `lockstep up` passes the caller's LOCKSTEP_* settings it does not set itself to the children.
    monkeypatch.setenv("LOCKSTEP_NUM_KV_BLOCKS", str(KV_BLOCKS))
    monkeypatch.setenv("LOCKSTEP_BLOCK_SIZE", str(BLOCK))
    # a request must fit the KV alone (`up` refuses a cache smaller than max_model_len)
    monkeypatch.setenv("LOCKSTEP_MAX_MODEL_LEN", str(KV_BLOCKS * BLOCK))
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim",
                            "--time-scale", "0.25", "--log-level", "warning", namespace=_ns("kv"))
    yield cluster
    cluster.stop()


async def test_kv_exhaustion_preempts_and_recovers_exactly(tiny_kv_cluster: Cluster):
    cluster = tiny_kv_cluster
    keys = Keys(cluster.namespace)
    per_rank, max_tokens = 8, 48      # prompt (~16) + 48 = 16 blocks each: fits alone, 8 at once do not
    jobs = [(f"kv pressure request {i:02d}", i, i % 2) for i in range(2 * per_rank)]
    async with httpx.AsyncClient(timeout=240) as http:
        async def one(prompt: str, seed: int, rank: int):
            body = _body(prompt, max_tokens, seed=seed, data_parallel_rank=rank, stream=True,
                         stream_options={"include_usage": True})
            text, usage, finish, rid = [], None, [], None
            async with http.stream("POST", cluster.api_url + "/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    c = json.loads(line[6:])
                    rid = c["id"]
                    for ch in c["choices"]:
                        text.append(ch["text"])
                        if ch.get("finish_reason"):
                            finish.append(ch["finish_reason"])
                    usage = c.get("usage") or usage
            return rid, "".join(text), usage, finish

        results = await asyncio.wait_for(asyncio.gather(*(one(*j) for j in jobs)), 240)

    for (prompt, seed, _), (rid, text, usage, finish) in zip(jobs, results):
        assert finish == ["length"], (prompt, finish)
        assert usage["completion_tokens"] == max_tokens
        assert text == sim_expected_text(encode(prompt), max_tokens, seed=seed), prompt

    r = aioredis.Redis.from_url(cluster.redis_url)
    try:
        # What the engines wrote (before the api-server's dedupe): per request, deltas at
        # contiguous positions, never a token twice, exactly max_tokens, one finish.
        seen: dict[str, list[tuple[int, int, str | None]]] = defaultdict(list)
        streams = [k async for k in r.scan_iter(keys.out("*"))]
        for stream in streams:
            for _, fields in await r.xrange(stream):
                for d in orjson.loads(fields[FIELD]).get("ds", []):
                    seen[d["id"]].append((d["o"], len(d["t"]), d.get("f")))
        ids = {res[0] for res in results}
        assert ids <= set(seen)
        for rid in ids:
            have = 0
            for pos, n, fin in seen[rid]:
                assert pos == have, (rid, seen[rid])
                have += n
            assert have == max_tokens and [f for *_, f in seen[rid] if f] == ["length"], (rid, seen[rid])

        # The stats show the pool was exhausted and sequences preempted, on both ranks.
        stats = [orjson.loads(f[FIELD]) for _, f in await r.xrange(keys.stats)]
        assert all(d["kv_total"] == KV_BLOCKS and d["kv_used"] <= KV_BLOCKS for d in stats)
        preempted = {rank: max(d["extra"]["preemptions"] for d in stats if d["rank"] == rank) for rank in (0, 1)}
        print(f"preemptions per rank: {preempted}")
        assert all(n > 0 for n in preempted.values()), preempted
        assert max(d["kv_used"] for d in stats) >= KV_BLOCKS - 1
    finally:
        await r.aclose()
