"""The engine's pure local core: sequences, KV blocks, continuous batching, stops."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler, StepPlan
from services.engine_worker.sequence import Sequence, SeqStatus
from shared.messages import Request, SamplingParams
from shared.tokenizer import EOS, encode


# -- a fake model: the next token depends only on (sequence, position) --------------------

def tok(seq_id: str, pos: int, eos_every: int = 0) -> int:
    h = zlib.crc32(f"{seq_id}:{pos}".encode())
    if eos_every and h % eos_every == 0:
        return EOS
    return ord("a") + h % 4          # small alphabet, so stop strings do occur


def make(seq_id: str, prompt_len: int, max_tokens: int, *, stop=(), ignore_eos=True,
         generated=(), arrival=0.0) -> Sequence:
    prompt = [ord("p")] * prompt_len
    return Sequence(id=seq_id, prompt=prompt, generated=list(generated), arrival=arrival,
                    params=SamplingParams(max_tokens=max_tokens, stop=list(stop),
                                          ignore_eos=ignore_eos, seed=7))


def check_invariants(s: EngineScheduler, plan: StepPlan) -> None:
    assert plan.num_tokens <= s.max_num_batched_tokens
    assert plan.num_tokens == sum(c.num_tokens for c in plan.chunks)
    assert len(plan.chunks) <= s.max_num_seqs
    assert len(s.running) <= s.max_num_seqs
    ids = [c.seq_id for c in plan.chunks]
    assert len(ids) == len(set(ids))
    for c in plan.chunks:
        assert len(c.block_table) * s.bm.block_size >= c.context_len
        seq = s.get(c.seq_id)
        assert seq is not None and seq.status is SeqStatus.RUNNING
        assert c.start_pos == seq.num_computed_tokens
        assert c.sample == (c.context_len == seq.num_tokens)
        assert c.token_ids == seq.all_tokens[c.start_pos:c.context_len]
        assert c.prompt_len == len(seq.prompt) and c.seed == 7
    assert plan.max_context == max((c.context_len for c in plan.chunks), default=0)
    used = [b for q in s.running for b in q.block_table]
    assert len(used) == len(set(used)) == s.kv_used
    assert all(not q.block_table and q.status is SeqStatus.WAITING for q in s.waiting)
    assert len(s) == s.num_waiting + s.num_running


def drive(s: EngineScheduler, arrivals: dict[int, list[Sequence]], *, eos_every=0,
          gate=None, aborts: dict[int, list[str]] | None = None, max_steps=10_000,
          plans: list[StepPlan] | None = None):
    """Run until idle; return {id: emitted tokens} and {id: finish reason}. Checks that
    every Output continues exactly where the previous one stopped (no gap, no dup)."""
    emitted: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    step = 0
    last = max(arrivals, default=0)
    while step <= last or s.has_work():
        assert step < max_steps, "no progress"
        for q in arrivals.get(step, []):
            emitted.setdefault(q.id, list(q.generated))
            out = s.add(q, now=float(step))
            if out is not None:
                finish[q.id] = out.finish_reason
        for sid in (aborts or {}).get(step, []):
            q = s.abort(sid)
            if q is not None:
                finish[sid] = "abort"
        plan = s.schedule(gate)
        check_invariants(s, plan)
        if plans is not None:
            plans.append(plan)
        sampled = {c.seq_id: tok(c.seq_id, c.context_len, eos_every)
                   for c in plan.chunks if c.sample}
        for o in s.postprocess(plan, sampled, now=float(step)):
            assert o.pos == len(emitted[o.seq.id]), "gap or duplicate"
            emitted[o.seq.id].extend(o.new_tokens)
            if o.finish_reason:
                finish[o.seq.id] = o.finish_reason
        step += 1
    assert s.kv_used == 0 and not s.running and not s.waiting
    return emitted, finish


def sched(num_blocks=1000, block_size=4, budget=64, max_seqs=8, max_len=4096, chunked=True):
    return EngineScheduler(BlockManager(num_blocks, block_size), budget, max_seqs, max_len,
                           chunked_prefill=chunked)


def expected(seq_id: str, prompt_len: int, max_tokens: int, eos_every=0, ignore_eos=True):
    out = []
    for i in range(max_tokens):
        t = tok(seq_id, prompt_len + i, eos_every)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


# -- block manager ------------------------------------------------------------------------

def test_block_manager_grow_and_free():
    bm = BlockManager(4, 16)
    a, b = make("a", 1, 1), make("b", 1, 1)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(16) == 1 and bm.blocks_for(17) == 2
    bm.allocate(a, 17)
    assert len(a.block_table) == 2 and bm.num_used_blocks == 2 and bm.num_free_blocks == 2
    bm.allocate(a, 32)                     # still fits in two blocks
    assert len(a.block_table) == 2
    assert bm.can_allocate(b, 32) and not bm.can_allocate(b, 33)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 33)
    table = a.block_table
    assert bm.free(a) == 2 and a.block_table == [] and table == [0, 1]  # old list untouched
    assert bm.num_used_blocks == 0 and bm.num_total_blocks == 4 and bm.usage == 0.0


# -- sequence -----------------------------------------------------------------------------

def test_sequence_from_request_and_helpers():
    req = Request(id="r1", api="api-0", prompt=encode("hi"), arrival=3.0, batch="b1",
                  batch_counts=[1, 2], params=SamplingParams(max_tokens=5, stop=["x"]),
                  generated=[ord("y")])
    s = Sequence.from_request(req, dispatcher="sched-0", dispatch_seq=9)
    assert (s.id, s.api, s.batch, s.batch_counts, s.dispatcher, s.dispatch_seq) == \
        ("r1", "api-0", "b1", [1, 2], "sched-0", 9)
    assert s.all_tokens == encode("hiy") and s.num_tokens == 3 and s.remaining_output == 4
    assert s.streamed == 1 and s.status is SeqStatus.WAITING and s.stop_checker
    assert s.token_slice(1, 3) == encode("iy") and s.last_token == ord("y")
    s.generated.append(1)
    assert req.generated == [ord("y")]     # no aliasing with the request


# -- budget, chunking, ordering -----------------------------------------------------------

def test_chunked_prefill_of_a_long_prompt_over_several_steps():
    s = sched(budget=16)
    s.add(make("long", 50, 3))
    sizes = []
    while True:
        plan = s.schedule()
        check_invariants(s, plan)
        sizes.append(plan.prefill_tokens)
        sampled = {c.seq_id: 1 for c in plan.chunks if c.sample}
        outs = s.postprocess(plan, sampled, 0.0)
        if outs:
            break
    assert sizes == [16, 16, 16, 2]
    assert s.get("long").num_computed_tokens == 50 and s.get("long").generated == [1]


def test_decodes_first_then_prefill_within_budget():
    s = sched(budget=10, max_seqs=4)
    for i in range(3):
        s.add(make(f"d{i}", 2, 100))
    plan = s.schedule()
    s.postprocess(plan, {c.seq_id: 1 for c in plan.chunks if c.sample}, 0.0)
    s.add(make("big", 40, 2))
    for _ in range(5):
        plan = s.schedule()
        check_invariants(s, plan)
        kinds = [c.seq_id for c in plan.chunks]
        assert kinds[:3] == ["d0", "d1", "d2"]           # decodes lead every step
        assert plan.decode_tokens == 3 and plan.prefill_tokens == 7
        s.postprocess(plan, {c.seq_id: 1 for c in plan.chunks if c.sample}, 0.0)


def test_max_num_seqs_and_fcfs():
    s = sched(budget=1000, max_seqs=3)
    plans: list[StepPlan] = []
    emitted, finish = drive(s, {0: [make(f"s{i}", 4, 2) for i in range(6)]}, plans=plans)
    assert all(len(p.chunks) <= 3 for p in plans)
    first = [c.seq_id for c in plans[0].chunks]
    assert first == ["s0", "s1", "s2"] and s.num_running == 0


def test_budget_must_cover_max_num_seqs():
    with pytest.raises(ValueError):
        sched(budget=4, max_seqs=8)


def test_without_chunked_prefill_whole_prompts_only():
    s = sched(budget=32, chunked=False)
    s.add(make("a", 20, 4))
    s.add(make("b", 20, 4))
    plan = s.schedule()
    assert [c.num_tokens for c in plan.chunks] == [20]   # b waits: it does not fit whole
    out = s.add(make("huge", 40, 4))
    assert out is not None and out.finish_reason == "error" and "budget" in out.seq.error


# -- KV exhaustion and preemption ----------------------------------------------------------

def test_preemption_under_kv_exhaustion_matches_fault_free_run():
    specs = [(f"q{i}", 3 + (i * 7) % 13, 8 + (i * 5) % 20) for i in range(12)]

    def seqs():
        return {i % 4: [] for i in range(4)} | {
            0: [make(n, p, m) for n, p, m in specs[:6]],
            3: [make(n, p, m) for n, p, m in specs[6:]]}

    ref, ref_f = drive(sched(num_blocks=10_000, block_size=4, budget=64, max_seqs=8), seqs())
    tiny = sched(num_blocks=14, block_size=4, budget=64, max_seqs=8)
    got, got_f = drive(tiny, seqs())
    assert tiny.num_preemptions > 0
    assert got == ref and got_f == ref_f
    for n, p, m in specs:
        assert ref[n] == expected(n, p, m) and ref_f[n] == "length"


def test_resumed_sequences_continue_without_duplicates():
    full = {n: expected(n, 5, 30) for n in ("r0", "r1", "r2", "r3")}
    arr = {0: [make("r0", 5, 30, generated=full["r0"][:10]),
               make("r1", 5, 30, generated=full["r1"][:5]),
               make("r2", 5, 30)],
           2: [make("r3", 5, 30, generated=full["r3"][:29])]}   # one token left
    s = sched(num_blocks=12, block_size=4, budget=16, max_seqs=4)
    got, fin = drive(s, arr)
    assert got == full and set(fin.values()) == {"length"}
    assert s.num_preemptions > 0


def test_preempted_sequence_keeps_streamed_and_reprefills_everything():
    s = sched(num_blocks=4, block_size=4, budget=32, max_seqs=4)
    a, b = make("a", 4, 8), make("b", 4, 8)
    plans: list[StepPlan] = []
    drive(s, {0: [a, b]}, plans=plans)
    pre = [p for p in plans if p.preempted]
    assert pre and pre[0].preempted == ["b"]           # the newest goes
    assert b.num_preemptions >= 1
    # b's re-prefill covers prompt + its generated tokens in one chunk
    i = plans.index(pre[0])
    re = next(c for p in plans[i + 1:] for c in p.chunks if c.seq_id == "b")
    assert re.start_pos == 0 and re.num_tokens > 4 and re.sample


def test_rejects_what_can_never_fit():
    s = sched(num_blocks=4, block_size=4, max_len=100)
    out = s.add(make("kv", 10, 7))                      # 17 tokens > 16 of KV
    assert out.finish_reason == "error" and "KV cache" in out.seq.error
    out = s.add(make("ctx", 10, 95))
    assert out.finish_reason == "error" and "context length" in out.seq.error
    out = s.add(make("empty", 0, 3))
    assert out.finish_reason == "error" and "empty" in out.seq.error
    out = s.add(make("done", 2, 3, generated=[1, 2, 3]))
    assert out.finish_reason == "length" and out.new_tokens == []
    assert not s.has_work() and s.add(make("ok", 10, 6)) is None


def test_duplicate_add_is_a_noop():
    s = sched()
    a = make("a", 3, 2)
    assert s.add(a) is None and s.add(make("a", 3, 2)) is None
    assert s.num_waiting == 1 and s.get("a") is a


# -- aborts, finishing, accounting ---------------------------------------------------------

def test_abort_frees_blocks_in_every_state():
    s = sched(num_blocks=100, block_size=4, budget=8)
    for n in ("w", "p", "d"):
        s.add(make(n, 20 if n == "p" else 3, 50))
    plan = s.schedule()                                  # w: 3, p: 5 of 20; d waits
    s.postprocess(plan, {c.seq_id: 1 for c in plan.chunks if c.sample}, 0.0)
    assert s.kv_used > 0 and s.get("d").status is SeqStatus.WAITING
    plan = s.schedule()
    assert s.abort("w").finish_reason == "abort"         # aborted between schedule and post
    s.postprocess(plan, {c.seq_id: 1 for c in plan.chunks if c.sample}, 0.0)
    assert s.abort("p") is not None and s.abort("d") is not None
    assert s.abort("nope") is None
    assert s.kv_used == 0 and not s.has_work() and len(s) == 0


def test_finish_reasons_eos_stop_length():
    s = sched()
    arr = {0: [make("eos", 2, 50, ignore_eos=False), make("ign", 2, 5, ignore_eos=True),
               make("len", 2, 4), make("stop", 2, 50, stop=["ca"])]}
    emitted, fin = drive(s, arr, eos_every=3)
    assert fin == {"eos": "stop", "ign": "length", "len": "length", "stop": "stop"}
    assert emitted["eos"] == expected("eos", 2, 50, eos_every=3, ignore_eos=False)
    assert emitted["eos"][-1] == EOS
    assert len(emitted["ign"]) == 5 and len(emitted["len"]) == 4
    stop_text = bytes(t for t in emitted["stop"] if t < 256)
    assert stop_text.endswith(b"ca") and b"ca" not in stop_text[:-1]   # emits the completing token
    assert fin["stop"] == "stop"


def test_stop_string_spanning_resume_point():
    full = expected("z", 3, 40)
    text = bytes(full)
    j = next(k for k in range(2, 40) if text[k - 2:k] not in text[:k - 1])  # first 2-gram
    stop = text[j - 2:j].decode()
    s = sched()
    got, fin = drive(s, {0: [make("z", 3, 40, stop=[stop], generated=full[:j - 1])]})
    assert fin["z"] == "stop" and got["z"] == full[:j]


def test_staggered_gate_holds_prefill_not_decodes():
    s = sched(budget=64)
    s.add(make("run", 2, 20))
    s.postprocess(p := s.schedule(), {c.seq_id: 1 for c in p.chunks if c.sample}, 0.0)
    s.add(make("held", 4, 3))
    s.add(make("free", 4, 3))
    open_ = False
    gate = lambda q: open_ or q.id != "held"   # noqa: E731
    plan = s.schedule(gate)
    assert [c.seq_id for c in plan.chunks] == ["run", "free"] and plan.held == 1
    assert s.get("held").held and s.get("held").status is SeqStatus.WAITING
    s.postprocess(plan, {c.seq_id: 1 for c in plan.chunks if c.sample}, 0.0)
    plan = s.schedule(gate)
    assert "held" not in [c.seq_id for c in plan.chunks] and plan.decode_tokens == 2
    s.postprocess(plan, {c.seq_id: 1 for c in plan.chunks if c.sample}, 0.0)
    open_ = True
    plan = s.schedule(gate)
    assert "held" in [c.seq_id for c in plan.chunks] and not s.get("held").held


def test_outstanding_tokens():
    s = sched(budget=8)
    s.add(make("a", 20, 5))
    s.add(make("b", 3, 2, generated=[1]))
    assert s.outstanding_tokens() == (20 + 5) + (4 + 1)
    plan = s.schedule()                                  # a: 8 of 20
    s.postprocess(plan, {}, 0.0)
    assert s.outstanding_tokens() == (12 + 5) + (4 + 1)
    assert s.num_running == 1 and s.num_waiting == 1 and s.kv_total == 1000


# -- property: random workloads on a tiny pool equal the fault-free run ---------------------

workload = st.lists(
    st.tuples(st.integers(0, 8),           # arrival step
              st.integers(1, 20),          # prompt length
              st.integers(1, 40),          # max_tokens
              st.integers(0, 39),          # tokens already generated (resume), capped below
              st.booleans(),               # ignore_eos
              st.sampled_from([(), ("ab",), ("cd", "bb"), ("dab",)])),
    min_size=2, max_size=16)


@settings(max_examples=80, deadline=None)
@given(work=workload, pool_tokens=st.integers(40, 100), block_size=st.sampled_from([1, 4, 8]),
       budget=st.integers(8, 48), max_seqs=st.integers(1, 10), chunked=st.booleans(),
       abort=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 60)), max_size=3))
def test_random_workloads_match_fault_free_run(work, pool_tokens, block_size, budget,
                                               max_seqs, chunked, abort):
    max_seqs = min(max_seqs, budget)
    num_blocks = pool_tokens // block_size

    def build():
        arr: dict[int, list[Sequence]] = {}
        for i, (at, p, mt, g, ign, stop) in enumerate(work):
            n = f"s{i}"
            ref = expected(n, p, mt, eos_every=9, ignore_eos=ign)
            g = min(g, len(ref) - 1, mt - 1)
            pre = ref[:max(g, 0)]
            arr.setdefault(at, []).append(
                make(n, p, mt, stop=stop, ignore_eos=ign, generated=pre))
        return arr

    big = EngineScheduler(BlockManager(100_000, block_size), 10_000, 64, 4096)
    ref, ref_f = drive(big, build(), eos_every=9)
    small = EngineScheduler(BlockManager(num_blocks, block_size), budget, max_seqs, 4096,
                            chunked_prefill=chunked)
    got, got_f = drive(small, build(), eos_every=9)
    event(f"preempted: {small.num_preemptions > 0}")
    event(f"rejected: {'error' in got_f.values()}")
    for n in ref:
        if got_f.get(n) == "error":                      # cannot fit this rank at all
            assert ref_f[n] != "error"
            continue
        assert got[n] == ref[n] and got_f[n] == ref_f[n], n

    # with aborts: everything still drains and the pool is whole again
    aborts: dict[int, list[str]] = {}
    for i, at in abort:
        aborts.setdefault(at, []).append(f"s{i}")
    s3 = EngineScheduler(BlockManager(num_blocks, block_size), budget, max_seqs, 4096,
                         chunked_prefill=chunked)
    got3, fin3 = drive(s3, build(), eos_every=9, aborts=aborts)
    for n, toks in got3.items():
        assert ref[n][:len(toks)] == toks               # prefix of the fault-free output
    assert s3.kv_used == 0 and s3.bm.num_free_blocks == num_blocks


def _seeded_workload(seed: int):
    """A uniformly random workload sized to keep a tiny pool under pressure: every request
    fits the rank alone, many together do not. Returns (scheduler factory, arrivals)."""
    import random
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    pool = rng.randint(48, 96)
    budget = rng.randint(8, 64)
    max_seqs = rng.randint(2, min(budget, 12))
    chunked = rng.random() < 0.8
    if not chunked:
        budget = max(budget, 48)
    specs = []
    for i in range(rng.randint(6, 20)):
        p, mt = rng.randint(1, 24), rng.randint(1, 24)
        ign = rng.random() < 0.5
        ref = expected(f"s{i}", p, mt, eos_every=9, ignore_eos=ign)
        g = rng.randint(0, len(ref) - 1) if rng.random() < 0.3 else 0
        stop = rng.choice([(), ("ab",), ("cd", "bb")])
        specs.append((rng.randint(0, 6), f"s{i}", p, mt, ign, ref[:g], stop))

    def arrivals():
        arr: dict[int, list[Sequence]] = {}
        for at, n, p, mt, ign, pre, stop in specs:
            arr.setdefault(at, []).append(make(n, p, mt, ignore_eos=ign, generated=pre, stop=stop))
        return arr

    def small():
        return EngineScheduler(BlockManager(pool // bs, bs), budget, max_seqs, 4096,
                               chunked_prefill=chunked)

    def big():
        return EngineScheduler(BlockManager(10_000, bs), 10_000, 64, 4096)

    return small, big, arrivals


def test_seeded_kv_pressure_matches_fault_free_run():
    preempting = 0
    for seed in range(60):
        small, big, arrivals = _seeded_workload(seed)
        ref, ref_f = drive(big(), arrivals(), eos_every=9)
        s = small()
        got, got_f = drive(s, arrivals(), eos_every=9)
        assert got == ref and got_f == ref_f, seed
        assert "error" not in got_f.values()
        preempting += s.num_preemptions > 0
    assert preempting >= 20, f"only {preempting} of 60 workloads preempted"


def test_postprocess_without_streaming_reports_only_first_tokens_and_finishes():
    """``stream=False`` (the simulator's runner) skips the Output of every decode that goes
    on; the finishing Output still carries every token since the sequence's last one."""
    s = sched(budget=64)
    s.add(make("a", 4, 5))
    seen = []
    for step in range(10):
        plan = s.schedule()
        sampled = {c.seq_id: 100 + step for c in plan.chunks if c.sample}
        seen.append([(o.pos, o.new_tokens, o.finish_reason)
                     for o in s.postprocess(plan, sampled, float(step), stream=False)])
        if not s.has_work():
            break
    assert seen == [[(0, [100], None)], [], [], [], [(1, [101, 102, 103, 104], "length")]]
