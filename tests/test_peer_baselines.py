"""Unit tests of the peer models (services/simulator/baselines.py, peer_gates.py); no simulator."""

from __future__ import annotations

from shared.policy.base import RequestInfo
from shared.stats import RankStats, Snapshot

from services.simulator.baselines import (FastDeployBatcher, SglangDP, SglangPublishFilter,
                                          VllmDPLB, policy_specs)
from services.simulator.peer_gates import (AdpBalanceGate, GateView, PrefillDelayer, RankLoad,
                                           TrtllmAdpRouter)


def _req(i: int, prompt: int = 100, t: float = 0.0) -> RequestInfo:
    return RequestInfo(id=f"r{i}", prompt_tokens=prompt, max_tokens=64, arrival=t)


def _snap(rows: dict[int, tuple], t: float = 1.0) -> Snapshot:
    ranks = {}
    for r, row in rows.items():
        waiting, running = row[0], row[1]
        kv_used = row[2] if len(row) > 2 else 0
        st_t = row[3] if len(row) > 3 else t
        tokens = row[4] if len(row) > 4 else 0
        ranks[r] = RankStats(r, 0, 1, waiting=waiting, running=running, kv_used=kv_used,
                             kv_total=100, t=st_t, extra={"tokens": tokens})
    return Snapshot(wave=0, step=1, t=t, ranks=ranks)


def _view(has_ctx, n_gen, *, now=0.0, max_seqs=8, kv=None) -> GateView:
    n = len(has_ctx)
    return GateView(now=now, has_ctx=list(has_ctx), n_gen=list(n_gen), n_running=list(n_gen),
                    n_waiting=[1 if c else 0 for c in has_ctx], max_num_seqs=max_seqs,
                    kv_usage=list(kv) if kv is not None else [0.0] * n)


# ----------------------------------------------------------------------------- vLLM

def test_vllm_rotation_spreads_ties():
    p = VllmDPLB(dispatcher_id="a0", ranks=[0, 1, 2, 3])
    picks = [p.choose(_req(i), 0.0).rank for i in range(4)]
    assert picks == [0, 1, 2, 3]
    # after a view that resets all counts to equal, the scan start keeps rotating
    p.on_snapshot(_snap({r: (0, 5) for r in range(4)}))
    p.inflight = [0, 0, 0, 0]
    assert p.choose(_req(9), 0.0).rank == 0          # start is back at 0 after 4 rotations
    p.on_snapshot(_snap({r: (0, 5) for r in range(4)}))
    p.inflight = [0, 0, 0, 0]
    assert p.choose(_req(10), 0.0).rank == 1


def test_vllm_scan_start_per_client():
    p = VllmDPLB(dispatcher_id="a1", num_api_servers=2, client_index=1, ranks=[0, 1, 2, 3])
    assert p.choose(_req(0), 0.0).rank == 2


def test_vllm_kv_penalty_only_with_waiting_and_above_half():
    p = VllmDPLB(dispatcher_id="a0", ranks=[0, 1])
    # rank 0: 2 waiting + 2 running at 90 % KV; rank 1: 5 running, none waiting
    p.on_snapshot(_snap({0: (2, 2, 90), 1: (0, 5, 95)}))
    assert p.score(0) == 4 + 2 * 6.0 * (0.9 - 0.5)
    assert p.score(1) == 5
    assert p.choose(_req(0), 0.0).rank == 1
    q = VllmDPLB(dispatcher_id="a0", ranks=[0, 1])
    q.on_snapshot(_snap({0: (2, 2, 40), 1: (0, 5, 95)}))
    assert q.score(0) == 4                           # below the knee: no penalty
    assert q.choose(_req(0), 0.0).rank == 0


def test_vllm_inflight_floor_survives_view_and_bump_does_not():
    p = VllmDPLB(dispatcher_id="a0", num_api_servers=2, ranks=[0, 1])
    p.choose(_req(0), 0.0)
    p.choose(_req(1), 0.0)
    p.choose(_req(2), 0.0)
    assert p.inflight == [2, 1]
    assert p.waiting == [4, 2]                       # +client_count bumps
    p.on_snapshot(_snap({0: (0, 0), 1: (0, 0)}))    # stale view: bumps are gone
    assert p.waiting == [0, 0] and p.inflight == [2, 1]
    assert p.score(0) == 4 and p.score(1) == 2       # max(2 * inflight, 0)
    p.note_finished("r0")
    assert p.inflight == [1, 1]
    p.note_finished("r0")                            # idempotent
    assert p.inflight == [1, 1]


# ----------------------------------------------------------------------------- SGLang

def test_sglang_skips_unchanged_timestamp_and_keeps_bumps():
    p = SglangDP(dispatcher_id="s", ranks=[0, 1], metric="requests")
    p.on_snapshot(_snap({0: (0, 1, 0, 1.0), 1: (0, 1, 0, 1.0)}))
    assert p.choose(_req(0), 0.0).rank == 0
    assert p.requests == [2, 1]
    # rank 0 did not republish (same t): its bumped value stays; rank 1 refreshed
    p.on_snapshot(_snap({0: (0, 1, 0, 1.0), 1: (0, 3, 0, 2.0)}))
    assert p.requests == [2, 3] and p.skipped == 1


