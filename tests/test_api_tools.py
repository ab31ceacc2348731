"""Issue #15: tools in chat: tool_choice none / required / a named function (constrained to
the function's parameter schema by structured output), "auto" refused as vLLM does without
a tool parser, tool messages and content null in the history. Official openai SDK against
a live `--backend sim` cluster; unit tests of the pure parts first."""

from __future__ import annotations

import json

import pytest

from services.api_server.bodies import ChatBody
from services.api_server.decode import decode
from services.api_server.errors import ApiError
from services.api_server.protocol import parse
from services.api_server.tools import ToolCall, message
from services.api_server.tools import parse_tools as _parse_tools

MODEL = "lockstep-moe"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "weather in Paris?"}]


def parse_tools(body: dict):
    return _parse_tools(decode({"model": "m", "messages": MSGS, **body}, ChatBody)[0])


def _chat(body: dict):
    return parse({"model": "m", "messages": MSGS, **body}, "chat", served_model="m", max_model_len=4096, num_ranks=1)


def test_tool_choice_modes():
    assert parse_tools({}) == ([], None)
    tools, tc = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert tc is None and tools[0]["name"] == "get_weather"
    _, tc = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert tc.mode == "named" and tc.name == "get_time" and json.loads(tc.guide[1]) == TIME["function"]["parameters"]
    _, tc = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    schema = json.loads(tc.guide[1])
    assert tc.mode == "required" and schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    p = _chat({"tools": [WEATHER], "tool_choice": "required"})
    assert p.params.guide == tc.guide[:1] + [p.params.guide[1]] and p.tool_call.mode == "required"
    assert p.prompt_text.startswith("<|tools|>\n") and "get_weather" in p.prompt_text
    _, one = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(one.guide[1])["maxItems"] == 1 and "maxItems" not in schema


BAD = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER]}, "tool_choice"),                                  # auto by default: no parser
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),                                # no tools: OpenAI's 400, not a 200
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"functions": [{"name": "f"}]}, "functions"),
    # a schema that does not compile is a 400, as in response_format (it was a 200 with an empty output)
    ({"tools": [WEATHER, BAD], "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [BAD], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
])
def test_tool_errors_name_the_field(body, param):
    with pytest.raises(ApiError) as err:
        _chat(body)
    assert err.value.status == 400 and err.value.body()["error"]["param"] == param


def test_history_with_tool_messages_and_null_content():
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    p = parse({"model": "m", "messages": msgs}, "chat", served_model="m", max_model_len=4096, num_ranks=1)
    assert "<|tool|>\nsunny\n" in p.prompt_text and '"name":"get_weather"' in p.prompt_text
    q = parse({"model": "m", "messages": [*MSGS, {"role": "assistant", "content": None}]}, "chat",
              served_model="m", max_model_len=4096, num_ranks=1)
    assert q.prompt_text.endswith("<|assistant|>\n\n<|assistant|>\n")


