"""/v1/responses: OpenAI's Responses API as a translation over chat completions. The
translation's pure parts first, then the official openai client (``responses.create`` and
the strict ``responses.stream`` accumulator) against a live `--backend sim` cluster."""

from __future__ import annotations

import json

import orjson
import pytest

from services.api_server.errors import ApiError
from services.api_server.responses_api import from_chat, rename_error, stream_events, to_chat

MODEL = "lockstep-moe"
WEATHER = {"type": "function", "name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}


def _chat(body: dict) -> dict:
    raw, _ = to_chat(orjson.dumps({"model": MODEL, **body}))
    return orjson.loads(raw)


def test_vllms_sampling_fields_go_on_to_the_chat_request_and_unknown_ones_are_reported():
    # what guidellm's Responses benchmark sends (ignore_eos, stop) and vLLM's Responses route
    # takes: they were dropped unread, so lengths and stops came out wrong
    extras = {"seed": 7, "stop": ["x"], "ignore_eos": True, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
              "repetition_penalty": 1.1, "logit_bias": {"65": 2}, "min_tokens": 3, "chat_template_kwargs": {"k": 1}}
    raw, t = to_chat(orjson.dumps({"model": MODEL, "input": "hi", **extras, "max_tokens": 4, "bogus": 1}))
    c = orjson.loads(raw)
    assert {k: c[k] for k in extras} == extras
    assert "max_tokens" not in c and "bogus" not in c and sorted(t.ignored) == ["bogus", "max_tokens"]
    raw, t = to_chat(b"\xef\xbb\xbf" + orjson.dumps({"model": MODEL, "input": "hi", "seed": 1}))   # a BOM
    assert orjson.loads(raw)["seed"] == 1 and t.ignored == ()


def test_a_request_becomes_the_chat_request_that_answers_it():
    c = _chat({"input": "hi", "instructions": "be brief", "max_output_tokens": 9, "temperature": 0,
               "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
               "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
               "stream": True, "top_logprobs": 2, "store": False, "metadata": {"k": "v"},
               "reasoning": {"effort": None}, "service_tier": "auto"})
    assert c["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert c["max_completion_tokens"] == 9 and c["temperature"] == 0
    assert c["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                            "parameters": WEATHER["parameters"]}}]
    assert c["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert c["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert c["stream_options"] == {"include_usage": True} and c["logprobs"] and c["top_logprobs"] == 2
    # a conversation with a tool round: parallel calls are one assistant turn, outputs tool turns
    c = _chat({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "snow"},
        {"type": "reasoning", "id": "r1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]})
    assert [m["role"] for m in c["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert [t["id"] for t in c["messages"][1]["tool_calls"]] == ["c1", "c2"]
    assert c["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "snow"}
    # a reasoning item's text is the next assistant turn's reasoning (a template may show it)
    c = _chat({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "r0", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "snow"},
        {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "it snows"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "snow"}]}]})
    assert [m.get("reasoning") for m in c["messages"]] == [None, "look it up", None, "it snows"]
    # what the Agents SDK sends back: a refusal part of an earlier answer; a response's own
    # defaults (tool_choice "auto" with tools []) mean no tools
    c = _chat({"input": [{"type": "message", "role": "assistant", "id": "m", "status": "completed",
                          "content": [{"type": "refusal", "refusal": "no"}]}], "tools": [], "tool_choice": "auto"})
    assert c["messages"] == [{"role": "assistant", "content": "no"}] and "tools" not in c and "tool_choice" not in c


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "zz", "output": "y"}]},
     "input[1].call_id"),                                           # answers no call in the input
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": 5}, "input"),
    # the parameter rule: known and not supported, so a 400 unless neutral
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls"),
    ({"input": "x", "reasoning": {"budget": 5}}, "reasoning.budget"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
])
def test_what_cannot_be_served_is_a_400_naming_the_responses_field(body, param):
    with pytest.raises(ApiError) as err:
        to_chat(orjson.dumps({"model": MODEL, **body}))
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_hints_that_change_no_answer_are_accepted_and_logged():
    # what Codex-style clients send at every call, as vLLM accepts it (they were 400s)
    hints = {"store": True, "reasoning": {"effort": "low", "summary": "auto"}, "text": {"verbosity": "low"},
             "include": ["reasoning.encrypted_content"], "truncation": "auto"}
    raw, t = to_chat(orjson.dumps({"model": MODEL, "input": "hi", **hints}))
    c = orjson.loads(raw)
    assert c["messages"] == [{"role": "user", "content": "hi"}] and c["reasoning_effort"] == "low"
    assert sorted(t.ignored) == ["include.reasoning.encrypted_content", "reasoning.summary", "store",
                                 "text.verbosity", "truncation"]
    # the response says what was done: nothing stored
    assert from_chat(_completion("a"), t)["store"] is False


