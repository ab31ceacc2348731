"""Issue #15: logprobs / top_logprobs (streaming too), echo with prompt logprobs (lm-eval's
loglikelihood), logit_bias, min_tokens, stop_token_ids, on a live `--backend sim` cluster
with the official openai SDK; the sim's logprobs are exact functions of (prompt, position)
(services/engine_worker/sim_backend.py), so every number is checked. Unit tests of the pure
parts first."""

from __future__ import annotations

import math

import openai
import pytest

from services.api_server.errors import ApiError
from services.api_server.gateway import RequestChannel
from services.api_server.logprobs import CompletionLogprobs, chat_logprobs, join
from services.api_server.protocol import chat_template, parse
from services.engine_worker.sim_backend import SimTokenStream, _mix, _prompt_key, sim_logprobs
from shared.messages import Delta
from shared.tokenizer import EOS, encode, token_text
from tests.helpers import sim_expected_text

MODEL = "lockstep-moe"


def _parse(body: dict, kind: str = "completion"):
    return parse({"model": "m", **body}, kind, served_model="m", max_model_len=128, num_ranks=1)


# --- pure parts ------------------------------------------------------------------------------

def test_parse_new_params():
    p = _parse({"prompt": "ab", "logprobs": 3, "echo": True, "max_tokens": 0, "logit_bias": {"65": 5, "66": 0},
                "min_tokens": 1, "stop_token_ids": [10, 10, 256]})
    assert p.logprobs == 3 and p.params.logprobs == 3 and p.params.prompt_logprobs == 3
    assert p.drop_output and p.params.max_tokens == 1
    assert p.params.logit_bias == {65: 5.0} and p.params.min_tokens == 1 and p.params.stop_token_ids == [10, 256]
    c = _parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, "chat")
    assert c.logprobs == 2 and c.params.prompt_logprobs is None
    assert _parse({"messages": [{"role": "user", "content": "x"}], "logprobs": False}, "chat").logprobs is None
    assert _parse({"prompt": "ab", "logprobs": 0}).params.prompt_logprobs is None   # no echo: no prompt ones


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),                 # 0 only with echo
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"65": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [260]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": "10"}, "stop_token_ids"),
])
def test_parse_refuses_bad_values_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        _parse(body)
    assert err.value.status == 400 and err.value.body()["error"]["param"] == param


