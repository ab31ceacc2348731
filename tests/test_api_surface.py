"""Issue #15: the API people already use. vLLM's extra endpoints, and the parameter rule: a
parameter takes effect, or is refused with a 400 naming it; unknown fields are ignored and
logged (docs/api.md). Against a live `--backend sim` cluster, with the official openai SDK
where it has a method and httpx where it has none."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from services.api_server.bodies import CHAT_SCHEMA, COMPLETION_SCHEMA
from services.api_server.protocol import chat_template
from shared.tokenizer import encode
from tests.helpers import sim_expected_text

pytestmark = pytest.mark.slow
MODEL = "lockstep-moe"


@pytest.fixture(scope="module")
def client(sim_cluster):
    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def root(sim_cluster):
    return sim_cluster.api_url.rsplit("/v1", 1)[0]


# --- 1. endpoints --------------------------------------------------------------------------

def test_models_retrieve(client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by == "lockstep"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    body = err.value.response.json()["error"]
    assert body["code"] == "model_not_found" and "no-such-model" in body["message"]
    assert body["type"] == "invalid_request_error"   # OpenAI's, with the 404 and the code


def test_a_wrong_method_is_a_405_that_says_which_methods_it_takes(root):
    # (it had no Allow header, which HTTP requires, and no code)
    r = httpx.put(root + "/v1/chat/completions", json={}, timeout=10)
    assert r.status_code == 405 and r.headers.get("allow") == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_probes_answer_head_and_an_unknown_url_is_openais_error(root):
    # (HEAD was a 405: `wget --spider` health checks and some load balancers send HEAD)
    for path in ("/health", "/ready", "/ping", "/v1/models", "/version"):
        r = httpx.head(root + path, timeout=10)
        assert r.status_code in (200, 503) and r.content == b"", path
    r = httpx.post(root + "/v1/no-such-route", json={}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"   # OpenAI's type
    # another kind of model's API says what this server is (it said "no route")
    for path in ("/v1/embeddings", "/v1/audio/transcriptions", "/rerank"):
        r = httpx.post(root + path, json={"model": MODEL, "input": "x"}, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 404 and "is not served here" in err["message"], err
        assert "/v1/chat/completions" in err["message"] and err["code"] == "not_found"


def test_a_browser_on_another_origin_may_call_the_api(root):
    # (an OPTIONS preflight was a 405, so a web UI served from another origin could not call
    # the API at all; vLLM allows any origin by default)
    pre = httpx.options(root + "/v1/chat/completions", timeout=10, headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.post(root + "/v1/completions", headers={"Origin": "https://ui.example"}, timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_tokenize_prompt_and_messages(root):
    r = httpx.post(root + "/tokenize", json={"model": MODEL, "prompt": "héllo"}, timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == encode("héllo") and body["count"] == 6 and body["max_model_len"] > 6
    assert body["token_strs"] is None
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(root + "/tokenize", json={"model": MODEL, "messages": msgs, "return_token_strs": True},
                   timeout=10).json()
    assert r["tokens"] == encode(chat_template(msgs)) and r["count"] == len(r["tokens"])
    assert "".join(r["token_strs"]) == chat_template(msgs).replace("\n", "<0x0A>")
    r = httpx.post(root + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}, timeout=10).json()
    assert r["tokens"] == encode(chat_template(msgs, add_generation_prompt=False))


def test_tokenize_counts_what_a_completion_bills(client, root):
    prompt = "count me exactly €"
    n = httpx.post(root + "/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=10).json()["count"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens == n


def test_detokenize_round_trip(root):
    toks = encode("round trip ü") + [256]   # EOS is special: not text
    r = httpx.post(root + "/detokenize", json={"model": MODEL, "tokens": toks}, timeout=10)
    assert r.status_code == 200 and r.json() == {"prompt": "round trip ü"}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 999]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
    ("/detokenize", [1, 2], 400, None),
])
def test_tokenize_errors_are_openai_shaped(root, path, body, status, param):
    r = httpx.post(root + path, json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == param


def test_version_ping_tokenizer_info(root):
    import importlib.metadata
    v = httpx.get(root + "/version", timeout=10)
    assert v.status_code == 200 and v.json() == {"version": importlib.metadata.version("lockstep")}
    assert httpx.get(root + "/ping", timeout=10).status_code == 200
    assert httpx.post(root + "/ping", timeout=10).status_code == 200
    info = httpx.get(root + "/tokenizer_info", timeout=10).json()
    assert info["vocab_size"] == 260 and info["eos_token_id"] == 256 and info["model_max_length"] > 0
    assert "add_generation_prompt" in info["chat_template"]


def test_new_endpoints_in_openapi(root):
    paths = httpx.get(root + "/openapi.json", timeout=10).json()["paths"]
    for p in ("/tokenize", "/detokenize", "/tokenizer_info", "/version", "/ping", "/v1/models/{model_id}"):
        assert p in paths, p


# --- 2. no silently ignored parameter ------------------------------------------------------

NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "top_k": -1, "min_p": 0,
           "min_tokens": 0, "logit_bias": {}, "response_format": {"type": "text"}, "n": 1, "best_of": 1,
           "guided_json": None, "structured_outputs": None, "stop_token_ids": [],
           "include_stop_str_in_output": False, "skip_special_tokens": True,
           "use_beam_search": False, "length_penalty": 1, "priority": 0, "return_tokens_as_token_ids": False,
           "allowed_token_ids": None, "truncate_prompt_tokens": None}
CHAT_NEUTRAL = {"echo": False, "add_generation_prompt": True, "continue_final_message": False,
                "chat_template_kwargs": {}, "documents": None}

# vLLM's own parameters included: a vLLM client got a 200 with them doing nothing (API probe)
REFUSED_BOTH = [("include_stop_str_in_output", True), ("bad_words", ["x"]),
                ("skip_special_tokens", False), ("allowed_token_ids", [65]), ("truncate_prompt_tokens", 10),
                ("use_beam_search", True), ("length_penalty", 0.5), ("return_tokens_as_token_ids", True),
                ("priority", 1), ("logits_processors", ["x"]), ("guided_whitespace_pattern", " ")]
REFUSED_COMPLETION = [("suffix", "tail")]
REFUSED_CHAT = [("functions", [{"name": "f"}]), ("function_call", "auto"), ("store", True),
                ("modalities", ["audio"]), ("echo", True), ("chat_template", "{{x}}"),
                ("documents", [{"t": "x"}])]


def test_neutral_values_are_accepted(client):
    ref = client.completions.create(model=MODEL, prompt="neutral", max_tokens=12, seed=4,
                                    extra_body={"ignore_eos": True})
    r = client.completions.create(model=MODEL, prompt="neutral", max_tokens=12, seed=4,
                                  extra_body={"ignore_eos": True, **NEUTRAL, "suffix": ""})
    assert r.choices[0].text == ref.choices[0].text == sim_expected_text(encode("neutral"), 12, seed=4)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       logprobs=False, top_logprobs=0, tool_choice="none", tools=[], store=False,
                                       parallel_tool_calls=False, extra_body={**NEUTRAL, **CHAT_NEUTRAL})
    assert c.usage.completion_tokens >= 1
    s = list(client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": False}))
    assert s[-1].usage is not None


def _refused(call, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    body = err.value.response.json()["error"]
    assert body["param"] == name, body
    assert name in body["message"] and "not supported yet" in body["message"], body
    assert body["code"] == "unsupported_parameter"


@pytest.mark.parametrize("name,value", REFUSED_BOTH + REFUSED_COMPLETION)
def test_completion_refuses_non_neutral(client, name, value):
    _refused(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={name: value}),
             name)


@pytest.mark.parametrize("name,value", REFUSED_BOTH + REFUSED_CHAT)
def test_chat_refuses_non_neutral(client, name, value):
    _refused(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=2, extra_body={name: value}), name)


def test_template_variables_the_byte_template_does_not_read_are_dropped(client):
    # as vLLM drops them (proxies send enable_thinking to every model; it was a 400); with a
    # checkpoint the ones its template reads reach it (tests/test_checkpoints_tokenizer.py)
    msgs = [{"role": "user", "content": "x"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                         reasoning_effort="low",
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got.choices[0].message.content == plain.choices[0].message.content
    assert got.usage.prompt_tokens == plain.usage.prompt_tokens


SUPPORTED = {"top_k": 5, "min_p": 0.1, "presence_penalty": 1.5, "frequency_penalty": -0.5,
             "repetition_penalty": 1.3}


def test_sampling_params_accepted(client):
    """The engine's sampler implements these (tests/test_sampler_params.py); the sim backend's
    text does not depend on sampling, so the same text comes back (docs/api.md)."""
    r = client.completions.create(model=MODEL, prompt="sampled", max_tokens=8, seed=5,
                                  extra_body={"ignore_eos": True, **SUPPORTED})
    assert r.choices[0].text == sim_expected_text(encode("sampled"), 8, seed=5)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       presence_penalty=2.0, frequency_penalty=2.0,
                                       extra_body={"top_k": 1, "min_p": 1.0, "repetition_penalty": 2.0})
    assert c.usage.completion_tokens >= 1


@pytest.mark.parametrize("name,value", [("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5),
                                        ("frequency_penalty", -3), ("repetition_penalty", 0),
                                        ("top_k", 1.5), ("min_p", "x")])
def test_sampling_params_out_of_range(client, name, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={name: value})
    assert err.value.response.json()["error"]["param"] == name


def test_continuous_usage_stats(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    chunks = list(client.completions.create(model=MODEL, prompt="usage", max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == 5 for c in chunks)
    seen = [c.usage.completion_tokens for c in chunks]
    assert seen == sorted(seen) and seen[-1] == 6 and chunks[-1].usage.total_tokens == 11
    # with n > 1 each chunk counts its own choice's tokens, as vLLM does (it summed over all
    # choices); batched prompts: its own prompt's
    chunks = list(client.completions.create(model=MODEL, prompt=["usage", "usage two"], n=2, max_tokens=6,
                                            stream=True, extra_body={"ignore_eos": True}, stream_options={
                                                "include_usage": True, "continuous_usage_stats": True}))
    last: dict[int, int] = {}
    for c in chunks:
        for ch in c.choices:
            assert c.usage.prompt_tokens == (5 if ch.index < 2 else 9)
            assert c.usage.completion_tokens >= last.get(ch.index, 0)
            last[ch.index] = c.usage.completion_tokens
    assert last == {0: 6, 1: 6, 2: 6, 3: 6}


def test_sdk_typed_parameters_refused(client):
    """The SDK's own keyword arguments, not only extra_body."""
    _refused(lambda: client.completions.create(model=MODEL, prompt="x", suffix="tail"), "suffix")


