"""Issue #15: structured output (response_format json_object / json_schema, guided_json /
guided_regex / guided_choice / guided_grammar, structured_outputs): the grammar's mask is
applied per step in the engine (llguidance, shared/grammar.py) and the output parses, on
the sim backend (which draws among the allowed tokens by hash) and on the torch backend
with random weights. Official openai SDK against live clusters; unit tests first."""

from __future__ import annotations

import json
import re

import pytest
import torch

from services.api_server.errors import ApiError
from services.api_server.protocol import parse
from services.engine_worker.batch import ChunkInput
from services.engine_worker.guided import Guides
from services.engine_worker.model.sampler import RowExtra, allowed_tokens, sample
from services.engine_worker.sequence import Sequence
from services.engine_worker.sim_backend import SimBackend
from shared import grammar
from shared.messages import SamplingParams
from shared.tokenizer import EOS, VOCAB_SIZE
from tests.test_api_tools import exercise_tools

MODEL = "lockstep-moe"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _parse(body: dict, kind: str = "completion"):
    return parse({"model": "m", "prompt": "x", **body} if kind == "completion" else {"model": "m", **body}, kind,
                 served_model="m", max_model_len=4096, num_ranks=1)


def test_parse_every_way_to_ask():
    assert _parse({"response_format": {"type": "json_object"}}).params.guide == ["json", '{"type": "object"}']
    g = _parse({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert g.params.guide[0] == "json" and json.loads(g.params.guide[1]) == PERSON
    assert _parse({"guided_json": PERSON}).params.guide[0] == "json"
    assert _parse({"guided_regex": "[a-c]+"}).params.guide == ["regex", "[a-c]+"]
    assert _parse({"guided_choice": ["yes", "no"]}).params.guide == ["choice", '["yes","no"]']
    assert _parse({"guided_grammar": 'start: "a" "b"'}).params.guide == ["grammar", 'start: "a" "b"']
    assert _parse({"structured_outputs": {"regex": "x+"}}).params.guide == ["regex", "x+"]
    assert _parse({"structured_outputs": {"json_object": True}}).params.guide == ["json", '{"type": "object"}']
    assert _parse({"response_format": {"type": "text"}}).params.guide is None
    chat = _parse({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "chat")
    assert chat.params.guide[0] == "json"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": {"type": 5}}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a", "min_tokens": 1}, "min_tokens"),
])
def test_parse_refuses_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        _parse(body)
    assert err.value.status == 400 and err.value.body()["error"]["param"] == param


