"""Issue #15: logit_bias, min_tokens, stop_token_ids, ignore_eos and seed take effect in the
engine (torch sampler + the stop decision), and logprobs come from the logits that sampled."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine_worker.batch import ChunkInput
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.model import MoEConfig, TorchModelRunner
from services.engine_worker.model.sampler import RowExtra, logprobs, sample
from services.engine_worker.sequence import Sequence
from services.engine_worker.sim_backend import SimBackend, eos_from, sim_logprobs
from services.engine_worker.step_logprobs import StepLogprobs
from shared.messages import Delta, SamplingParams
from shared.stop import TextStopper
from shared.tokenizer import EOS, token_text


def token_id(name: str) -> int:
    """The id of a logprobs token name (shared/tokenizer.py token_text)."""
    return next(t for t in range(260) if token_text(t) == name)

V = 16


def test_logit_bias_moves_greedy_and_sampled_picks():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    greedy = int(logits.argmax())
    other = (greedy + 3) % V
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(logit_bias={other: 100.0})]) == [other]
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(logit_bias={greedy: -100.0})]) != [greedy]
    for pos in range(30):   # +100 wins every draw at temperature 1
        assert sample(logits, [1.0], [1.0], [5], [pos], [RowExtra(logit_bias={other: 100.0})]) == [other]


def test_suppressed_tokens_are_never_drawn():
    logits = torch.zeros(1, V)
    logits[0, 2] = 50.0
    for pos in range(40):
        got = sample(logits, [2.0], [1.0], [3], [pos], [RowExtra(suppress=[2, 5])])[0]
        assert got not in (2, 5)
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(suppress=[2])]) != [2]


def test_logprobs_match_log_softmax_and_are_sorted():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    toks = [0, 5, 9]
    got = logprobs(logits, toks, [3, 0, 1])
    ref = torch.log_softmax(logits, -1)
    for r, (lp, top, rank) in enumerate(got):
        assert math.isclose(lp, float(ref[r, toks[r]]), rel_tol=1e-5)
        assert rank == 1 + int((ref[r] > ref[r, toks[r]]).sum())
        assert len(top) == [3, 0, 1][r]
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        if top:
            assert top[0][0] == int(ref[r].argmax())


def _core(max_tokens: int = 64) -> EngineScheduler:
    return EngineScheduler(BlockManager(64, 16), 256, 8, 512)


def _drive(core: EngineScheduler, seq: Sequence, stream: list[int]) -> tuple[list[int], str | None]:
    """Feed ``stream`` as the sampled tokens, step by step, until the sequence finishes."""
    core.add(seq, 0.0)
    out: list[int] = []
    for tok in stream:
        plan = core.schedule()
        outs = core.postprocess(plan, {seq.id: tok}, 0.0)
        for o in outs:
            out.extend(o.new_tokens)
            if o.finish_reason:
                return out, o.finish_reason
    return out, None


def test_stop_token_ids_finish_with_stop():
    seq = Sequence("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    assert _drive(_core(), seq, [3, 4, 7, 8, 9]) == ([3, 4, 7], "stop")


def test_min_tokens_holds_eos_stop_ids_and_stop_strings_back():
    seq = Sequence("a", [1], SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[7]))
    assert _drive(_core(), seq, [EOS, 7, 3, 7, 8]) == ([EOS, 7, 3, 7], "stop")   # the 4th ends it
    seq = Sequence("b", [1], SamplingParams(max_tokens=10, min_tokens=3, stop=["x"]))
    assert _drive(_core(), seq, [ord("x"), 5, 5, ord("x")]) == ([ord("x"), 5, 5, ord("x")], "stop")
    seq = Sequence("c", [1], SamplingParams(max_tokens=3, min_tokens=3))
    assert _drive(_core(), seq, [EOS, EOS, 5]) == ([EOS, EOS, 5], "length")


def test_a_stop_string_counts_once_the_output_is_longer_than_min_tokens():
    # (one completed by token min_tokens ended the request, while the api-server kept its text:
    # "opx" for stop "x" at min_tokens 3; vLLM checks stop strings past min_tokens only)
    x, y = ord("x"), ord("y")
    seq = Sequence("a", [1], SamplingParams(max_tokens=10, min_tokens=3, stop=["x"]))
    assert _drive(_core(), seq, [5, 5, x, 5, x, 5]) == ([5, 5, x, 5, x], "stop")
    seq = Sequence("b", [1], SamplingParams(max_tokens=10, min_tokens=3, stop=["xy"]))   # begun within, ended after
    assert _drive(_core(), seq, [5, 5, x, y, 5]) == ([5, 5, x, y], "stop")


def test_the_api_servers_cut_follows_the_same_rule():
    st = TextStopper(["x"])
    st.count_from(3)                       # the text of the first min_tokens tokens
    assert st.feed("opx") + st.feed("mx") + st.feed("z") + st.finish() == "opxm" and st.stopped
    st = TextStopper(["xy"])
    st.count_from(3)
    assert st.feed("opx") + st.feed("yz") + st.finish() == "op" and st.matched == "xy"
    st = TextStopper(["aa"])
    st.count_from(2)
    assert st.feed("aaa") + st.finish() == "a"      # the first "aa" ends at the floor; the next counts


def test_ignore_eos_keeps_going():
    seq = Sequence("a", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    assert _drive(_core(), seq, [EOS, 4, EOS]) == ([EOS, 4, EOS], "length")
    seq = Sequence("b", [1], SamplingParams(max_tokens=3))
    assert _drive(_core(), seq, [4, EOS, 5]) == ([4, EOS], "stop")


def test_wire_round_trip_of_the_new_params():
    p = SamplingParams(logit_bias={65: 5.0, 3: -1.5}, min_tokens=2, stop_token_ids=[10, 256], logprobs=3,
                       prompt_logprobs=1)
    q = SamplingParams.from_dict(p.to_dict())
    assert (q.logit_bias, q.min_tokens, q.stop_token_ids, q.logprobs, q.prompt_logprobs) == \
        ({65: 5.0, 3: -1.5}, 2, [10, 256], 3, 1)
    assert set(SamplingParams().to_dict()) == {"mt", "te", "tp", "sd", "st", "ie"}
    d = Delta("x", 0, [1, 2], logprobs=[None, [-0.5, [[1, -0.5]]]], prompt_lp=[[-1.0, []]], prompt_lp_pos=2)
    e = Delta.from_dict(d.to_dict())
    assert (e.logprobs, e.prompt_lp, e.prompt_lp_pos) == (d.logprobs, d.prompt_lp, 2)
    assert "lp" not in Delta("x", 0, [1]).to_dict()


def test_sim_min_tokens_and_ignore_eos():
    sim = SimBackend()
    p_min = SamplingParams(min_tokens=5)
    assert eos_from(p_min) == 5 and eos_from(SamplingParams(ignore_eos=True)) == math.inf
    # find a prompt whose sim stream has EOS early, then check min_tokens hides it
    from services.engine_worker.sim_backend import SimTokenStream
    prompt = [1, 2]
    seed = next(s for s in range(20000) if EOS in [SimTokenStream(s, prompt).token_at(q) for q in range(4)])
    first = next(q for q in range(4) if SimTokenStream(seed, prompt).token_at(q) == EOS)
    ch = ChunkInput("s", [1], len(prompt) + first - 1, [0], True, seed=seed, prompt_len=len(prompt))
    assert sim.run([ch], {"s": prompt}, {"s": first + 1})["s"] == ord(" ")
    sim.free_seq("s")
    assert sim.run([ch], {"s": prompt}, {"s": 0})["s"] == EOS


def test_sim_unseeded_draws_differ_per_request_and_greedy_follows_the_prompt():
    # n=3 at temperature 1 without a seed gave three identical choices on a sim cluster
    prompt = list(b"hello there")

    def text(seq_id: str, temperature: float, seed: int | None = None) -> bytes:
        sim, out = SimBackend(), bytearray()
        for q in range(24):
            ch = ChunkInput(seq_id, [1], len(prompt) + q - 1, [0], True, temperature=temperature, seed=seed,
                            prompt_len=len(prompt))
            out.append(sim.run([ch], {seq_id: prompt}, {seq_id: math.inf})[seq_id] & 0xFF)
        return bytes(out)

    assert len({text(f"r-0-{j}", 1.0) for j in range(3)}) == 3
    assert text("r-0-1", 1.0) == text("r-0-1", 1.0)                  # the same sequence, on any rank
    assert text("a", 0.0) == text("b", 0.0)                          # greedy: the prompt's
    assert text("a", 1.0, seed=4) == text("b", 1.0, seed=4)          # seeded: the seed's


def test_sim_logprobs_are_plausible_and_deterministic():
    for h in range(50):
        lp, top, rank = sim_logprobs(h, 65, 5, top=65)
        assert top[0] == [65, lp] and len(top) == 5 and rank == 1
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True) and all(v < 0 for v in vals)
        assert sum(math.exp(v) for v in vals) <= 1.0
        assert sim_logprobs(h, 65, 5, top=65) == [lp, top, 1]
        other, _, other_rank = sim_logprobs(h, 66, 0, top=65)
        assert other < lp and other_rank > 1


def test_step_logprobs_ship_prompt_entries_once():
    s = StepLogprobs()
    s.track("a", SamplingParams(logprobs=1, prompt_logprobs=1), [1, 2, 3, 4])
    assert s.wants([ChunkInput("b", [1], 0, [0], True)]) is None
    assert set(s.wants([ChunkInput("a", [1], 0, [0], True)])) == {"a"}
    s.add({}, {"a": (1, [[-1.0, []], [-2.0, []]])})           # a first prefill chunk
    s.add({}, {"a": (1, [[-1.5, []]])})                        # preempted: recomputed from 1
    s.add({"a": [-0.1, []]}, {"a": (2, [[-2.5, []], [-3.0, []]])})
    d = Delta("a", 0, [9])
    s.fill(d)
    assert d.logprobs == [[-0.1, []]] and d.prompt_lp_pos == 1
    assert d.prompt_lp == [[-1.5, []], [-2.5, []], [-3.0, []]]
    d2 = Delta("a", 1, [8])
    s.fill(d2)
    assert d2.prompt_lp is None and d2.logprobs == [None]
    s.forget("a")
    assert s.wants([ChunkInput("a", [1], 0, [0], True)]) is None


def test_torch_runner_logprobs_come_from_the_sampling_logits():
    cfg = MoEConfig(seed=0)
    runner = TorchModelRunner(cfg, 0, 1, num_kv_blocks=16, block_size=16)
    prompt = list(b"the lockstep")
    ref = TorchModelRunner(cfg, 0, 1, num_kv_blocks=16, block_size=16)
    full = ref.logits([ChunkInput("r", prompt, 0, [0], True)])["r"]
    # prefill in two chunks: prompt logprobs cover positions 1.. across both
    a = ChunkInput("s", prompt[:5], 0, [0], False)
    b = ChunkInput("s", prompt[5:], 5, [0], True, temperature=0.0)
    want = {"s": (2, 3, prompt)}
    t1, l1, p1 = runner.run_logprobs([a], None, want)
    t2, l2, p2 = runner.run_logprobs([b], None, want)
    assert t1 == {} and l1 == {}
    assert p1["s"][0] == 1 and len(p1["s"][1]) == 5 and p2["s"][0] == 6 and len(p2["s"][1]) == len(prompt) - 6
    tok = t2["s"]
    assert tok == int(full.argmax())
    lp, top, rank = l2["s"]
    assert math.isclose(lp, float(torch.log_softmax(full, -1)[tok]), rel_tol=1e-4, abs_tol=1e-5)
    assert top[0][0] == tok and len(top) == 2
    for e in p1["s"][1] + p2["s"][1]:
        assert len(e[1]) == 3 and e[0] <= e[1][0][1] + 1e-6


@pytest.mark.slow
def test_live_torch_cluster_controls(tmp_path):
    """End to end on `--backend torch` with the official SDK: logit_bias forces a token,
    EOS ends a request unless ignore_eos, stop_token_ids end it, min_tokens holds them back,
    a seed reproduces a sampled text, and logprobs come with the tokens (echo too)."""
    import openai

    from tests.conftest import start_cluster

    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "torch", "--spares", "0",
                            namespace="ctl")
    try:
        c = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="lockstep-moe", prompt="the lockstep scheduler", max_tokens=8)
        r = c.completions.create(temperature=0.0, logit_bias={"65": 100}, extra_body={"ignore_eos": True}, **kw)
        assert r.choices[0].text == "A" * 8
        r = c.completions.create(temperature=0.9, seed=3, logit_bias={str(EOS): 100}, **kw)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1       # EOS, at once
        r = c.completions.create(temperature=0.9, seed=3, logit_bias={str(EOS): 100}, extra_body={"ignore_eos": True},
                                 **kw)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        r = c.completions.create(temperature=0.0, logit_bias={str(EOS): 100}, extra_body={"min_tokens": 5}, **kw)
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"   # EOS masked until then

        # the generated token ids, from logprobs' names (the text may hold a broken character)
        ids = lambda r: [token_id(t) for t in r.choices[0].logprobs.tokens]  # noqa: E731
        greedy = ids(c.completions.create(temperature=0.0, logprobs=0, extra_body={"ignore_eos": True}, **kw))
        tok = greedy[1]
        cut = greedy.index(tok)
        r = c.completions.create(temperature=0.0, logprobs=0, extra_body={"ignore_eos": True, "stop_token_ids": [tok]},
                                 **kw)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut + 1
        assert ids(r) == greedy[:cut + 1]
        r = c.completions.create(temperature=0.0, logprobs=0, extra_body={"ignore_eos": True, "stop_token_ids": [tok],
                                                                          "min_tokens": 8}, **kw)
        assert r.usage.completion_tokens == 8 and tok not in ids(r)         # masked, never drawn

        sampled = [c.completions.create(temperature=1.0, seed=s, extra_body={"ignore_eos": True}, **kw).choices[0].text
                   for s in (7, 7, 8, 9)]
        assert sampled[0] == sampled[1] and len(set(sampled)) > 1

        r = c.completions.create(temperature=0.0, logprobs=3, extra_body={"ignore_eos": True}, **kw)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == 8
        for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert v <= 0 and max(top, key=top.get) == t and top[t] == pytest.approx(v)   # greedy: on top
        r = c.completions.create(temperature=0.0, logprobs=1, echo=True, **{**kw, "max_tokens": 0})
        lp = r.choices[0].logprobs
        assert r.choices[0].text == kw["prompt"] and r.usage.completion_tokens == 0
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(kw["prompt"])
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        c.close()
    finally:
        cluster.stop()
