"""The request bodies as msgspec Structs (services/api_server/bodies.py, decode.py): the
decoder's errors become OpenAI-style 400s that name the field and say what it allows;
unknown top-level fields are found and ignored; the OpenAPI schema is the Structs'. Pure."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from services.api_server.bodies import CHAT_SCHEMA, COMPLETION_SCHEMA, ChatBody, CompletionBody
from services.api_server.decode import decode
from services.api_server.errors import ApiError
from services.api_server.protocol import END_OF_TURN, parse

MSGS = [{"role": "user", "content": "hi"}]


def _err(body: dict | bytes, kind: str = "completion") -> ApiError:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(ApiError) as err:
        parse(raw, kind, served_model="m", max_model_len=256, num_ranks=2)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("body,kind,param,says", [
    ({"model": "m", "prompt": "x", "temperature": 3}, "completion", "temperature", "must be a number <= 2, got 3"),
    ({"model": "m", "prompt": "x", "temperature": True}, "completion", "temperature", "must be a number, got true"),
    ({"model": "m", "prompt": "x", "n": 1.5}, "completion", "n", "must be an integer, got 1.5"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, "completion", "top_p", "must be a number <= 1, got 1.5"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "completion", "repetition_penalty", "must be a number > 0, got 0"),
    ({"model": "m", "prompt": "x", "max_tokens": "ten"}, "completion", "max_tokens", "must be an integer"),
    ({"model": "m"}, "completion", "prompt", "'prompt' is required"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "completion", "stop", "'stop[1]' must be a non-empty string"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 65}, "completion", "stop", "at most 64 items"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 200}}, "completion", "logit_bias", "<= 100"),
    ({"model": "m", "prompt": [1.5]}, "completion", "prompt", "a list of token ids"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "xml"}}, "completion", "response_format",
     'must be one of "json_object", "json_schema", "text", got "xml"'),
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a", "foo": 1}}, "completion",
     "structured_outputs", "has no field 'foo'"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": 2}}, "completion",
     "stream_options", "'stream_options.include_usage' must be a boolean, got 2"),
    ({"model": "m", "prompt": "x", "temperature": "warm"}, "completion", "temperature",
     'must be a number, got "warm"'),
    ({"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "chat", "messages[0].role",
     'must be one of "assistant", "developer", "system", "tool", "user", got "bot"'),
    ({"model": "m", "messages": [{"content": "x"}]}, "chat", "messages[0]", "needs the field 'role'"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "chat", "messages[0].content",
     "must be a string or a list, got 5"),
    ({"model": "m", "messages": [{"role": "user", "content": None}]}, "chat", "messages[0].content",
     "'messages[0].content' must be a string or a list of content parts, got null"),
    ({"model": "m", "messages": []}, "chat", "messages", "must be a non-empty list"),
    ({"model": "m", "messages": MSGS, "tool_choice": "maybe"}, "chat", "tool_choice",
     'must be one of "auto", "none", "required", got "maybe"'),
    ({"model": "m", "messages": MSGS, "tools": [{"type": "function", "function": {}}]}, "chat", "tools[0]",
     "'tools[0].function' needs the field 'name'"),
    ({"model": "m", "messages": MSGS, "top_logprobs": 21, "logprobs": True}, "chat", "top_logprobs", "<= 20, got 21"),
])
def test_each_400_names_the_field_and_what_it_allows(body, kind, param, says):
    err = _err(body, kind)
    assert err.param == param and says in err.message, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_bodies_that_are_not_objects_or_not_json():
    assert _err(b"[1, 2]").message == "the request body must be a JSON object"
    for raw in (b"{not json", b"", b'{"model": "m", "prompt": "x",}'):
        err = _err(raw)
        assert err.message.startswith("invalid JSON body: ") and err.param is None


def test_a_free_form_object_nested_too_deeply_is_a_400():
    # (metadata, a schema or a tool's parameters nested thousands deep: a RecursionError, a 500)
    deep = "1"
    for _ in range(10_000):
        deep = '{"a": ' + deep + '}'
    for field in ("metadata", "response_format"):
        raw = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "' + field + '": ' + deep + '}')
        err = _err(raw.encode(), "chat")
        assert err.status == 400 and "nested too deeply" in err.message, err.message


def test_a_lone_surrogate_escape_is_named_as_such():
    # (on /v1/completions the decoder said "Input data was truncated")
    for kind in ("completion", "chat"):
        for text in (rb"hi \ud800", rb"\ude00 then a pair \ud83d\ude00"):
            raw = (b'{"model": "m", "prompt": "' + text + b'"}' if kind == "completion" else
                   b'{"model": "m", "messages": [{"role": "user", "content": "' + text + b'"}]}')
            assert "lone UTF-16 surrogate" in _err(raw, kind).message, (kind, text)
    # a whole pair is text; a body broken otherwise is not blamed on it
    assert "lone" not in _err(b'{"model": "m", "prompt": "\\ud83d\\ude00"').message


def test_integers_past_64_bits_are_a_clear_error_not_a_crash():
    """msgspec decodes them where orjson would not re-encode them (a 500 before the fix)."""
    big = 10**30
    err = _err(f'{{"model": "m", "prompt": "x", "guided_json": {{"type": "array", "maxItems": {big}}}}}'.encode())
    assert err.param == "guided_json"
    assert _err(f'{{"model": "m", "prompt": "x", "seed": {big}}}'.encode()).param == "seed"
    calls = f'[{{"function": {{"name": "f", "arguments": {big}}}}}]'
    p = parse(f'{{"model": "m", "messages": [{{"role": "assistant", "content": null, "tool_calls": {calls}}}]}}'
              .encode(), "chat", served_model="m", max_model_len=256, num_ranks=2)
    assert str(big) in p.prompt_text


def test_unknown_fields_are_named_and_ignored():
    body = {"model": "m", "prompt": "x", "zz": 1, "seed": 3, "yy": {"a": 2}}
    p = parse(orjson.dumps(body), "completion", served_model="m", max_model_len=256, num_ranks=2)
    assert p.ignored == ("zz", "yy") and p.params.seed == 3
    assert _err({**body, "temperature": 9}).param == "temperature"       # still checked with them present
    plain = parse(orjson.dumps({"model": "m", "prompt": "x", "seed": 3}), "completion", served_model="m",
                  max_model_len=256, num_ranks=2)
    assert plain.ignored == () and plain.params == p.params


def test_numbers_are_read_as_vllm_reads_them():
    """vLLM's pydantic models are lax: 2.0 or "2" is an integer, "0.5" a number, "true" and
    1 booleans. A client that sends them (a JSON encoder that writes every number as a
    float, a form posted as strings) gets the same answer as from vLLM, not a 400."""
    body = {"model": "m", "prompt": [72.0, 105], "max_tokens": 2.0, "n": "2", "temperature": "0.5",
            "seed": 7.0, "stream": "true", "stream_options": {"include_usage": 1}, "logprobs": "3"}
    p = parse(orjson.dumps(body), "completion", served_model="m", max_model_len=256, num_ranks=2)
    assert p.params.max_tokens == 2 and isinstance(p.params.max_tokens, int)
    assert p.n == 2 and p.params.temperature == 0.5 and p.params.seed == 7 and p.logprobs == 3
    assert p.stream and p.include_usage and p.prompt == [72, 105]
    assert _err({"model": "m", "prompt": "x", "max_tokens": 2.5}).param == "max_tokens"


def test_bytes_and_decoded_json_read_the_same():
    body = {"model": "m", "messages": MSGS, "temperature": 0.5, "stop": "x", "logit_bias": {"65": 2}, "n": 2}
    a, _ = decode(orjson.dumps(body), ChatBody)
    b, _ = decode(body, ChatBody)
    assert a == b and a.temperature == 0.5 and a.logit_bias == {"65": 2.0}


def test_schema_is_the_structs():
    """Every field the decoder knows is in the served schema, unknown fields are allowed
    (ignored), and the ranges are msgspec's Meta."""
    for schema, typ in ((COMPLETION_SCHEMA, CompletionBody), (CHAT_SCHEMA, ChatBody)):
        assert set(schema["properties"]) == set(typ.__struct_fields__) and schema["additionalProperties"] is True
    _, comps = msgspec.json.schema_components([ChatBody], ref_template="#/components/schemas/{name}")
    assert comps["ChatBody"]["properties"]["temperature"] == CHAT_SCHEMA["properties"]["temperature"]
    temp = {s.get("type"): s for s in CHAT_SCHEMA["properties"]["temperature"]["anyOf"]}
    assert temp["number"]["minimum"] == 0 and temp["number"]["maximum"] == 2
    assert set(CHAT_SCHEMA["required"]) == {"messages"}     # model: the served one when left out
    assert set(COMPLETION_SCHEMA["required"]) == {"prompt"}


