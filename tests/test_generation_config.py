"""A checkpoint's generation_config.json sets the sampling a request leaves out (vLLM's
--generation-config auto, its default): Qwen3's temperature 0.6 / top_p 0.95 / top_k 20
were ignored for 1.0 / no cut, and chat UIs that send no sampling fields got a model
sampled as its authors warn against."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from services.api_server.protocol import parse  # noqa: E402
from shared.hf_tokenizer import HFTokenizer, sampling_defaults  # noqa: E402
from tests.hf_checkpoints import make_tokenizer  # noqa: E402


def test_the_fields_read_and_what_is_left_out():
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 512,
                              "repetition_penalty": 1.05, "min_p": 0.0, "do_sample": True, "eos_token_id": 2}) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 512, "repetition_penalty": 1.05, "min_p": 0.0}
    # transformers' top_k 0 is no cut; wrong types and impossible values are left out
    assert sampling_defaults({"top_k": 0}) == {"top_k": -1}
    assert sampling_defaults({"temperature": "hot", "top_p": 1.5, "top_k": 2.5, "max_new_tokens": 0,
                              "repetition_penalty": 0, "min_p": True}) == {}
    assert sampling_defaults({"top_p": 0}) == {}
    assert sampling_defaults({}) == {}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> HFTokenizer:
    d = tmp_path_factory.mktemp("gen")
    make_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "eos_token_id": 1}))
    return HFTokenizer(d)


def _parse(tok, kind: str, **body):
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else
                             {"prompt": "hello"}), **body}
    return parse(json.dumps(body).encode(), kind, served_model="m", max_model_len=64, num_ranks=1, tok=tok)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_request_gets_the_checkpoints_defaults_for_what_it_leaves_out(tok, kind):
    sp = _parse(tok, kind).params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.min_p, sp.repetition_penalty) == \
        (0.6, 0.95, 20, 7, 0.0, 1.0)
    # its own values win, 0 included
    sp = _parse(tok, kind, temperature=0, top_p=1.0, top_k=-1, max_tokens=30).params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0, 1.0, -1, 30)
    # max_new_tokens is a default, never past the room the context leaves
    if kind == "completion":
        long = _parse(tok, kind, prompt=list(range(3, 61)))
        assert long.params.max_tokens == 64 - 58


def test_none_keeps_openais_defaults(tok):
    tok.sampling_defaults, kept = {}, tok.sampling_defaults
    try:
        sp = _parse(tok, "chat").params
        assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 1.0, -1) and sp.max_tokens > 7
    finally:
        tok.sampling_defaults = kept
