"""Live proofs of staggered batches (issue "Staggered batch scheduling").

Real `lockstep up --ranks 4 --backend torch` clusters (a small MoE, experts sharded over
the 4 ranks, gloo collectives), driven by `lockstep bench --trace` so the figures come
from the same code the benchmark reports use:

* a burst of 4×k equal requests arriving spread over 50 ms, under ``--policy staggered``:
  every rank runs its first prefill of the burst in the same (wave, step), read from the
  ranks' step stats; and the idle-forward fraction over the bursts is lower than under
  ``--policy least_score`` on the same bursts (a separate cluster);
* a trickle of one request every 2 s with ``--max-wait-ms 200``: no request waits for a
  batch that will not fill: every TTFT <= 200 ms + two steps.

Bounds are on behaviour, not speed: "a step" is the cluster's own measured step period.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
import redis

from shared.keys import Keys
from tests.conftest import Cluster, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RANKS = 4
K = 3                      # requests per rank in one burst
BURST_SPREAD_S = 0.05
BURSTS = 3                 # bursts per cluster (the comparison sums over them)
MAX_WAIT_MS = 200.0
TRICKLE = 5
TRICKLE_GAP_S = 2.0
TRICKLE_PROMPT = 32       # tells the trickle's records apart from the bursts' (64)

RESULTS: dict[str, list[dict]] = {}


def write_burst(path: Path, n: int = RANKS * K, prompt: int = 64, output: int = 32) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"t": round(i * BURST_SPREAD_S / (n - 1), 6), "prompt_tokens": prompt,
                                "output_tokens": output}) + "\n")
    return path


def bench(cluster: Cluster, trace: Path) -> dict:
    p = cluster.cli("bench", "--trace", str(trace), "--json", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["completed"] == doc["requests"], doc.get("errors")
    return doc


def warm_up(cluster: Cluster, tmp: Path) -> None:
    """First requests on a fresh cluster pay one-off costs (imports, allocator, first
    collectives) and teach the scheduler the step time: not part of any figure."""
    bench(cluster, write_burst(tmp / "warm.jsonl", n=RANKS, output=4))


@pytest.fixture(scope="module")
def staggered(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("staggered")
    c = start_cluster(tmp, "--ranks", str(RANKS), "--api-servers", "1", "--backend", "torch",
                      "--policy", "staggered", "--max-wait-ms", f"{MAX_WAIT_MS:g}", namespace="stg")
    c.tmp = tmp  # type: ignore[attr-defined]
    warm_up(c, tmp)
    yield c
    c.stop()


def test_burst_starts_its_prefills_on_every_rank_in_the_same_step(staggered):
    trace = write_burst(staggered.tmp / "burst.jsonl")
    runs = []
    for _ in range(BURSTS):
        doc = bench(staggered, trace)
        runs.append(doc)
        first = doc["first_prefill_step"]
        assert set(first) == {str(r) for r in range(RANKS)}
        assert None not in first.values(), first
        assert len({tuple(v) for v in first.values()}) == 1, f"prefills started in different steps: {first}"
        assert sorted(doc["per_rank_requests"].values()) == [K] * RANKS, doc["per_rank_requests"]
    RESULTS["staggered"] = runs


def test_a_trickle_waits_no_longer_than_the_wait_bound(staggered):
    """One request every 2 s cannot fill a batch: each is released by its wait bound (or at
    once, when the batcher has learned the arrival rate), and its first token is computed
    within 200 ms + two steps of the api-server accepting it: at most one step to reach a
    step boundary (waking the paused group) and one for its prefill.

    Measured server-side, from the request's record (t_arrival, t_dispatched, rank) and
    the ranks' step stats, so the HTTP and output-stream hops of a loaded test machine are
    not counted as steps; the client-side TTFTs are in the message for reference."""
    path = staggered.tmp / "trickle.jsonl"
    with open(path, "w") as f:
        for i in range(TRICKLE):
            f.write(json.dumps({"t": i * TRICKLE_GAP_S, "prompt_tokens": TRICKLE_PROMPT, "output_tokens": 4}) + "\n")
    doc = bench(staggered, path)
    r = redis.Redis.from_url(staggered.redis_url)
    try:
        recs = [r.hgetall(k) for k in r.scan_iter(Keys(staggered.namespace).req("*"), count=1000)]
        stats = [orjson.loads(f[b"d"]) for _, f in r.xrange(Keys(staggered.namespace).stats)]
    finally:
        r.close()
    trickle = sorted((h for h in recs if int(h[b"prompt_tokens"]) == TRICKLE_PROMPT),
                     key=lambda h: float(h[b"t_arrival"]))
    assert len(trickle) == TRICKLE
    # a step: the longest wall time between consecutive steps of one wave in this run
    t0 = float(trickle[0][b"t_arrival"])
    ends: dict[tuple[int, int], float] = {}
    for d in stats:
        if d["t"] >= t0:
            k = (d["wave"], d["step"])
            ends[k] = max(ends.get(k, 0.0), d["t"])
    keys = sorted(ends)
    periods = [ends[b] - ends[a] for a, b in zip(keys, keys[1:]) if a[0] == b[0] and b[1] == a[1] + 1]
    step_s = max(periods)
    report = []
    for h in trickle:
        ta, td, rank = float(h[b"t_arrival"]), float(h[b"t_dispatched"]), int(h[b"rank"])
        first = min(d["t"] for d in stats if d["rank"] == rank and d["prefill"] > 0 and d["t"] >= td)
        report.append({"hold_ms": round((td - ta) * 1000, 1), "first_token_ms": round((first - ta) * 1000, 1),
                       "reason": h[b"reason"].decode()})
    msg = {"requests": report, "step_ms": round(step_s * 1000, 1), "client_ttft_ms": doc["ttft_ms"]}
    for x in report:
        assert x["reason"] in ("timeout", "wait_bound"), msg     # never waits for a full batch
        assert x["hold_ms"] <= MAX_WAIT_MS + step_s * 1000, msg
        assert x["first_token_ms"] <= MAX_WAIT_MS + 2 * step_s * 1000, msg


def test_idle_forward_fraction_lower_than_least_score_on_the_same_bursts(staggered, tmp_path):
    assert "staggered" in RESULTS, "needs test_burst_starts_its_prefills_on_every_rank_in_the_same_step"
    staggered.stop()   # one torch cluster at a time
    c = start_cluster(tmp_path, "--ranks", str(RANKS), "--api-servers", "1", "--backend", "torch",
                      "--policy", "least_score", namespace="lsc")
    try:
        warm_up(c, tmp_path)
        trace = write_burst(tmp_path / "burst.jsonl")
        RESULTS["least_score"] = [bench(c, trace) for _ in range(BURSTS)]
    finally:
        c.stop()

    def pooled(runs: list[dict]) -> float:
        # idle rank-steps / rank-steps with work, over all bursts together
        idle = sum(d["idle_forwards"] for d in runs)
        rank_steps = sum(d["work_steps"] * d["ranks"] for d in runs)
        return idle / rank_steps

    stg, lsc = pooled(RESULTS["staggered"]), pooled(RESULTS["least_score"])
    assert stg < lsc, {"staggered": stg, "least_score": lsc,
                       "per_burst": {k: [d["idle_forward_fraction"] for d in v] for k, v in RESULTS.items()}}