def test_sglang_tokens_tie_break_by_requests_and_prompt_bump():
    p = SglangDP(dispatcher_id="s", ranks=[0, 1, 2], metric="tokens")
    p.on_snapshot(_snap({0: (2, 2, 0, 1.0, 500), 1: (0, 1, 0, 1.0, 500), 2: (0, 1, 0, 1.0, 900)}))
    a = p.choose(_req(0, prompt=300), 0.0)
    assert a.rank == 1                               # equal tokens, fewer requests
    assert p.tokens == [500, 800, 900] and p.requests == [4, 2, 1]
    assert p.choose(_req(1, prompt=10), 0.0).rank == 0


def test_sglang_requests_lowest_rank_on_tie():
    p = SglangDP(dispatcher_id="s", ranks=[0, 1, 2], metric="requests")
    p.on_snapshot(_snap({0: (1, 1), 1: (0, 1), 2: (0, 1)}))
    assert p.choose(_req(0), 0.0).rank == 1


def test_sglang_publish_filter_keeps_old_timestamp():
    f = SglangPublishFilter(every=15)
    a = RankStats(0, 0, 1, waiting=1, running=1, scheduled=10, prefill=10, t=1.0)
    assert f([a])[0].t == 1.0
    b = RankStats(0, 0, 2, waiting=0, running=2, scheduled=2, decode=2, t=2.0)
    out = f([b])[0]
    assert out.t == 1.0 and out.running == 1         # carried: old values, old timestamp


# ----------------------------------------------------------------------------- TensorRT-LLM

def _loads(rows, max_seqs=8):
    return [RankLoad(rank=r, num_waiting=w, num_running=ru, active_prompt_tokens=tok,
                     max_num_seqs=max_seqs, kv_free_tokens=10**6)
            for r, (w, ru, tok) in enumerate(rows)]


def test_trtllm_heap_order_longest_first():
    p = TrtllmAdpRouter(dispatcher_id="x", ranks=[0, 1])
    for i, pr in enumerate([100, 900, 300, 500]):
        assert p.submit(_req(i, pr, t=i), 0.0) == []
    out = p.bind(0.0, _loads([(0, 0, 0), (0, 0, 50)]))
    got = {a.request_id: a.rank for a in out}
    # longest first: 900 -> rank 0 (fewer tokens); 500 -> rank 1 (50 < 900);
    # 300 -> rank 1 (550 < 900); cap ceil(4/2)=2 reached on rank 1 -> 100 -> rank 0
    assert got == {"r1": 0, "r3": 1, "r2": 1, "r0": 0}
    assert not p.queue


def test_trtllm_tie_on_tokens_breaks_by_requests_then_rank():
    p = TrtllmAdpRouter(dispatcher_id="x", ranks=[0, 1, 2])
    p.submit(_req(0, 100), 0.0)
    out = p.bind(0.0, _loads([(1, 1, 200), (0, 1, 200), (0, 0, 300)]))
    assert [a.rank for a in out] == [1]


def test_trtllm_per_rank_cap_is_ceil_fair_share():
    p = TrtllmAdpRouter(dispatcher_id="x", ranks=[0, 1, 2])
    for i in range(5):
        p.submit(_req(i, 10), 0.0)
    out = p.bind(0.0, _loads([(0, 0, 0), (0, 0, 0), (0, 0, 0)]))
    per = [sum(1 for a in out if a.rank == r) for r in range(3)]
    assert sorted(per) == [1, 2, 2] and max(per) == 2   # ceil(5/3)
    # a rank already above the fair share gets nothing
    q = TrtllmAdpRouter(dispatcher_id="x", ranks=[0, 1])
    for i in range(2):
        q.submit(_req(i, 10), 0.0)
    out = q.bind(0.0, _loads([(0, 4, 0), (0, 0, 999)]))
    assert [a.rank for a in out] == [1, 1]


def test_trtllm_capacity_gate_binds_late():
    p = TrtllmAdpRouter(dispatcher_id="x", ranks=[0, 1])
    for i in range(6):
        p.submit(_req(i, 10, t=i), 0.0)
    # room = 2*4 - (3+3) = 2: only the first two arrivals are taken
    out = p.bind(0.0, _loads([(0, 3, 30), (1, 2, 30)], max_seqs=4))
    assert sorted(a.request_id for a in out) == ["r0", "r1"]
    assert [q.id for q in p.queue] == ["r2", "r3", "r4", "r5"]
    assert p.bind(0.1, _loads([(0, 4, 40), (0, 4, 40)], max_seqs=4)) == []
    out = p.bind(0.2, _loads([(0, 1, 10), (0, 4, 40)], max_seqs=4))
    assert [a.request_id for a in out] == ["r2", "r3", "r4"]   # room = 8 - 5 = 3
    assert all(a.rank == 0 for a in out)
    assert [q.id for q in p.queue] == ["r5"]