def test_unknown_fields_ignored_and_logged(client, sim_cluster):
    r = client.completions.create(model=MODEL, prompt="unknown", max_tokens=6, seed=2,
                                  extra_body={"ignore_eos": True, "zz_unknown_field": 1})
    assert r.choices[0].text == sim_expected_text(encode("unknown"), 6, seed=2)
    logs = Path(sim_cluster.state_dir) / sim_cluster.namespace / "logs"

    def api_logs() -> str:
        return "".join(p.read_text(errors="replace") for p in logs.glob("api-*.log"))

    deadline = time.monotonic() + 10
    while "zz_unknown_field" not in api_logs() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(ln for ln in api_logs().splitlines() if "zz_unknown_field" in ln)
    assert "unknown_fields_ignored" in line


def test_schema_lists_every_refused_field_with_its_neutral_value():
    for schema, refused in ((COMPLETION_SCHEMA, REFUSED_BOTH + REFUSED_COMPLETION),
                            (CHAT_SCHEMA, REFUSED_BOTH + REFUSED_CHAT)):
        for name, _ in refused:
            assert "not supported yet" in schema["properties"][name]["description"], name


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(client, root):
    # vLLM's return_token_ids (RL rollouts read them): it was ignored without a word
    ids = {"extra_body": {"return_token_ids": True, "ignore_eos": True}, "max_tokens": 6, "temperature": 0}
    c = client.completions.create(model=MODEL, prompt="hello there", **ids)
    ch = c.choices[0].model_extra
    assert ch["prompt_token_ids"] == encode("hello there") and len(ch["token_ids"]) == 6 == c.usage.completion_tokens
    assert bytes(t for t in ch["token_ids"] if t < 256).decode("utf-8", "replace") == c.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="hello there", stream=True, **ids))
    got = [x.choices[0].model_extra for x in chunks if x.choices]
    assert got[0]["prompt_token_ids"] == ch["prompt_token_ids"]
    assert [t for g in got for t in g["token_ids"]] == ch["token_ids"]

    msgs = [{"role": "user", "content": "hi"}]
    want = httpx.post(root + "/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=msgs, **ids)
    assert r.model_extra["prompt_token_ids"] == want and len(r.choices[0].model_extra["token_ids"]) == 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True, n=2, **ids))
    assert chunks[0].model_extra["prompt_token_ids"] == want
    assert all("prompt_token_ids" not in x.model_extra for x in chunks[1:])
    for i in range(2):
        streamed = [t for x in chunks for c in x.choices if c.index == i for t in c.model_extra["token_ids"]]
        assert len(streamed) == 6
    # without it, none of them
    plain = client.completions.create(model=MODEL, prompt="hello there", max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra


def test_a_compressed_body_is_a_415_that_says_so(root):
    # it was read as JSON: a 400 "invalid JSON body ... invalid character (byte 0)"
    import gzip
    import json
    body = gzip.compress(json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode())
    r = httpx.post(root + "/v1/completions", content=body, timeout=10,
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert "Content-Encoding: gzip" in err["message"] and "uncompressed" in err["message"]
    assert err["code"] == "unsupported_media_type"