def test_chat_top_logprobs_needs_logprobs():
    with pytest.raises(ApiError) as err:
        _parse({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "chat")
    assert err.value.body()["error"]["param"] == "top_logprobs"


def test_completion_logprobs_shape():
    cl = CompletionLogprobs(1)
    e = [[-0.5, [[ord("a"), -0.5]]], [-2.0, [[ord("z"), -0.1]]], None]
    toks = [ord("a"), 0xC3, 0xA9]                     # "a" then "é" (two bytes, one character)
    prompt = cl.part([ord("p"), ord("q")], [None, [-1.0, [[ord("q"), -1.0]]]], first_is_none=True)
    out = join([prompt, cl.part(toks, e)])
    assert out["tokens"] == ["p", "q", "a", "bytes:\\xc3", "bytes:\\xa9"]
    assert out["token_logprobs"] == [None, -1.0, -0.5, -2.0, None]
    assert out["top_logprobs"][0] is None and out["top_logprobs"][2] == {"a": -0.5}
    assert out["top_logprobs"][3] == {"z": -0.1, "bytes:\\xc3": -2.0}     # the sampled token joins the top
    assert out["text_offset"] == [0, 1, 2, 3, 4]                           # é's 2nd byte starts no character
    ch = chat_logprobs([ord("a"), EOS], [[-0.5, [[ord("a"), -0.5], [ord("b"), -1.0]]], [-float("inf"), []]], 1)
    assert ch["content"][0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                                "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}
    assert ch["content"][1]["logprob"] == -9999.0 and ch["content"][1]["bytes"] is None


def test_channel_keeps_logprobs_aligned_and_prompt_entries_once():
    ch = RequestChannel("r")
    ch.feed(Delta("r", 0, [1], logprobs=[[-1.0, []]], prompt_lp=[[-2.0, []], [-3.0, []]], prompt_lp_pos=1), 0.0)
    ch.feed(Delta("r", 0, [1, 2], logprobs=[[-1.0, []], [-4.0, []]]), 0.0)   # a redelivery overlaps
    ch.feed(Delta("r", 2, [3], prompt_lp=[[-3.5, []], [-9.0, []]], prompt_lp_pos=2), 0.0)   # a recompute
    assert ch.tokens == [1, 2, 3]
    assert ch.logprobs == [[-1.0, []], [-4.0, []], None]
    assert ch.prompt_lp == [[-2.0, []], [-3.0, []], [-9.0, []]]


def test_token_text_names_are_distinct():
    names = [token_text(t) for t in range(260)]
    assert len(set(names)) == 260


# --- live, sim backend ----------------------------------------------------------------------

def _sim_token_lp(prompt: list[int], i: int, k: int, tok: int) -> list:
    """The sim's entry for the i-th generated token (its sample chunk ends at prompt + i)."""
    return sim_logprobs(_mix(_prompt_key(prompt), len(prompt) + i), tok, k, top=tok)


def _sim_prompt_lp(prompt: list[int], q: int, k: int) -> list:
    return sim_logprobs(_mix(_prompt_key(prompt), q), prompt[q], k)


@pytest.fixture(scope="module")
def client(sim_cluster):
    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.mark.slow
def test_completion_logprobs_exact(client):
    prompt = encode("logprobs please")
    r = client.completions.create(model=MODEL, prompt="logprobs please", max_tokens=10, seed=3, logprobs=2,
                                  extra_body={"ignore_eos": True})
    ch = r.choices[0]
    text = sim_expected_text(prompt, 10, seed=3)
    assert ch.text == text
    lp = ch.logprobs
    toks = list(text.encode())
    assert lp.tokens == [token_text(t) for t in toks] and r.usage.completion_tokens == len(toks)
    for i, t in enumerate(toks):
        want, top, _ = _sim_token_lp(prompt, i, 2, t)
        assert math.isclose(lp.token_logprobs[i], want, rel_tol=1e-9)
        assert lp.top_logprobs[i] == {token_text(a): pytest.approx(v) for a, v in top}
    # the seed changes the text but not the sim's logprob rule: the top token is the sampled one
    assert all(max(d, key=d.get) == tk for d, tk in zip(lp.top_logprobs, lp.tokens))


@pytest.mark.slow
def test_echo_loglikelihood_as_lm_eval_asks(client):
    """lm-eval: echo, logprobs=1, max_tokens=1 (and 0); it reads token_logprobs[ctxlen:-1]."""
    text = "The capital of France is Paris"
    prompt = encode(text)
    for max_tokens in (1, 0):
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, echo=True, logprobs=1,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        ch = r.choices[0]
        n_out = max_tokens
        assert ch.text.startswith(text) and (max_tokens or ch.text == text)
        lp = ch.logprobs
        assert len(lp.tokens) == len(prompt) + n_out
        assert len(lp.token_logprobs) == len(prompt) + n_out and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        for q in range(1, len(prompt)):
            want, top, _ = _sim_prompt_lp(prompt, q, 1)
            assert math.isclose(lp.token_logprobs[q], want, rel_tol=1e-9)
            assert lp.top_logprobs[q][token_text(top[0][0])] == pytest.approx(top[0][1])
            assert token_text(prompt[q]) in lp.top_logprobs[q]
        assert lp.text_offset[:len(prompt)] == list(range(len(prompt)))
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == n_out
        # token ids as the prompt (lm-eval sends token lists) give the same numbers
        r2 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1,
                                       temperature=0.0, extra_body={"ignore_eos": True})
        assert r2.choices[0].logprobs.token_logprobs == lp.token_logprobs


@pytest.mark.slow
def test_streamed_logprobs_equal_the_whole_response(client):
    kw = dict(model=MODEL, prompt="stream me", max_tokens=12, seed=8, logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    toks, lps = [], []
    for c in client.completions.create(stream=True, **kw):
        if c.choices and c.choices[0].logprobs is not None:
            toks += c.choices[0].logprobs.tokens
            lps += c.choices[0].logprobs.token_logprobs
    assert toks == whole.tokens and lps == whole.token_logprobs
    # echo + logprobs streamed: the prompt's come first, with the prompt text
    chunks = list(client.completions.create(stream=True, echo=True, **{**kw, "max_tokens": 3}))
    first = chunks[0].choices[0]
    assert first.text == "stream me" and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len("stream me")


@pytest.mark.slow
def test_chat_logprobs_and_top_logprobs(client):
    msgs = [{"role": "user", "content": "hi"}]
    prompt = encode(chat_template(msgs))
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, seed=1, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    toks = list(r.choices[0].message.content.encode())
    assert [c.bytes for c in content] == [[t] for t in toks]
    for i, (c, t) in enumerate(zip(content, toks)):
        want, top, _ = _sim_token_lp(prompt, i, 3, t)
        assert c.logprob == pytest.approx(want) and len(c.top_logprobs) == 3
        assert [(x.token, x.logprob) for x in c.top_logprobs] == [(token_text(a), pytest.approx(v)) for a, v in top]
    streamed = []
    for ck in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, seed=1, logprobs=True,
                                             stream=True, extra_body={"ignore_eos": True}):
        if ck.choices and ck.choices[0].logprobs is not None:
            streamed += [(x.token, x.logprob, x.top_logprobs) for x in ck.choices[0].logprobs.content]
    assert [(t, lp) for t, lp, _ in streamed] == [(c.token, c.logprob) for c in content]
    assert all(top == [] for _, _, top in streamed)                    # top_logprobs 0: none
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.slow
def test_stop_token_ids_on_sim(client):
    prompt = encode("stop ids")
    text = sim_expected_text(prompt, 40, seed=2)
    raw = list(text.encode())
    stop_tok = next(t for t in raw[3:] if t < 128)
    cut = raw.index(stop_tok)
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="stop ids", max_tokens=40, seed=2,
                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_tok]})
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            r = client.completions.create(**kw)
            got, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert got.encode() == bytes(raw[:cut])          # the stop token's text is not shown ...
        assert finish == "stop" and usage.completion_tokens == cut + 1   # ... but it is counted