def test_a_prompt_past_the_context_names_the_prompt_and_a_completion_past_it_names_max_tokens():
    from services.api_server.errors import ApiError
    from services.api_server.protocol import parse

    def refused(body: dict, kind: str) -> ApiError:
        with pytest.raises(ApiError) as err:
            parse({"model": "m", **body}, kind, served_model="m", max_model_len=64, num_ranks=1)
        assert err.value.code == "context_length_exceeded"
        return err.value

    assert refused({"prompt": "x" * 100, "max_tokens": 3}, "completion").param == "prompt"
    assert refused({"messages": [{"role": "user", "content": "x" * 100}]}, "chat").param == "messages"
    assert refused({"prompt": "x", "max_tokens": 100}, "completion").param == "max_tokens"
    assert refused({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100},
                   "chat").param == "max_completion_tokens"


def test_an_empty_prompt_list_says_the_prompt_is_empty():
    from services.api_server.errors import ApiError
    from services.api_server.protocol import parse

    for prompt in ([], [[]]):
        with pytest.raises(ApiError, match="prompt is empty"):
            parse({"model": "m", "prompt": prompt}, "completion", served_model="m", max_model_len=64, num_ranks=1)


def test_the_byte_models_chat_ends_at_the_next_role_tag():
    # it never saw EOS, so its turns ran to max_tokens; the tag that opens the next turn ends one
    def chat(**extra):
        return parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}, "chat",
                     served_model="m", max_model_len=4096, num_ranks=1).params.stop
    assert chat() == [END_OF_TURN] and chat(stop="x") == ["x", END_OF_TURN]
    assert chat(ignore_eos=True) == []                                  # asked to run on
    assert chat(response_format={"type": "json_object"}) == []          # a grammar ends it
    assert parse({"model": "m", "prompt": "hi"}, "completion", served_model="m", max_model_len=4096,
                 num_ranks=1).params.stop == []                         # raw text: no turns