def test_a_chat_error_names_the_responses_field():
    _, t = to_chat(orjson.dumps({"model": MODEL, "instructions": "i", "input": [
        {"type": "reasoning", "id": "r"}, {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},     # the same assistant turn
        {"type": "function_call_output", "call_id": "a", "output": "y"}]}))
    # chat messages: instructions, input[1], input[2] (+ input[3]), input[4]
    err = rename_error(ApiError(400, "'messages[1].content' is too long", param="messages[1].content"), t)
    assert err.param == "input[1].content" and "'input[1].content'" in err.message
    assert rename_error(ApiError(400, "x", param="messages[3]"), t).param == "input[4]"
    assert rename_error(ApiError(400, "x", param="messages[0].content"), t).param == "instructions"
    _, t = to_chat(orjson.dumps({"model": MODEL, "input": "a string"}))
    assert rename_error(ApiError(400, "x", param="messages[0].content"), t).param == "input"
    assert rename_error(ApiError(400, "x", param="messages"), t).param == "input"
    err = rename_error(ApiError(400, "tool 'a': 'tools[0].function.parameters' ...",
                                param="tools[0].function.parameters"), t)
    assert err.param == "tools[0].parameters" and "'tools[0].parameters'" in err.message
    err = rename_error(ApiError(400, "'max_completion_tokens' must be ...", param="max_completion_tokens"), t)
    assert err.param == "max_output_tokens" and "'max_output_tokens'" in err.message