@pytest.mark.parametrize("content", ["", "Let me check."])
def test_an_assistant_turn_with_text_and_tool_calls_keeps_its_calls_in_the_prompt(content):
    # (only content null rendered them: "" (LangChain's) or words dropped them silently)
    msgs = [*MSGS, {"role": "assistant", "content": content, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    p = parse({"model": "m", "messages": msgs}, "chat", served_model="m", max_model_len=4096, num_ranks=1)
    assert '"name":"get_weather"' in p.prompt_text and f"<|assistant|>\n{content}" in p.prompt_text


def test_message_of_an_output():
    named = ToolCall("named", ["json", "{}"], "get_time")
    msg, finish = message(named, '{"tz": "UTC"}', "stop")
    assert msg["content"] is None and finish == "stop"
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    assert msg["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    req = ToolCall("required", ["json", "[]"])
    msg, finish = message(req, '[{"name": "get_time", "parameters": {"tz": "CET"}}]', "stop")
    assert finish == "tool_calls" and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"tz": "CET"}
    # an integer past 64 bits stays exact (orjson read it as a float: 4.189e+19, not an integer)
    msg, _ = message(req, '[{"name": "f", "parameters": {"a": 41893536235608710000, "b": "é"}}]', "stop")
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"a": 41893536235608710000, "b": "é"}'
    assert message(req, '[{"name": "get_ti', "length") == ({"role": "assistant", "content": '[{"name": "get_ti'},
                                                           "length")


def test_a_required_calls_arguments_are_the_text_the_model_wrote():
    # parsed and dumped again, 1e999 came back as Infinity (not JSON: a JavaScript client's
    # JSON.parse threw) and 1.10 as 1.1; a live sim model wrote {"I": 1e999, ...}
    req = ToolCall("required", ["json", "[]"])
    out = '[{"name": "f", "parameters": {"I": 1e999, "b": 1.10}}, {"name": "g", "parameters": {"s": "}, {"}}]'
    msg, finish = message(req, out, "stop")
    assert finish == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("f", '{"I": 1e999, "b": 1.10}'), ("g", '{"s": "}, {"}')]
    # members in either order, spaces anywhere JSON allows them, non-objects skipped
    msg, _ = message(req, '[ 1 , {"parameters" : [ ] , "name" : "h"} ]', "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("h", "[ ]")]


# --- live ------------------------------------------------------------------------------------

def _check_weather(args: str) -> None:
    a = json.loads(args)
    assert set(a) == {"city", "days"} and len(a["city"]) <= 10 and 1 <= a["days"] <= 7


def exercise_tools(c, model: str = MODEL) -> None:
    """Named, required (and streamed), none; each call's arguments parse and fit the schema."""
    r = c.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER, TIME], max_tokens=2000, seed=3,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.message.content is None
    assert [t.function.name for t in ch.message.tool_calls] == ["get_weather"]
    _check_weather(ch.message.tool_calls[0].function.arguments)
    # one call (parallel_tool_calls false): bounded, so it finishes whatever the weights
    r = c.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER, TIME], tool_choice="required",
                                  max_tokens=3000, seed=5, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    for t in ch.message.tool_calls:
        assert t.type == "function" and t.id.startswith("chatcmpl-tool-")
        if t.function.name == "get_weather":
            _check_weather(t.function.arguments)
        else:
            assert t.function.name == "get_time" and json.loads(t.function.arguments)["tz"] in ("UTC", "CET")
    calls, finish, contents = [], None, []
    for ck in c.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER], max_tokens=2000, seed=3,
                                        stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for x in ck.choices:
            calls += x.delta.tool_calls or []
            finish = x.finish_reason or finish
            contents.append(x.delta.content)
    assert finish == "stop" and len(calls) == 1 and calls[0].function.name == "get_weather"
    # content null throughout, as the non-streamed message's (the role chunk said "")
    assert contents and all(x is None for x in contents), contents
    _check_weather(calls[0].function.arguments)
    r = c.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


@pytest.mark.slow
def test_tools_live_sim(sim_cluster):
    import openai

    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    exercise_tools(c)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=5)
    assert err.value.response.json()["error"]["param"] == "tool_choice"
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None and r.usage.prompt_tokens > 60
    c.close()


@pytest.mark.slow
def test_tokenize_counts_the_tools_as_chat_bills_them(sim_cluster):
    import httpx
    import openai

    root = sim_cluster.api_url.rsplit("/v1", 1)[0]
    n = httpx.post(root + "/tokenize", json={"messages": MSGS, "tools": [WEATHER]}, timeout=10).json()["count"]
    with openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=30) as c:
        r = c.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens == n


def test_text_parts_are_joined_by_new_lines():
    # as vLLM joins them ("a" and "b" ran together as "ab")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    p = parse({"model": "m", "messages": msgs}, "chat", served_model="m", max_model_len=4096, num_ranks=1)
    assert "<|user|>\na\nb\n" in p.prompt_text
