"""Tool calling in /v1/chat/completions. Pure.

``tool_choice``: ``"none"`` generates text (the tools are still shown to the model in the
prompt); a named function constrains the output to that function's ``parameters`` schema
and returns it as the call's arguments; ``"required"`` constrains it to a JSON array of
``{"name", "parameters"}`` calls of the given tools (vLLM's shape) and returns those calls;
``"auto"`` (the default when ``tools`` are given, as OpenAI's) lets the model choose: the
output is unconstrained, and it is returned as tool calls when it is such an array of
calls of the given tools (a served checkpoint's: ``<tool_call>`` blocks, the Hermes
format its template teaches), as text otherwise (vLLM's tool parsers decide the same
way). The constraint is structured output (shared/grammar.py), so a forced call parses
whatever the weights; one cut by max_tokens comes back as far as it got, with
finish_reason "length", as OpenAI returns a truncated call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from services.api_server.bodies import ChatBody, NamedToolChoice, Tool
from services.api_server.errors import ApiError

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(slots=True)
class ToolCall:
    mode: str                      # "named" | "required" | "auto"
    guide: list[str] | None        # [kind, text] for SamplingParams.guide (None: "auto" is free text)
    name: str | None = None        # the named function
    names: tuple[str, ...] = ()    # "auto", "required": the tools an output may call
    fmt: str = "json"              # "auto": how calls are written: "json" (the byte model's array) or
                                   # "hermes" (<tool_call>{"name", "arguments"}</tool_call>: a checkpoint's)


def _dumps(v: Any) -> str:
    # msgspec, not orjson: a request's JSON may hold integers past 64 bits, which it decoded
    return msgspec.json.encode(v).decode()


def tool_defs(tools: list[Tool] | None) -> list[dict[str, Any]]:
    """The tools as the prompt shows them (their shape is checked by bodies.Tool)."""
    return [{"name": t.function.name, "description": t.function.description,
             "parameters": t.function.parameters or ANY_OBJECT} for t in tools or ()]


def parse_tools(body: ChatBody, vocab: Any = None) -> tuple[list[dict[str, Any]], ToolCall | None]:
    """(the tools, to show in the prompt; the constraint, or None for text). ``vocab``: the
    served checkpoint's (shared/grammar.py Vocab) that a forced call compiles for; None = bytes."""
    tools = tool_defs(body.tools)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return tools, None
    if not tools:   # OpenAI's rule too: any choice but "none" names a tool that is not there
        raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if choice == "auto":
        return tools, ToolCall("auto", None, names=tuple(t["name"] for t in tools))
    if choice == "required":
        for i, t in enumerate(tools):
            _check_schema(i, t, vocab)
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                   "parameters": t["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1        # one call only (vLLM's reading of it)
        return tools, ToolCall("required", ["json", _dumps(schema)], names=tuple(t["name"] for t in tools))
    assert isinstance(choice, NamedToolChoice)   # the Struct allows nothing else
    name = choice.function.name
    match = next((t for t in tools if t["name"] == name), None)
    if match is None:
        raise ApiError(400, f"tool_choice names {name!r}, which is not in 'tools'", param="tool_choice")
    _check_schema(tools.index(match), match, vocab)
    return tools, ToolCall("named", ["json", _dumps(match["parameters"])], name)


def _check_schema(i: int, tool: dict[str, Any], vocab: Any = None) -> None:
    """A 400 naming the tool whose ``parameters`` cannot constrain the output (as
    ``response_format`` gets): the engine would otherwise find no token the broken grammar
    allows, and end the output empty with finish_reason "stop"."""
    from shared import grammar   # llguidance: only for requests that constrain
    why = grammar.check("json", _dumps(tool["parameters"]), vocab)
    if why is not None:
        raise ApiError(400, f"tool {tool['name']!r}: 'parameters' cannot be compiled: {why[:300]}",
                       param=f"tools[{i}].function.parameters")


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as a checkpoint's chat template gets them: OpenAI's function tools, as
    transformers' apply_chat_template(tools=...) passes them."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = t.function.parameters or ANY_OBJECT
        out.append({"type": "function", "function": fn})
    return out


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The tools as the byte-level chat template shows them, before the messages."""
    return "<|tools|>\n" + _dumps(tools) + "\n" if tools else ""


def render_calls(calls: Any) -> str:
    """An assistant turn's earlier ``tool_calls`` as text in the prompt."""
    fns = [c.get("function") for c in calls if isinstance(c, dict)]
    return _dumps([{"name": f.get("name"), "arguments": f.get("arguments")} if isinstance(f, dict)
                   else {"name": None, "arguments": None} for f in fns])


def arguments_parsed(call: Any) -> Any:
    """An earlier call with its JSON-text arguments as the object they spell (unchanged
    where they are not an object's JSON)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("arguments"), str)):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "chatcmpl-tool-" + uuid.uuid4().hex, "type": "function",
            "function": {"name": name, "arguments": arguments}}


_DECODER = json.JSONDecoder()   # not orjson: it reads an integer past 64 bits as a float
_WS = " \t\n\r"


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _raw_members(text: str, i: int) -> tuple[dict[str, str], int]:
    """The members of the JSON object starting at ``text[i]`` (``{``), each value as the
    text it was written in; and the index after the object. ValueError when it is none."""
    out: dict[str, str] = {}
    i = _skip(text, i + 1)
    if text[i:i + 1] == "}":
        return out, i + 1
    while True:
        key, i = _DECODER.raw_decode(text, _skip(text, i))
        i = _skip(text, i)
        if text[i:i + 1] != ":" or not isinstance(key, str):
            raise ValueError("not an object")
        start = _skip(text, i + 1)
        _, i = _DECODER.raw_decode(text, start)
        out[key] = text[start:i]
        i = _skip(text, i)
        if text[i:i + 1] == "}":
            return out, i + 1
        if text[i:i + 1] != ",":
            raise ValueError("not an object")
        i += 1


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def hermes_calls(tc: ToolCall, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(the text before the calls, or None where it is blank; the calls) of an output that
    holds ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the format of
    Qwen2.5/Qwen3, Hermes and most chat templates that show tools; None where it holds
    none, or one that is not a call of a given tool (then the whole output is text, as
    vLLM's hermes parser returns it). The last block may lack its closing tag (EOS)."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    calls = []
    i = start
    while i < len(text):
        i = _skip(text, i)
        if i >= len(text):
            break
        if not text.startswith(HERMES_OPEN, i):
            return None                              # text after a call: not a call turn
        body_at = i + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_at)
        body = text[body_at:end if end >= 0 else len(text)]
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        if not (isinstance(doc, dict) and doc.get("name") in tc.names and isinstance(doc.get("arguments"), dict)):
            return None
        members, _ = _raw_members(body, _skip(body, 0))   # the arguments as the model wrote them
        calls.append(_call(doc["name"], members["arguments"]))
        i = end + len(HERMES_CLOSE) if end >= 0 else len(text)
    before = text[:start]
    return (before if before.strip() else None), calls


def hermes_split(held: str, begun: bool) -> tuple[str, str, bool]:
    """"auto" with a checkpoint, streamed: (text to send now, text to hold, calls begun).
    Text streams until a ``<tool_call>`` tag; from the tag on everything is held to the
    end (then sent as calls, or as text where it does not parse); a tail that may be the
    tag's beginning is held until the next token says."""
    if begun:
        return "", held, True
    at = held.find(HERMES_OPEN)
    if at >= 0:
        return held[:at], held[at:], True
    for k in range(min(len(HERMES_OPEN) - 1, len(held)), 0, -1):
        if HERMES_OPEN.startswith(held[-k:]):
            return held[:-k], held[-k:], False
    return held, "", False


def calls_of(tc: ToolCall, text: str) -> list[dict[str, Any]] | None:
    """The tool calls in a finished output (None when it does not parse: cut by max_tokens,
    or for "auto" text that is not an array of calls of the given tools). Each call's
    arguments are its ``parameters`` as the model wrote them: parsed and dumped again,
    ``1e999`` came back as ``Infinity``, which is not JSON, and ``1.10`` as ``1.1``."""
    try:
        doc = json.loads(text)
        if tc.mode == "named":
            return [_call(tc.name or "", text)]
        if not isinstance(doc, list):
            return None
        if tc.mode == "auto" and not (doc and all(
                isinstance(c, dict) and c.keys() == {"name", "parameters"} and c["name"] in tc.names for c in doc)):
            return None   # text the model chose to write, even where it looks like JSON
        calls = []
        i = _skip(text, _skip(text, 0) + 1)   # after the array's "["
        for c in doc:
            if isinstance(c, dict):
                raw, i = _raw_members(text, i)
                if "name" in c and "parameters" in c:
                    calls.append(_call(c["name"], raw["parameters"]))
            else:
                _, i = _DECODER.raw_decode(text, i)
            i = _skip(text, _skip(text, i) + 1)   # past the ","
        return calls
    except (ValueError, IndexError):
        return None


def cut_calls(tc: ToolCall, text: str) -> list[dict[str, Any]]:
    """The calls of a forced output that max_tokens cut: the whole ones, then the cut one
    with its arguments as far as the model wrote them (OpenAI returns a truncated call the
    same way). A name cut short is the one tool it begins, or the call is left out."""
    if tc.mode == "named":
        return [_call(tc.name or "", text)]
    calls: list[dict[str, Any]] = []
    i = _skip(text, 0)
    if text[i:i + 1] != "[":
        return calls
    i = _skip(text, i + 1)
    while text[i:i + 1] == "{":
        try:
            raw, i = _raw_members(text, i)
        except (ValueError, IndexError):
            cut = _cut_call(text, i, tc.names)
            if cut is not None:
                calls.append(_call(*cut))
            return calls
        name = _string(raw.get("name"))
        if name is not None and "parameters" in raw:
            calls.append(_call(name, raw["parameters"]))
        i = _skip(text, i)
        if text[i:i + 1] != ",":
            return calls
        i = _skip(text, i + 1)
    return calls


def _string(raw: str | None) -> str | None:
    try:
        v = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return v if isinstance(v, str) else None


def _cut_call(text: str, i: int, names: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, the parameters' text up to the cut) of the object cut at ``text[i:]``."""
    name: str | None = None
    i = _skip(text, i + 1)
    while i < len(text):
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            break
        i = _skip(text, i)
        if text[i:i + 1] != ":":
            break
        start = _skip(text, i + 1)
        if key == "parameters":
            return (name, text[start:]) if name is not None else None
        try:
            value, i = _DECODER.raw_decode(text, start)
        except ValueError:
            if key == "name" and text[start:start + 1] == '"':     # the name itself was cut
                begun = [n for n in names if n.startswith(text[start + 1:])]
                name = begun[0] if len(begun) == 1 else None
            break
        if key == "name" and isinstance(value, str):
            name = value
        i = _skip(text, _skip(text, i) + 1)   # past the ","
    return (name, "") if name is not None else None


def message(tc: ToolCall, text: str, finish: str,
            harmony_calls: list[tuple[str, str]] | None = None) -> tuple[dict[str, Any], str]:
    """(the assistant message, finish_reason) of a tool-call output: content null with the
    calls ("tool_calls" for required and auto, "stop" for a named function, as vLLM); a
    forced output cut by max_tokens keeps its calls as far as they got ("length", content
    null); the text as content when it does not parse. gpt-oss's calls come told apart
    already (``harmony_calls``, shared/harmony.py), beside its answer ``text``."""
    if tc.fmt == "harmony":
        if not harmony_calls:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": text or None,
                "tool_calls": [_call(name, args) for name, args in harmony_calls]}, \
            "tool_calls" if finish == "stop" else finish
    if finish == "stop" and tc.fmt == "hermes":
        found = hermes_calls(tc, text)
        if found is not None:
            return {"role": "assistant", "content": found[0], "tool_calls": found[1]}, "tool_calls"
    elif finish == "stop":
        calls = calls_of(tc, text)
        if calls is not None:
            return {"role": "assistant", "content": None, "tool_calls": calls}, \
                "stop" if tc.mode == "named" else "tool_calls"
    elif finish == "length" and tc.mode != "auto":
        # never the constrained text itself: it is this server's format, not an answer
        calls = cut_calls(tc, text)
        return ({"role": "assistant", "content": None, "tool_calls": calls} if calls else
                {"role": "assistant", "content": None}), finish
    return {"role": "assistant", "content": text}, finish


def may_be_calls(text: str) -> bool:
    """"auto", streamed: could an output beginning with ``text`` still be tool calls? Only
    such a beginning is held back until the end; any other streams as text at once."""
    head = text.lstrip(_WS)
    return not head or head[0] == "["
