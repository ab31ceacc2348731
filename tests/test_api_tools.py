"""Issue #15: tools in chat: tool_choice none / required / a named function (constrained to
the function's parameter schema by structured output), "auto" (the default: free text,
read as calls when it is an array of calls of the given tools), a forced call cut by
max_tokens returned as far as it got, tool messages and content null in the history. Official openai SDK against
a live `--backend sim` cluster; unit tests of the pure parts first."""

from __future__ import annotations

import json

import pytest

from services.api_server.bodies import ChatBody
from services.api_server.decode import decode
from services.api_server.errors import ApiError
from services.api_server.protocol import parse
from services.api_server.choice import StreamChoice
from services.api_server.gateway import RequestChannel
from services.api_server.tools import ToolCall, may_be_calls, message
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
    # "auto", also when tool_choice is left out (OpenAI's default: LangChain's bind_tools
    # and the Agents SDK send no tool_choice): free text, and no constraint on it
    for body in ({"tools": [WEATHER, TIME]}, {"tools": [WEATHER, TIME], "tool_choice": "auto"}):
        _, tc = parse_tools(body)
        assert tc.mode == "auto" and tc.guide is None and tc.names == ("get_weather", "get_time")
        p = _chat(body)
        assert p.params.guide is None and p.tool_call.mode == "auto" and "get_time" in p.prompt_text


BAD = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}


@pytest.mark.parametrize("body,param", [
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


def test_a_forced_call_cut_by_max_tokens_is_returned_as_far_as_it_got():
    # (it came back as the internal array in content: '[{"name": "get_weather", "parameters": {"city": "…')
    req = ToolCall("required", ["json", "[]"], names=("get_weather", "get_time"))
    msg, finish = message(req, '[{"name": "get_time", "parameters": {"tz": "CET"}}, {"name": "get_weather", '
                               '"parameters": {"city": "Par', "length")
    assert finish == "length" and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_time", '{"tz": "CET"}'), ("get_weather", '{"city": "Par')]
    msg, _ = message(req, '[{"name": "get_time", "parameters": {"tz": "CET"}}, {"na', "length")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]          # no name yet: left out
    msg, _ = message(req, '[{"name": "get_w', "length")                                # the one tool it begins
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("get_weather", "")]
    assert message(req, '[{"name": "get_', "length") == ({"role": "assistant", "content": None}, "length")
    assert message(req, '[{"', "length") == ({"role": "assistant", "content": None}, "length")
    msg, finish = message(ToolCall("named", ["json", "{}"], "get_weather"), '{"city": "Pa', "length")
    assert finish == "length"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


def test_auto_reads_an_array_of_calls_of_the_given_tools_and_anything_else_as_text():
    auto = ToolCall("auto", None, names=("get_weather", "get_time"))
    out = ' [{"name": "get_time", "parameters": {"tz": "UTC"}}]'
    msg, finish = message(auto, out, "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    for text in ("It is sunny.", "[1, 2]", "[]", '[{"name": "rm_rf", "parameters": {}}]',
                 '[{"name": "get_time", "parameters": {}, "extra": 1}]', '{"name": "get_time", "parameters": {}}'):
        assert message(auto, text, "stop") == ({"role": "assistant", "content": text}, "stop"), text
    assert message(auto, out[:20], "length") == ({"role": "assistant", "content": out[:20]}, "length")
    assert may_be_calls("") and may_be_calls(" \n[{") and not may_be_calls(" It")


def _stream(tool_call: ToolCall, text: str, finish: str = "stop") -> list[dict]:
    """Every entry a streamed choice sends for ``text`` arriving a byte at a time."""
    p = _chat({"tools": [WEATHER, TIME]})
    p.tool_call = tool_call
    ch = RequestChannel("r")
    st = StreamChoice(p, ch, 0, [], "")
    out: list[dict] = []
    data = text.encode()
    for i, b in enumerate(data):
        ch.tokens.append(b)
        if i == len(data) - 1:
            ch.finish = finish
        out += st.poll()
    return out


def test_a_checkpoints_auto_output_reads_its_tool_call_blocks():
    auto = ToolCall("auto", None, names=("get_weather", "get_time"), fmt="hermes")
    out = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1.10}}\n'
           '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}')   # the last unclosed: EOS
    msg, finish = message(auto, out, "stop")
    assert finish == "tool_calls" and msg["content"] == "Let me look.\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo", "days": 1.10}'), ("get_time", '{"tz": "UTC"}')]
    assert message(auto, out.split("\n", 1)[1], "stop")[0]["content"] is None     # nothing before the calls
    for text in ("Sunny.", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "get_time", "arguments": "x"}</tool_call>', "<tool_call>{oops</tool_call>",
                 '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and some words'):
        assert message(auto, text, "stop") == ({"role": "assistant", "content": text}, "stop"), text


def test_a_checkpoints_auto_stream_sends_text_until_the_tag_and_the_calls_at_the_end():
    auto = ToolCall("auto", None, names=("get_weather",), fmt="hermes")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    entries = _stream(auto, "Let me <b> look. " + call)
    text = [e["delta"]["content"] for e in entries if e["delta"].get("content")]
    assert "".join(text) == "Let me <b> look. " and len(text) > 5        # streamed as it came, "<b>" too
    calls = [c for e in entries for c in e["delta"].get("tool_calls", ())]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and entries[-1]["finish_reason"] == "tool_calls"
    entries = _stream(auto, "a <tool_c")                                  # a tag's beginning, then the end
    assert "".join(e["delta"].get("content") or "" for e in entries) == "a <tool_c"
    assert entries[-1]["finish_reason"] == "stop"


def test_auto_streams_text_at_once_and_holds_only_what_may_be_calls():
    auto = ToolCall("auto", None, names=("get_weather", "get_time"))
    entries = _stream(auto, "  Sunny.")
    deltas = [e["delta"] for e in entries]
    assert deltas[0] == {"role": "assistant"}
    # the two held spaces go out with the first letter; then a delta per byte, not one at the end
    assert [d.get("content") for d in deltas[1:-1]] == ["  S", "u", "n", "n", "y", "."]
    assert entries[-1]["finish_reason"] == "stop"
    call = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]'
    entries = _stream(auto, call)
    calls = [c for e in entries for c in e["delta"].get("tool_calls", ())]
    assert not any(e["delta"].get("content") for e in entries)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris", "days": 2}')]
    assert entries[-1]["finish_reason"] == "tool_calls"
    entries = _stream(auto, "[1, 2] is a list")          # held while it might be calls, then text whole
    assert "".join(e["delta"].get("content") or "" for e in entries) == "[1, 2] is a list"
    assert entries[-1]["finish_reason"] == "stop"


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
    # "auto" by default (it was a 400): the byte model writes text here, streamed or not alike
    r = c.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=40, seed=7)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.tool_calls is None and ch.message.content
    streamed = "".join(x.delta.content or "" for ck in c.chat.completions.create(
        model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=40, seed=7, stream=True) for x in ck.choices)
    assert streamed == ch.message.content
    # a forced call cut by max_tokens is a call as far as it got, never the internal array as text
    r = c.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], tool_choice="required", max_tokens=12)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None, ch.message
    assert [t.function.name for t in ch.message.tool_calls] == ["get_weather"]
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