@pytest.mark.slow
def test_min_tokens_on_sim(client):
    """A seed whose sim text hits EOS early ends there; min_tokens carries it on."""
    prompt = encode("min")
    seed = next(s for s in range(20000) if EOS in [SimTokenStream(s, prompt).token_at(q) for q in range(6)])
    short = client.completions.create(model=MODEL, prompt="min", max_tokens=20, seed=seed)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens <= 6
    r = client.completions.create(model=MODEL, prompt="min", max_tokens=20, seed=seed, extra_body={"min_tokens": 12})
    assert r.usage.completion_tokens >= 12


@pytest.mark.slow
def test_logit_bias_accepted_and_checked(client):
    r = client.completions.create(model=MODEL, prompt="bias", max_tokens=4, logit_bias={"65": 50})
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="bias", max_tokens=4, logit_bias={"9999": 5})
    assert err.value.response.json()["error"]["param"] == "logit_bias"


@pytest.mark.slow
def test_min_tokens_defers_stop_strings(client):
    """A stop string inside the first min_tokens tokens neither ends the request nor cuts
    the text; its first completion after them does both."""
    prompt = encode("min stop")
    raw = sim_expected_text(prompt, 60, seed=4).encode()
    c = next(b for b in raw[1:20] if 97 <= b <= 122 and raw.count(b) >= 3)
    first = raw.index(c)
    m = next(i for i in range(first + 2, 50) if raw[i - 1] != c and c in raw[i:])
    j = raw.index(c, m)
    at = raw.index(c, first + 1)   # min_tokens = first + 1: the stop string is token min_tokens itself
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="min stop", max_tokens=60, seed=4, stop=[chr(c)],
                  extra_body={"ignore_eos": True})
        if stream:
            plain = "".join(x.choices[0].text for x in client.completions.create(stream=True, **kw) if x.choices)
            later = "".join(x.choices[0].text for x in client.completions.create(
                stream=True, **{**kw, "extra_body": {"ignore_eos": True, "min_tokens": m}}) if x.choices)
        else:
            plain = client.completions.create(**kw).choices[0].text
            later = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "min_tokens": m}}
                                             ).choices[0].text
        assert plain.encode() == raw[:first]
        assert later.encode() == raw[:j]
        # a stop string completed by token min_tokens does not count, on the engine or in the text
        # (the engine stopped there and the text kept it)
        kw["extra_body"] = {"ignore_eos": True, "min_tokens": first + 1}
        if stream:
            edge = "".join(x.choices[0].text for x in client.completions.create(stream=True, **kw) if x.choices)
        else:
            edge = client.completions.create(**kw).choices[0].text
        assert edge.encode() == raw[:at]