def test_sampler_never_draws_outside_the_mask():
    mask = bytearray((VOCAB_SIZE + 31) // 32 * 4)
    for t in (ord("a"), ord("b"), EOS):
        mask[t // 8] |= 1 << (t % 8)
    allowed = allowed_tokens(bytes(mask), VOCAB_SIZE)
    assert allowed.nonzero().flatten().tolist() == [ord("a"), ord("b"), EOS]
    logits = torch.randn(1, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    logits[0, ord("z")] = 100.0
    seen = {sample(logits, [1.0], [1.0], [3], [p], [RowExtra(allowed=bytes(mask))])[0] for p in range(60)}
    assert seen <= {ord("a"), ord("b"), EOS} and len(seen) > 1


def _drive_guided(guide: list[str], steps: int = 2000) -> bytes:
    """The sim backend under a guide, token by token, as the worker drives it."""
    g, sim = Guides(), SimBackend()
    seq = Sequence("s", [1, 2], SamplingParams(guide=guide))
    g.track("s", seq.params)
    for pos in range(steps):
        ch = ChunkInput("s", [1], 2 + pos - 1, [0], True, prompt_len=2)
        tok = sim.run([ch], {"s": [1, 2]}, {}, g.masks([ch], {"s": seq}.get))["s"]
        if tok == EOS:
            return bytes(seq.generated)
        seq.generated.append(tok)
    raise AssertionError("the grammar did not finish")


def test_guided_sim_output_follows_the_grammar():
    out = json.loads(_drive_guided(["json", json.dumps(PERSON)]).decode(errors="replace"))
    assert set(out) == {"name", "age"} and isinstance(out["name"], str) and 0 <= out["age"] <= 120
    assert re.fullmatch(r"[a-c]{2,5}-\d", _drive_guided(["regex", r"[a-c]{2,5}-\d"]).decode())
    assert _drive_guided(["choice", '["yes","no","maybe"]']).decode() in ("yes", "no", "maybe")


def test_guides_follow_generated_tokens_after_a_resume():
    g = Guides()
    seq = Sequence("s", [1], SamplingParams(guide=["choice", '["abc","abd"]']), generated=[ord("a"), ord("b")])
    g.track("s", seq.params)
    m = g.masks([ChunkInput("s", [1], 2, [0], True)], {"s": seq}.get)["s"]
    assert allowed_tokens(m, VOCAB_SIZE).nonzero().flatten().tolist() == [ord("c"), ord("d")]
    assert g.masks([ChunkInput("t", [1], 2, [0], True)], {}.get) is None
    g.forget("s")
    assert not g.active


# --- live ------------------------------------------------------------------------------------

def _check_person(text: str) -> None:
    out = json.loads(text)
    assert set(out) == {"name", "age"} and isinstance(out["name"], str) and len(out["name"]) <= 8
    assert isinstance(out["age"], int) and 0 <= out["age"] <= 120


def _exercise(c, seeds: tuple[int, ...], model: str = MODEL) -> None:
    """Every way to ask, through the SDK; each output parses."""
    msgs = [{"role": "user", "content": "a person, as JSON"}]
    for seed in seeds:
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=1500, seed=seed, temperature=1.0,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop"
        _check_person(r.choices[0].message.content)
        r = c.completions.create(model=model, prompt="json:", max_tokens=1500, seed=seed,
                                 extra_body={"guided_json": PERSON})
        _check_person(r.choices[0].text)
        r = c.completions.create(model=model, prompt="id:", max_tokens=40, seed=seed,
                                 extra_body={"guided_regex": r"[A-Z]{3}-\d{2,4}"})
        assert re.fullmatch(r"[A-Z]{3}-\d{2,4}", r.choices[0].text), r.choices[0].text
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=10, seed=seed,
                                      extra_body={"guided_choice": ["red", "green", "blue"]})
        assert r.choices[0].message.content in ("red", "green", "blue")
        r = c.completions.create(model=model, prompt="g:", max_tokens=40, seed=seed,
                                 extra_body={"guided_grammar": 'start: "(" ("x" | "y")+ ")"'})
        assert re.fullmatch(r"\([xy]+\)", r.choices[0].text), r.choices[0].text
        r = c.completions.create(model=model, prompt="so:", max_tokens=10, seed=seed,
                                 extra_body={"structured_outputs": {"choice": ["up", "down"]}})
        assert r.choices[0].text in ("up", "down")
    # Any object: nothing bounds a string's length, so weak weights may not close one within
    # max_tokens; every token still follows the grammar, and a finished output parses.
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=600, seed=seeds[0],
                                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        m = grammar.matcher("json", '{"type": "object"}')
        assert r.choices[0].finish_reason == "length" and m.consume_tokens(list(text.encode())), text[:200]


@pytest.mark.slow
def test_structured_output_sim(sim_cluster):
    import openai

    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    _exercise(c, (1,))
    # n choices, streamed: each choice's text parses on its own
    texts: dict[int, str] = {}
    for ck in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, seed=4,
                                        max_tokens=1500, stream=True, extra_body={"guided_json": PERSON}):
        for ch in ck.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(texts) == [0, 1, 2]
    for t in texts.values():
        _check_person(t)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "(unclosed"})
    assert err.value.response.json()["error"]["param"] == "guided_regex"
    c.close()


@pytest.mark.slow
def test_structured_output_torch_random_weights(tmp_path):
    import openai

    from tests.conftest import start_cluster

    # the seeded random-weight model, not the trained bundled one: the grammar alone must make it parse
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "torch", "--spares", "0",
                            "--model", "random", namespace="so")
    try:
        c = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=240)
        _exercise(c, (1,), model="random")
        exercise_tools(c, model="random")
        c.close()
    finally:
        cluster.stop()