def _completion(content, finish="stop", calls=None) -> dict:
    msg = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return {"id": "x", "model": MODEL, "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                                                    "logprobs": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}


def test_an_answer_becomes_a_response_object():
    _, t = to_chat(orjson.dumps({"model": MODEL, "input": "x", "metadata": {"k": "v"}}))
    r = from_chat(_completion("abc"), t)
    assert r["object"] == "response" and r["id"].startswith("resp_") and r["status"] == "completed"
    assert r["output"][0]["content"][0]["text"] == "abc" and r["metadata"] == {"k": "v"} and r["store"] is False
    assert r["usage"]["input_tokens"] == 4 and r["usage"]["output_tokens"] == 3
    r = from_chat(_completion("ab", "length"), t)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = from_chat(_completion(None, "tool_calls", [call]), t)
    assert [(o["type"], o["call_id"], o["name"], o["arguments"], o["status"]) for o in r["output"]] == [
        ("function_call", "chatcmpl-tool-1", "f", "{}", "completed")]
    assert r["completed_at"] >= r["created_at"]
    # a call cut by max_output_tokens is incomplete: an agent must not run it on cut arguments
    cut = {**call, "function": {"name": "f", "arguments": '{"city": "Pa'}}
    r = from_chat(_completion(None, "length", [cut]), t)
    assert r["status"] == "incomplete" and r["output"][0]["status"] == "incomplete" and r["completed_at"] is None


def test_a_chunk_stream_becomes_the_event_stream():
    _, t = to_chat(orjson.dumps({"model": MODEL, "input": "x", "stream": True}))
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "he"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}]
    events = [json.loads(e.split(b"\ndata: ", 1)[1]) for c in chunks for e in stream_events(c, t, MODEL)]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "hey"
    # a streamed call is sent at the finish, which says whether it was cut
    _, t = to_chat(orjson.dumps({"model": MODEL, "input": "x", "stream": True}))
    whole = {"index": 0, "id": "w", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    cut = {"index": 1, "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [whole, cut]}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}]
    events = [json.loads(e.split(b"\ndata: ", 1)[1]) for c in chunks for e in stream_events(c, t, MODEL)]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    # only the last call can be cut: the whole one before it stands (an agent runs it)
    assert [(i["type"], i["status"]) for i in done] == [("function_call", "completed"), ("function_call", "incomplete")]
    assert events[-1]["type"] == "response.incomplete"
    _, t = to_chat(orjson.dumps({"model": MODEL, "input": "x"}))
    calls = [{k: v for k, v in c.items() if k != "index"} for c in (whole, cut)]
    body = {"id": "chatcmpl-x", "created": 1, "model": MODEL, "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                                                       "total_tokens": 3},
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": None, "tool_calls": calls}}]}
    assert [i["status"] for i in from_chat(body, t)["output"]] == ["completed", "incomplete"]
    _, t = to_chat(orjson.dumps({"model": MODEL, "input": "x", "stream": True}))
    events = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in
              stream_events({"error": {"message": "timed out", "code": "timeout"}}, t, MODEL)]
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["code"] == "timeout"


# --- live ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_responses_live_sim(sim_cluster):
    import openai

    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    r = c.responses.create(model=MODEL, input="Say hi", instructions="be brief", max_output_tokens=5,
                           temperature=0)
    assert r.id.startswith("resp_") and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 0 and isinstance(r.output_text, str)
    # streamed, through the SDK's strict accumulator: the same text at temperature 0, and
    # OpenAI's last event for an answer cut by max_output_tokens
    with c.responses.stream(model=MODEL, input="Say hi", instructions="be brief", max_output_tokens=5,
                            temperature=0) as s:
        events = list(s)
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output[0].content[0].text == r.output_text
    # vLLM's extras take effect: the same seed, the same text; ignore_eos, the whole length
    same = dict(model=MODEL, input="Say hi", max_output_tokens=12, temperature=1.0,
                extra_body={"seed": 11, "ignore_eos": True})
    a, b = c.responses.create(**same), c.responses.create(**same)
    assert a.output_text == b.output_text and a.usage.output_tokens == 12
    stop = a.output_text[3]
    cut = c.responses.create(**{**same, "extra_body": {**same["extra_body"], "stop": [stop]}})
    assert cut.output_text == a.output_text[:a.output_text.index(stop)] and cut.status == "completed"
    # a forced function call, streamed (get_final_response needs response.completed), and
    # its round trip back as input
    with c.responses.stream(model=MODEL, input="weather in Oslo?", tools=[WEATHER], max_output_tokens=400,
                            tool_choice={"type": "function", "name": "get_weather"}) as s:
        r = s.get_final_response()
    call = r.output[0]
    assert r.status == "completed" and r.id.startswith("resp_")
    assert call.type == "function_call" and call.name == "get_weather" and len(json.loads(call.arguments)["city"]) <= 10
    r = c.responses.create(model=MODEL, max_output_tokens=3, input=[
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "snow"}])
    assert r.output[0].type == "message" and r.usage.output_tokens == 3
    # logprobs, asked as OpenAI asks for them
    r = c.responses.create(model=MODEL, input="x", max_output_tokens=3, top_logprobs=2,
                           include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 3 and all(len(lp.top_logprobs) == 2 for lp in lps)
    # structured output
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = c.responses.create(model=MODEL, input="a number", max_output_tokens=200,
                           text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["n"], int)
    # errors in the Responses request's words
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert err.value.response.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input="x" * 20_000)
    assert err.value.response.json()["error"]["param"].startswith("input")
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="x")
    c.close()
