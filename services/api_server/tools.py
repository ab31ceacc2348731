"""Tool calling in /v1/chat/completions, as vLLM serves it without a tool parser. Pure.

``tool_choice``: ``"none"`` generates text (the tools are still shown to the model in the
prompt); a named function constrains the output to that function's ``parameters`` schema
and returns it as the call's arguments; ``"required"`` constrains it to a JSON array of
``{"name", "parameters"}`` calls of the given tools (vLLM's shape) and returns those calls;
``"auto"`` (the default when ``tools`` are given) needs a tool parser, which this server
does not have: a 400, as vLLM answers without ``--enable-auto-tool-choice``. The
constraint is structured output (shared/grammar.py), so the calls parse whatever the
weights.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from services.api_server.errors import ApiError

MAX_TOOLS = 128
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(slots=True)
class ToolCall:
    mode: str                      # "named" | "required"
    guide: list[str]               # [kind, text] for SamplingParams.guide
    name: str | None = None        # the named function


def _tools(body: dict) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                           param=f"tools[{i}]")
        params = f.get("parameters", ANY_OBJECT)
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema", param=f"tools[{i}]")
        out.append({"name": f["name"], "description": f.get("description"), "parameters": params or ANY_OBJECT})
    return out


def parse_tools(body: dict) -> tuple[list[dict[str, Any]], ToolCall | None]:
    """(the tools, to show in the prompt; the constraint, or None for text)."""
    tools = _tools(body)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return tools, None
    if choice == "auto":
        if not tools:
            return tools, None
        raise ApiError(400, "\"auto\" tool choice needs a tool call parser, which this server does not have (as "
                       "vLLM without --enable-auto-tool-choice); send tool_choice \"required\", a named function "
                       "or \"none\"", param="tool_choice")
    if not tools:
        raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                   "parameters": t["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1        # one call only (vLLM's reading of it)
        return tools, ToolCall("required", ["json", orjson.dumps(schema).decode()])
    f = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    match = next((t for t in tools if t["name"] == f["name"]), None)
    if match is None:
        raise ApiError(400, f"tool_choice names {f['name']!r}, which is not in 'tools'", param="tool_choice")
    return tools, ToolCall("named", ["json", orjson.dumps(match["parameters"]).decode()], f["name"])


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The tools as the byte-level chat template shows them, before the messages."""
    return "<|tools|>\n" + orjson.dumps(tools).decode() + "\n" if tools else ""


def render_calls(calls: Any) -> str:
    """An assistant turn's earlier ``tool_calls`` as text in the prompt."""
    return orjson.dumps([{"name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments")}
                         for c in calls if isinstance(c, dict)]).decode()


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "chatcmpl-tool-" + uuid.uuid4().hex, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def calls_of(tc: ToolCall, text: str) -> list[dict[str, Any]] | None:
    """The tool calls in a finished output (None when it does not parse: cut by max_tokens)."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if tc.mode == "named":
        return [_call(tc.name or "", text)]
    if not isinstance(doc, list):
        return None
    return [_call(c["name"], orjson.dumps(c["parameters"]).decode()) for c in doc
            if isinstance(c, dict) and "name" in c and "parameters" in c]


def message(tc: ToolCall, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """(the assistant message, finish_reason) of a tool-call output: content null with the
    calls ("tool_calls" for required, "stop" for a named function, as vLLM); the text as
    content when it does not parse."""
    calls = calls_of(tc, text) if finish == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls" if tc.mode == "required" else "stop"