@pytest.mark.parametrize("body,kind", [({"prompt": "x"}, "completion"), ({"model": "", "prompt": "x"}, "completion"),
                                       ({"messages": MSGS}, "chat"), ({"model": None, "messages": MSGS}, "chat")])
def test_a_request_without_a_model_is_served_by_the_served_one(body, kind):
    # (a 400 "'model' is required": vLLM serves it, and curl scripts written for vLLM leave it out)
    from services.api_server.protocol import parse
    p = parse(body, kind, served_model="m", max_model_len=512, num_ranks=1)
    assert p.model == "m"


def test_an_assistants_refusal_part_is_history_other_parts_are_refused():
    # (a 400: OpenAI accepts the refusal parts of its own answers sent back in the history)
    from services.api_server.errors import ApiError
    from services.api_server.protocol import parse
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
            {"role": "user", "content": [{"type": "text", "text": "why?"}]}]
    p = parse({"messages": msgs}, "chat", served_model="m", max_model_len=512, num_ranks=1)
    assert "I can't help with that." in p.prompt_text
    # each names the part (param messages[0].content[1]) and says what is wrong with it: a
    # text part with no text was told "only text parts are supported"
    for bad, said in ((({"type": "refusal", "refusal": "no"}), "a refusal part is an assistant's"),
                      (({"type": "image_url", "image_url": {"url": "data:,"}}), "not 'image_url'"),
                      (({"type": "text"}), "a text part needs its 'text'")):
        msg = {"role": "user", "content": [{"type": "text", "text": "see"}, bad]}
        with pytest.raises(ApiError) as err:
            parse({"messages": [msg]}, "chat", served_model="m", max_model_len=512, num_ranks=1)
        assert err.value.status == 400 and err.value.param == "messages[0].content[1]", err.value.param
        assert said in err.value.message, err.value.message
    assert err.value.code is None
    with pytest.raises(ApiError) as err:   # what is not supported says so in its code, as the Responses route's
        parse({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "chat",
              served_model="m", max_model_len=512, num_ranks=1)
    assert err.value.code == "unsupported_parameter"


def test_responses_style_text_parts_are_text_in_chat():
    # vLLM reads input_text / output_text parts as text; clients that turn a Responses
    # history into chat messages send them (they were a 400)
    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "snowy"}]},
            {"role": "user", "content": "thanks"}]
    p = parse({"messages": msgs}, "chat", served_model="m", max_model_len=512, num_ranks=1)
    assert "weather?" in p.prompt_text and "snowy" in p.prompt_text


def test_a_body_that_begins_with_a_utf8_bom_is_read():
    # PowerShell 5 writes its files with a BOM (curl.exe -d @body.json); Python's json.loads,
    # and so vLLM, reads it. It was "JSON is malformed: invalid character (byte 0)".
    body = orjson.dumps({"prompt": "hi", "max_tokens": 2})
    b, _ = decode(b"\xef\xbb\xbf" + body, CompletionBody)
    assert b.prompt == "hi" and b.max_tokens == 2
    with pytest.raises(ApiError):
        decode(b"\xef\xbb" + body, CompletionBody)        # a broken BOM is still not JSON
