"""Issue #15: n > 1, best_of and batched prompts in /v1/completions (and n in chat), with
the right indexes, usage summed, streaming included; official openai SDK against a live
`--backend sim` cluster, whose text is an exact function of (prompt, seed) so every choice
is checked. Unit tests of the pure parts first."""

from __future__ import annotations

import pytest

from services.api_server.errors import ApiError
from services.api_server.gateway import RequestChannel
from services.api_server.multi import pick, plan, sub_params, usage
from services.api_server.protocol import chat_template, parse
from services.engine_worker.sim_backend import SimTokenStream
from shared.tokenizer import EOS, encode
from tests.helpers import sim_expected_text
from tests.test_api_logprobs import _sim_token_lp

MODEL = "lockstep-moe"


def _parse(body: dict, kind: str = "completion"):
    return parse({"model": "m", **body}, kind, served_model="m", max_model_len=128, num_ranks=1)


def test_parse_batch_n_best_of():
    p = _parse({"prompt": ["ab", [104, 105], "xyz"], "n": 2, "seed": 5})
    assert p.multi and p.n == 2 and p.best_of == 2
    assert p.prompts == [(encode("ab"), "ab"), ([104, 105], "hi"), (encode("xyz"), "xyz")]
    assert not _parse({"prompt": ["one"]}).multi                     # a batch of one is one prompt
    b = _parse({"prompt": "x", "best_of": 3})
    assert b.best_of == 3 and b.n == 1 and b.best_of_lp and b.params.logprobs == 0
    assert not _parse({"prompt": "x", "best_of": 3, "logprobs": 2}).best_of_lp
    subs = plan(p, "r")
    assert [(s.prompt_no, s.j) for s in subs] == [(i, j) for i in range(3) for j in range(2)]
    assert [sub_params(p, s.j).seed for s in subs[:2]] == [5, 6] and p.params.seed == 5


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": ["a"] * 65, "n": 2}, "n"),
    ({"prompt": ["a", ""]}, "prompt"), ({"prompt": ["a", [300]]}, "prompt"),
])
def test_parse_refuses(body, param):
    with pytest.raises(ApiError) as err:
        _parse(body)
    assert err.value.body()["error"]["param"] == param


def test_pick_ranks_best_of_and_usage_sums():
    p = _parse({"prompt": ["ab", "cde"], "n": 1, "best_of": 2})
    subs = plan(p, "r")
    for s, lps, n in zip(subs, ([-3.0], [-1.0, -0.5], [-0.1], [-0.2]), (1, 2, 1, 1)):
        s.ch = RequestChannel(s.rid)
        s.ch.tokens, s.ch.logprobs, s.ch.prompt_tokens = [1] * n, [[v, []] for v in lps], len(s.prompt)
    chosen = pick(p, subs)
    assert [(i, s.j, s.prompt_no) for i, s in chosen] == [(0, 1, 0), (1, 0, 1)]
    assert usage(p, chosen, subs) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


# --- live, sim backend ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(sim_cluster):
    import openai

    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


PROMPTS = ["first prompt", "the second", "3rd"]


@pytest.mark.slow
def test_batched_prompts_with_n(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=7, seed=10,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    for c in r.choices:
        i, j = divmod(c.index, 2)
        assert c.text == sim_expected_text(encode(PROMPTS[i]), 7, seed=10 + j), c.index
    assert r.usage.prompt_tokens == sum(len(encode(x)) for x in PROMPTS)
    assert r.usage.completion_tokens == 6 * 7 and r.usage.total_tokens == r.usage.prompt_tokens + 42
    # token-list prompts (lm-eval batches them), echo + logprobs: every choice its own prompt
    toks = [encode(x) for x in PROMPTS]
    e = client.completions.create(model=MODEL, prompt=toks, max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in sorted(e.choices, key=lambda c: c.index)] == PROMPTS
    assert all(len(c.logprobs.token_logprobs) == len(toks[c.index]) for c in e.choices)
    assert e.usage.completion_tokens == 0


@pytest.mark.slow
def test_batched_prompts_streamed(client):
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage_seen = None
    for ck in client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=9, seed=3, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if ck.usage is not None:
            usage_seen = ck.usage
        for c in ck.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2, 3] and finish == {i: "length" for i in range(4)}
    for idx, text in texts.items():
        i, j = divmod(idx, 2)
        assert text == sim_expected_text(encode(PROMPTS[i]), 9, seed=3 + j)
    assert usage_seen.completion_tokens == 36
    assert usage_seen.prompt_tokens == len(encode(PROMPTS[0])) + len(encode(PROMPTS[1]))


@pytest.mark.slow
def test_best_of_returns_the_most_likely_candidate(client):
    prompt = encode("best of")
    r = client.completions.create(model=MODEL, prompt="best of", max_tokens=6, seed=20, best_of=4, n=2,
                                  extra_body={"ignore_eos": True})

    def score(seed: int) -> float:
        stream = SimTokenStream(seed, prompt)
        toks = [t if t != EOS else ord(" ") for t in (stream.token_at(i) for i in range(6))]
        return sum(_sim_token_lp(prompt, i, 0, t)[0] for i, t in enumerate(toks))

    ranked = sorted(range(4), key=lambda j: -score(20 + j))[:2]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [sim_expected_text(prompt, 6, seed=20 + j) for j in ranked]
    assert all(c.logprobs is None for c in r.choices)                # not asked: not shown
    assert r.usage.completion_tokens == 12                              # the returned choices


@pytest.mark.slow
def test_chat_n(client):
    msgs = [{"role": "user", "content": "two answers"}]
    prompt = encode(chat_template(msgs))
    r = client.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=5, seed=1,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [sim_expected_text(prompt, 5, seed=1 + j) for j in range(3)]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 15
    texts: dict[int, str] = {}
    roles = set()
    for ck in client.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=5, seed=1, stream=True,
                                             extra_body={"ignore_eos": True}):
        for c in ck.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0, 1, 2} and [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
