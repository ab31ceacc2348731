"""Structured output and forced tool calls on a served checkpoint: the grammar compiles for
the checkpoint's own tokenizer.json (shared/grammar.py ``checkpoint_vocab``), so the masks
the engine applies are over its tokens, its EOS ends a finished grammar, and the api-server
takes what it refused with a 400 before (structured output was built for byte tokens only).
Pure units here; the live round trip through `lockstep up --model DIR` is in
tests/test_checkpoints_cluster.py."""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("transformers")

from services.api_server.protocol import parse  # noqa: E402
from services.engine_worker.batch import ChunkInput  # noqa: E402
from services.engine_worker.guided import Guides  # noqa: E402
from services.engine_worker.sequence import Sequence  # noqa: E402
from shared import grammar  # noqa: E402
from shared.hf_tokenizer import HFTokenizer  # noqa: E402
from shared.messages import SamplingParams  # noqa: E402
from tests.hf_checkpoints import TOOLS_CHAT_TEMPLATE, make_tokenizer  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def tok(request, tmp_path_factory) -> HFTokenizer:
    d = tmp_path_factory.mktemp(request.param)
    make_tokenizer(d, request.param, chat_template=TOOLS_CHAT_TEMPLATE)
    return HFTokenizer(d)


def _bits(mask: bytes) -> list[int]:
    return [i * 8 + b for i, byte in enumerate(mask) if byte for b in range(8) if byte >> b & 1]


def _drive(tok: HFTokenizer, guide: list[str], seed: int, n_vocab: int | None = None) -> list[int]:
    """A guided sequence sampled at random among the allowed tokens of each step (weights that
    know nothing), as the worker drives Guides; the generated ids, EOS excluded."""
    vocab = grammar.checkpoint_vocab(str(tok.model_dir), tok.eos_token_ids, n_vocab)
    g, rnd = Guides(vocab), random.Random(seed)
    seq = Sequence("s", [1, 2], SamplingParams(guide=guide))
    g.track("s", seq.params)
    for pos in range(400):
        ch = ChunkInput("s", [1], 2 + pos - 1, [0], True, prompt_len=2)
        allowed = _bits(g.masks([ch], {"s": seq}.get)["s"])
        assert allowed and max(allowed) < max(n_vocab or 0, tok.vocab_size)
        t = rnd.choice(allowed)
        if t in tok.eos_token_ids:
            return seq.generated
        seq.generated.append(t)
    raise AssertionError("the grammar did not finish")


def test_a_checkpoints_tokens_follow_the_grammar_and_its_eos_ends_it(tok):
    for seed in range(4):
        out = json.loads(tok.decode(_drive(tok, ["json", json.dumps(PERSON)], seed)))
        assert set(out) == {"name", "age"} and len(out["name"]) <= 8 and 0 <= out["age"] <= 120
        assert re.fullmatch(r"[a-c]{2,5}-\d", tok.decode(_drive(tok, ["regex", r"[a-c]{2,5}-\d"], seed)))
        assert tok.decode(_drive(tok, ["choice", '["yes", "no", "maybe"]'], seed)) in ("yes", "no", "maybe")
    # multi-token pieces of the checkpoint's vocabulary are used, not only its byte pieces
    ids = _drive(tok, ["choice", '["quick brown fox"]'], 0)
    assert tok.decode(ids) == "quick brown fox"


def test_a_finished_grammar_allows_exactly_the_checkpoints_eos_tokens(tok):
    vocab = grammar.checkpoint_vocab(str(tok.model_dir), tok.eos_token_ids)
    g = Guides(vocab)
    done = tok.encode("no", add_special_tokens=False)
    seq = Sequence("s", [1], SamplingParams(guide=["choice", '["no"]']), generated=done)
    g.track("s", seq.params)
    mask = g.masks([ChunkInput("s", [1], 1 + len(done), [0], True)], {"s": seq}.get)["s"]
    assert _bits(mask) == sorted(tok.eos_token_ids)
    assert _bits(vocab.only_eos()) == sorted(tok.eos_token_ids)


def test_the_models_padded_vocabulary_is_never_allowed(tok):
    # config.json's vocab_size is often past the tokenizer's (Qwen3: 151,936 rows for 151,669
    # tokens); the mask covers every row the sampler draws from, the padding never allowed
    n = tok.vocab_size + 37
    vocab = grammar.checkpoint_vocab(str(tok.model_dir), tok.eos_token_ids, n)
    assert vocab.mask_bytes * 8 >= n
    json.loads(tok.decode(_drive(tok, ["json", json.dumps(PERSON)], 1, n_vocab=n)))


def test_the_api_server_takes_structured_output_and_forced_calls_for_a_checkpoint(tok):
    # (each was a 400 "not supported yet when serving a checkpoint")
    def chat(**body):
        return parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, **body},
                     "chat", served_model="m", max_model_len=512, num_ranks=1, tok=tok)

    p = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert p.params.guide[0] == "json" and json.loads(p.params.guide[1]) == PERSON
    assert chat(response_format={"type": "json_object"}).params.guide[0] == "json"
    assert chat(guided_regex=r"\d+").params.guide == ["regex", r"\d+"]
    p = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert p.params.guide[0] == "json" and p.tool_call.mode == "named"
    p = chat(tools=[WEATHER], tool_choice="required")
    assert p.params.guide[0] == "json" and p.tool_call.mode == "required"
    # what the engine will run compiles for these tokens
    assert grammar.check(*p.params.guide, tok.grammar_vocab) is None


def test_a_checkpoint_that_names_no_eos_refuses_structured_output(tok):
    # nothing could end a finished grammar's output: a 400 naming the field, not a run to max_tokens
    from services.api_server.errors import ApiError
    bare = HFTokenizer(tok.model_dir)
    bare.eos_token_ids = ()
    assert bare.grammar_vocab is None
    with pytest.raises(ApiError) as err:
        parse({"model": "m", "prompt": "x", "guided_regex": r"\d+"}, "completion", served_model="m",
              max_model_len=512, num_ranks=1, tok=bare)
    assert err.value.status == 400 and err.value.param == "guided_regex" and "EOS" in err.value.message
    parse({"model": "m", "prompt": "x"}, "completion", served_model="m", max_model_len=512, num_ranks=1, tok=bare)