def test_many_and_long_stop_strings_are_served():
    """vLLM serves more than OpenAI's 4 stop strings and long ones; the bound is 64 x 1024 bytes."""
    stops = [f"stop{i}" for i in range(40)] + ["x" * 1000]
    assert _parse({"prompt": "x", "stop": stops}).params.stop == stops
    for bad in ([f"s{i}" for i in range(65)], ["y" * 1025], [""]):
        with pytest.raises(ApiError) as err:
            _parse({"prompt": "x", "stop": bad})
        assert err.value.body()["error"]["param"] == "stop"


def test_checkpoint_token_names(tmp_path):
    """Serving a checkpoint, logprobs name tokens by the checkpoint's tokenizer, not by bytes."""
    from services.api_server.logprobs import CheckpointNames
    from shared.hf_tokenizer import HFTokenizer
    from tests.hf_checkpoints import make_tokenizer

    make_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    ids = tok.encode("def add(a, b)", add_special_tokens=False)
    names = CheckpointNames(tok)
    cl = CompletionLogprobs(1, names=names)
    part = cl.part(ids, [[-1.0, [[ids[0], -0.5]]]] * len(ids))
    assert "".join(part["tokens"]) == "def add(a, b)"
    assert part["text_offset"][-1] + len(part["tokens"][-1]) == len("def add(a, b)")
    eos = tok.eos_token_ids[0]
    assert names.text(eos) == "<|im_end|>" and names.bytes(eos) is None
    ch = chat_logprobs(ids[:1], [[-1.0, [[ids[0], -1.0]]]], 1, names)
    assert ch["content"][0]["bytes"] == list(part["tokens"][0].encode())
    # a token that is part of one character: its own bytes (they were U+FFFD's, EF BF BD)
    for text in ("東京", "😀"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(bytes(names.bytes(t)) for t in ids) == text.encode()


@pytest.mark.slow
def test_vllm_prompt_logprobs(client):
    """vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}, the first None;
    on the choice for completions, on the response for chat; not streamable."""
    text = "prompt lp"
    prompt = encode(text)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    for q in range(1, len(prompt)):
        want, top, rank = _sim_prompt_lp(prompt, q, 2)
        got = plp[q]
        assert got[str(prompt[q])] == {"logprob": pytest.approx(want), "rank": rank,
                                       "decoded_token": token_text(prompt[q])}
        for r_, (i, v) in enumerate(top):
            assert got[str(i)]["rank"] == r_ + 1 and got[str(i)]["logprob"] == pytest.approx(v)
    msgs = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"prompt_logprobs": 0})
    plp = c.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(encode(chat_template(msgs)))
    assert all(len(d) == 1 for d in plp[1:])                 # k 0: the prompt token alone
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=text, stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.response.json()["error"]["param"] == "prompt_logprobs"