# ----------------------------------------------------------------------------- gates

def test_adp_gate_holds_until_every_rank_has_ctx_then_timeout():
    g = AdpBalanceGate(timeout_iters=3, batching_wait_iters=0)
    v = _view([True, False], [2, 2])
    assert g.allow(v) is False
    assert g.allow(v) is False
    assert g.allow(v) is True                       # 3rd iteration: timeout
    assert g.counters()["vetoed_steps"] == 2
    assert g.allow(v) is False                      # counter restarted


def test_adp_gate_releases_when_a_rank_has_no_generation():
    g = AdpBalanceGate(timeout_iters=50, batching_wait_iters=10)
    assert g.allow(_view([True, False], [2, 0])) is True


def test_adp_gate_batching_wait():
    g = AdpBalanceGate(timeout_iters=50, batching_wait_iters=2)
    v = _view([True, True], [3, 3])
    assert [g.allow(v) for _ in range(4)] == [False, False, True, False]
    # all ranks have ctx but some rank has no decode: released at once
    assert AdpBalanceGate(50, 2).allow(_view([True, True], [3, 0])) is True


def test_adp_gate_counter_runs_without_ctx():
    g = AdpBalanceGate(timeout_iters=3, batching_wait_iters=0)
    assert g.allow(_view([False, False], [1, 1])) is False  # no prefill to veto, counter +1
    assert g.allow(_view([False, False], [1, 1])) is False  # +1
    assert g.allow(_view([True, False], [1, 1])) is True    # reaches 3 at once
    assert g.counters()["vetoed_steps"] == 0


def test_adp_gate_full_rank_blocks_all_free():
    g = AdpBalanceGate(timeout_iters=2, batching_wait_iters=0)
    assert g.allow(_view([True, True], [8, 1], max_seqs=8)) is False
    assert g.allow(_view([True, True], [8, 1], max_seqs=8)) is True


def test_prefill_delayer_veto_bound():
    d = PrefillDelayer(max_delay_passes=30)
    v = _view([True, False, True], [1, 1, 1])
    verdicts = [d.allow(v) for _ in range(31)]
    assert verdicts[:29] == [False] * 29 and verdicts[29] is True and verdicts[30] is False
    assert d.counters()["vetoed_steps"] == 30          # 29, then a new streak starts
    assert d.counters()["released_timeout"] == 1


def test_prefill_delayer_all_or_none_allow():
    d = PrefillDelayer()
    assert d.allow(_view([True, True], [0, 0])) is True
    assert d.allow(_view([False, False], [1, 1])) is True
    assert d.allow(_view([True, False], [1, 1])) is False
    assert d.allow(_view([True, True], [1, 1])) is True      # wait success resets
    assert d.counters()["released_all"] == 1


def test_prefill_delayer_watermark_and_max_delay_ms():
    d = PrefillDelayer(token_usage_watermark=0.3)
    assert d.allow(_view([True, False], [1, 1], kv=[0.2, 0.9])) is True
    assert d.allow(_view([True, False], [1, 1], kv=[0.5, 0.1])) is False  # low rank not prefillable
    t = PrefillDelayer(max_delay_passes=100, max_delay_ms=50)
    assert t.allow(_view([True, False], [1, 1], now=1.0)) is False
    assert t.allow(_view([True, False], [1, 1], now=1.04)) is False
    assert t.allow(_view([True, False], [1, 1], now=1.05)) is True


# ----------------------------------------------------------------------------- specs

def test_specs_fields_and_fastdeploy_label():
    s = policy_specs()
    assert "fastdeploy_staggered" not in s
    fd = s["fastdeploy_staggered_pr"]
    assert fd.reference is False and "UNMERGED" in fd.source and fd.gate == ("batch", 0.5)
    assert FastDeployBatcher.name == "fastdeploy_staggered_pr"
    assert s["vllm"].default_dispatch == "client" and s["vllm"].client_mode
    assert s["vllm_pre_21617"].default_dispatch == "client"
    for name in ("sglang_total_requests", "sglang_total_tokens", "sglang_prefill_delayer",
                 "trtllm_adp_balance", "fastdeploy_staggered_pr"):
        assert s[name].default_dispatch == "scheduler"
    assert s["trtllm_adp_balance"].late_binding and s["trtllm_adp_placement_only"].late_binding
    assert isinstance(s["trtllm_adp_balance"].group_gate(), AdpBalanceGate)
    assert s["trtllm_adp_placement_only"].group_gate is None
    assert isinstance(s["sglang_prefill_delayer"].group_gate(), PrefillDelayer)
    assert s["staggered"].gate[0] == "batch"
    for spec in s.values():
        assert spec.source
    router = s["trtllm_adp_balance"].factory(dispatcher_id="x", client_index=0, num_api_servers=1,
                                             client_mode=False, ranks=[0, 1], block_size=16)
    assert isinstance(router, TrtllmAdpRouter)
