"""/v1/responses (OpenAI's Responses API, what the Agents SDK and newer clients call) as a
translation over /v1/chat/completions: the request becomes a chat request, which is
parsed, admitted, run, streamed and bounded exactly as one; its answer (a chat.completion,
or a chunk stream) becomes a ``response`` object or the Responses event stream. Pure: the
route (app.py) does the I/O.

Stateless, as a server without storage must be: ``previous_response_id`` and ``store:
true`` are 400s that say to send the conversation as ``input``; ``store`` comes back false.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from msgspec import Meta, Struct

from services.api_server.decode import BOM, decode
from services.api_server.errors import ApiError

MAX_INPUT_ITEMS = 4096


# vLLM's sampling and guidance fields, which its Responses route takes as chat does (its
# ResponsesRequest): passed to the chat request verbatim, so they take effect or are the
# chat route's 400 naming them. Benchmarks send them (guidellm: ignore_eos, stop).
PASSED_TO_CHAT = ("seed", "stop", "ignore_eos", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "bad_words",
                  "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "data_parallel_rank",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                  "structured_outputs", "chat_template_kwargs", "include_reasoning", "priority",
                  "truncate_prompt_tokens", "use_beam_search", "length_penalty", "logits_processors",
                  "return_tokens_as_token_ids")


class ResponsesBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields this server reads; vLLM's extras (PASSED_TO_CHAT) go on to the chat
    request, and any other is ignored and logged, as in the other routes."""
    model: str | None = None   # none: the served model, as in the other routes
    input: str | Annotated[list[dict[str, Any]], Meta(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    # known, not supported: accepted at their neutral value only (docs/api.md, the parameter rule)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    service_tier: str | None = None


@dataclass(slots=True)
class Translated:
    """What the answer needs from the request: its id, time and the fields a response
    object repeats."""
    id: str
    created_at: int
    echo: dict[str, Any]
    sources: list[str] = field(default_factory=list)   # per chat message, the Responses field it came from
    logprobs: bool = False
    ignored: tuple[str, ...] = ()      # unknown fields, ignored (logged by the route)
    seq: int = 0                       # sequence_number of the next stream event
    items: list[dict[str, Any]] = field(default_factory=list)   # streamed output items, in order
    text: list[str] = field(default_factory=list)               # the open message's text so far
    lp: list[Any] = field(default_factory=list)                 # its logprobs
    open_msg: int | None = None        # output index of the message item being streamed
    finish: str | None = None          # the chat stream's finish_reason
    calls: list[dict[str, Any]] = field(default_factory=list)   # streamed tool calls, until the finish
    open_rs: int | None = None         # output index of the reasoning item being streamed
    rs_text: list[str] = field(default_factory=list)            # its text so far


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or parts of type input_text / output_text (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or a list of input_text parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):   # a replayed answer's refusal
            out.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(400, f"'{where}[{j}]': {kind} is not supported: this server serves a text model",
                           param=f"{where}[{j}]", code="unsupported_parameter")
        else:
            raise ApiError(400, f"'{where}[{j}]' must be an input_text part ({{\"type\": \"input_text\", "
                           "\"text\": ...}})", param=f"{where}[{j}]")
    return "\n".join(out)


def _messages(b: ResponsesBody) -> tuple[list[dict[str, Any]], list[str]]:
    """(the chat messages, and for each the Responses field it came from: its errors' name)."""
    msgs: list[dict[str, Any]] = []
    sources: list[str] = []
    called: set[str] = set()
    thought: list[str] = []        # a reasoning item's text: the next assistant turn's reasoning
    if b.instructions:
        msgs.append({"role": "system", "content": b.instructions})
        sources.append("instructions")
    if isinstance(b.input, str):
        return [*msgs, {"role": "user", "content": b.input}], [*sources, "input"]
    for i, item in enumerate(b.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"'{where}.role' must be user, system, developer or assistant",
                               param=f"{where}.role")
            msgs.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
            sources.append(where)
            if role == "assistant" and thought:
                msgs[-1]["reasoning"], thought = "\n".join(thought), []
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"), item.get("arguments"))):
                raise ApiError(400, f"'{where}' needs call_id, name and arguments (strings)", param=where)
            called.add(call["id"])
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)        # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(where)
                if thought:
                    msgs[-1]["reasoning"], thought = "\n".join(thought), []
        elif kind == "function_call_output":
            out = item.get("output")
            if not isinstance(item.get("call_id"), str) or out is None:
                raise ApiError(400, f"'{where}' needs call_id and output", param=where)
            if item["call_id"] not in called:     # OpenAI's rule: an output answers a call in the input
                raise ApiError(400, f"'{where}.call_id': no function_call with call_id {item['call_id']!r} comes "
                               "before it in the input", param=f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": out if isinstance(out, str) else _text_of(out, f"{where}.output")})
            sources.append(where)
        elif kind == "reasoning":
            # a reasoning model's trace (its content, else its summary): the next assistant turn's
            # reasoning, which a checkpoint's template may show (as reasoning_content)
            parts = item.get("content") or item.get("summary") or []
            thought += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        else:
            raise ApiError(400, f"'{where}': input items of type {kind!r} are not supported (message, "
                           "function_call, function_call_output)", param=where, code="unsupported_parameter")
    return msgs, sources


def _tools(b: ResponsesBody) -> list[dict[str, Any]] | None:
    if not b.tools:
        return None
    out = []
    for i, t in enumerate(b.tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise ApiError(400, f"'tools[{i}]': only function tools are supported ({{\"type\": \"function\", "
                           "\"name\": ..., \"parameters\": ...}})", param=f"tools[{i}]", code="unsupported_parameter")
        fn = {"name": t["name"]}
        for k in ("description", "parameters"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, tools: list[Any] | None) -> Any:
    if not tools and choice in ("auto", "none"):
        return None     # a response object's own defaults ("auto", tools []) sent back: no tools
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"name\": ...}", param="tool_choice")


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    for k, v in (text or {}).items():
        if k not in ("format", "verbosity"):      # (verbosity: a hint, see _hints)
            raise ApiError(400, f"'text.{k}' is not a field of text (format, verbosity)", param=f"text.{k}")
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError(400, "'text.format' must be an object: {\"type\": \"text\" | \"json_object\" | "
                       "\"json_schema\", ...}", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise ApiError(400, "'text.format.name' is required for json_schema", param="text.format.name")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise ApiError(400, "'text.format.type' must be text, json_object or json_schema", param="text.format")


LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NEUTRAL = {"background": (None, False), "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
            "service_tier": (None, "auto", "default")}
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"


def _hints(b: ResponsesBody) -> list[str]:
    """Fields that ask for what this server cannot give but that change no answer it gives,
    accepted and logged as vLLM's Responses route accepts them (Codex-style clients send
    them at every call; they were 400s): ``store`` true (nothing is kept: the response says
    store false, and previous_response_id stays a 400), a reasoning summary or encrypted
    reasoning (none is made), ``text.verbosity`` (the model has one length) and
    ``truncation`` "auto" (an input past the context is still the usual 400)."""
    out = []
    if b.store:
        out.append("store")
    out += [f"reasoning.{k}" for k, v in (b.reasoning or {}).items() if k != "effort" and v is not None]
    if ENCRYPTED_INCLUDE in (b.include or ()):
        out.append(f"include.{ENCRYPTED_INCLUDE}")
    if (b.text or {}).get("verbosity") not in (None, "medium"):
        out.append("text.verbosity")
    if b.truncation == "auto":
        out.append("truncation")
    return out


def _neutral_only(b: ResponsesBody) -> None:
    """The parameter rule: a parameter takes effect or is a 400 (docs/api.md)."""
    for name, neutral in _NEUTRAL.items():
        v = getattr(b, name)
        if v not in neutral:
            why = {"background": "responses run in the foreground here"}.get(name, "not supported yet")
            raise ApiError(400, f"'{name}': {why}; send {orjson.dumps(neutral[-1]).decode()} or leave it out",
                           param=name, code="unsupported_parameter")
    for k in b.reasoning or {}:
        if k not in ("effort", "summary", "generate_summary"):
            raise ApiError(400, f"'reasoning.{k}' is not a field of reasoning (effort, summary)",
                           param=f"reasoning.{k}")
    for i, inc in enumerate(b.include or ()):
        if inc not in (LOGPROBS_INCLUDE, ENCRYPTED_INCLUDE):
            raise ApiError(400, f"'include[{i}]': only {LOGPROBS_INCLUDE!r} (and {ENCRYPTED_INCLUDE!r}, which "
                           "gives nothing: no reasoning is encrypted here) is supported", param=f"include[{i}]",
                           code="unsupported_parameter")


def to_chat(raw: bytes) -> tuple[bytes, Translated]:
    """The chat request that answers a Responses request (bytes for protocol.parse), and
    what the answer needs. ApiError (naming the Responses field) for what cannot be served."""
    b, unknown = decode(raw, ResponsesBody)
    if b.previous_response_id is not None:
        raise ApiError(400, "'previous_response_id': this server keeps no responses; send the conversation "
                       "so far as 'input' (its items, then the new turn)", param="previous_response_id",
                       code="unsupported_parameter")
    _neutral_only(b)
    messages, sources = _messages(b)
    chat: dict[str, Any] = {"model": b.model, "messages": messages}
    for name, v in (("max_completion_tokens", b.max_output_tokens), ("temperature", b.temperature),
                    ("top_p", b.top_p), ("tools", _tools(b)), ("tool_choice", _tool_choice(b.tool_choice, b.tools)),
                    ("parallel_tool_calls", b.parallel_tool_calls), ("response_format", _format(b.text)),
                    ("user", b.user), ("reasoning_effort", (b.reasoning or {}).get("effort"))):
        if v is not None:
            chat[name] = v
    logprobs = b.top_logprobs is not None or LOGPROBS_INCLUDE in (b.include or ())
    if logprobs:
        chat["logprobs"], chat["top_logprobs"] = True, b.top_logprobs or 0
    if b.stream:
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    if unknown:
        doc = orjson.loads(bytes(raw).removeprefix(BOM)) if isinstance(raw, (bytes, bytearray, memoryview)) else \
            orjson.loads(raw) if isinstance(raw, str) else raw
        chat.update({k: doc[k] for k in unknown if k in PASSED_TO_CHAT})
        unknown = tuple(k for k in unknown if k not in PASSED_TO_CHAT)
    echo = {"instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {}, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p, "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [], "text": b.text or {"format": {"type": "text"}}, "user": b.user,
            "top_logprobs": b.top_logprobs}
    return orjson.dumps(chat), Translated("resp_" + uuid.uuid4().hex, int(time.time()), echo, sources, logprobs,
                                          ignored=(*unknown, *_hints(b)))


_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "top_logprobs": "top_logprobs", "reasoning_effort": "reasoning.effort"}


def rename_error(exc: ApiError, t: Translated) -> ApiError:
    """A chat request's 400 in the Responses request's words: ``messages[i]`` is the input
    item (or the instructions) it came from, max_tokens is max_output_tokens."""
    p = exc.param
    if p is None:
        return exc
    if p.startswith("messages"):
        head, _, rest = p.partition("]")
        try:
            source = t.sources[int(head[len("messages["):])]
        except (ValueError, IndexError):
            source = "input"
        exc.param = source + (rest if source.startswith("input[") else "")
        exc.message = exc.message.replace(p, exc.param)
    elif p.startswith("tools[") and ".function" in p:    # the chat shape nests what Responses does not
        exc.message = exc.message.replace(p, p.replace(".function", "", 1))
        exc.param = p.replace(".function", "", 1)
    elif p in _PARAMS:
        exc.message = exc.message.replace(f"'{p}'", f"'{_PARAMS[p]}'")
        exc.param = _PARAMS[p]
    return exc


# --- the answer -------------------------------------------------------------------------

def _usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": (u.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": u["total_tokens"]}


def _response(t: Translated, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              finish: str | None = None, error: dict[str, Any] | None = None, model: str = "") -> dict[str, Any]:
    return {"id": t.id, "object": "response", "created_at": t.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "model": model, "output": output, "previous_response_id": None, "reasoning": None,
            "service_tier": "default", "store": False, "truncation": "disabled", "usage": _usage(usage),
            **t.echo}


def _message_item(text: str, status: str = "completed", lp: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": lp or []}]}


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking (told from its answer by the server's reasoning parser)."""
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": status}


def _call_item(call: dict[str, Any], finish: str | None) -> dict[str, Any]:
    """A call cut by max_output_tokens is ``incomplete``, as OpenAI marks it: an agent loop
    must not run a tool on its cut arguments. Only the last call of an answer can be cut
    (the callers pass ``finish`` for it alone): the whole calls before it stand."""
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "incomplete" if finish == "length" else "completed"}


def from_chat(body: dict[str, Any], t: Translated) -> dict[str, Any]:
    """The ``response`` object of a finished chat.completion."""
    choice = body["choices"][0]
    msg, finish = choice["message"], choice["finish_reason"]
    output = []
    if msg.get("reasoning"):
        output.append(_reasoning_item(msg["reasoning"]))
    if msg.get("content") or not msg.get("tool_calls"):
        lp = (choice.get("logprobs") or {}).get("content") if t.logprobs else None
        output.append(_message_item(msg.get("content") or "", "incomplete" if finish == "length" else "completed", lp))
    calls = msg.get("tool_calls") or []
    output += [_call_item(c, finish if i == len(calls) - 1 else None) for i, c in enumerate(calls)]
    return _response(t, "incomplete" if finish == "length" else "completed", output, body.get("usage"), finish,
                     model=body["model"])


def _event(t: Translated, kind: str, **fields: Any) -> bytes:
    data = {"type": kind, "sequence_number": t.seq, **fields}
    t.seq += 1
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _reasoning_delta(t: Translated, text: str) -> list[bytes]:
    out = []
    if t.open_rs is None:
        t.open_rs = len(t.items)
        item = _reasoning_item("", "in_progress")
        item["content"] = []
        t.items.append(item)
        out += [_event(t, "response.output_item.added", output_index=t.open_rs, item=item),
                _event(t, "response.content_part.added", item_id=item["id"], output_index=t.open_rs,
                       content_index=0, part={"type": "reasoning_text", "text": ""})]
    t.rs_text.append(text)
    out.append(_event(t, "response.reasoning_text.delta", item_id=t.items[t.open_rs]["id"],
                      output_index=t.open_rs, content_index=0, delta=text))
    return out


def _close_reasoning(t: Translated) -> list[bytes]:
    if t.open_rs is None:
        return []
    i, text = t.open_rs, "".join(t.rs_text)
    item = t.items[i]
    part = {"type": "reasoning_text", "text": text}
    item["status"], item["content"] = "completed", [part]
    t.open_rs, t.rs_text = None, []
    ids = {"item_id": item["id"], "output_index": i, "content_index": 0}
    return [_event(t, "response.reasoning_text.done", **ids, text=text),
            _event(t, "response.content_part.done", **ids, part=part),
            _event(t, "response.output_item.done", output_index=i, item=item)]


def _open_message(t: Translated) -> list[bytes]:
    """A message item begins: its added events (its text follows as deltas)."""
    out = _close_reasoning(t)      # the thinking ends where the answer begins
    t.open_msg = len(t.items)
    item = _message_item("", "in_progress")
    t.items.append(item)
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return out + [_event(t, "response.output_item.added", output_index=t.open_msg, item=item),
                  _event(t, "response.content_part.added", item_id=item["id"], output_index=t.open_msg,
                         content_index=0, part=part)]


def _close_message(t: Translated, status: str) -> list[bytes]:
    if t.open_msg is None:
        return []
    i, text = t.open_msg, "".join(t.text)
    item = t.items[i]
    item["status"] = status
    part = item["content"][0]
    part["text"], part["logprobs"] = text, list(t.lp)
    t.open_msg, t.text, t.lp = None, [], []
    ids = {"item_id": item["id"], "output_index": i, "content_index": 0}
    return [_event(t, "response.output_text.done", **ids, text=text, logprobs=part["logprobs"]),
            _event(t, "response.content_part.done", **ids, part=part),
            _event(t, "response.output_item.done", output_index=i, item=item)]


def _calls(t: Translated) -> list[bytes]:
    out: list[bytes] = _close_reasoning(t)
    for k, call in enumerate(t.calls):
        out += _close_message(t, "completed")
        item = _call_item(call, t.finish if k == len(t.calls) - 1 else None)
        i = len(t.items)
        t.items.append(item)
        out += [_event(t, "response.output_item.added", output_index=i, item={**item, "arguments": "",
                                                                              "status": "in_progress"})]
        if item["arguments"]:
            out.append(_event(t, "response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                              delta=item["arguments"]))
        out += [_event(t, "response.function_call_arguments.done", item_id=item["id"], output_index=i,
                       arguments=item["arguments"], name=item["name"]),
                _event(t, "response.output_item.done", output_index=i, item=item)]
    t.calls = []
    return out


def stream_events(chunk: dict[str, Any], t: Translated, model: str) -> list[bytes]:
    """The Responses events for one chat.completion.chunk (or error) of the stream."""
    if "error" in chunk:                      # the chat stream's error event (timeout, engine error)
        out = _close_reasoning(t) + _close_message(t, "incomplete")
        err = chunk["error"]
        failed = _response(t, "failed", t.items, None, error={"code": err.get("code") or "server_error",
                                                              "message": err.get("message", "")}, model=model)
        return out + [_event(t, "response.failed", response=failed)]
    out: list[bytes] = []
    if t.seq == 0:
        skeleton = _response(t, "in_progress", [], None, model=model)
        out += [_event(t, "response.created", response=skeleton), _event(t, "response.in_progress", response=skeleton)]
    for c in chunk.get("choices") or ():
        delta = c.get("delta") or {}
        if delta.get("reasoning"):
            out += _reasoning_delta(t, delta["reasoning"])
        text = delta.get("content")
        if text:
            if t.open_msg is None:
                out += _open_message(t)
            lp = ((c.get("logprobs") or {}).get("content") or []) if t.logprobs else []
            t.text.append(text)
            t.lp += lp
            out.append(_event(t, "response.output_text.delta", item_id=t.items[t.open_msg]["id"],
                              output_index=t.open_msg, content_index=0, delta=text, logprobs=lp))
        t.calls += delta.get("tool_calls") or ()      # sent at the finish: their status needs it
        if c.get("finish_reason") is not None:
            t.finish = c["finish_reason"]
            out += _calls(t)
    if chunk.get("usage") is not None and not chunk.get("choices"):   # the last chunk: include_usage
        finish = t.finish
        out += _close_reasoning(t)
        if t.open_msg is None and not any(i["type"] != "reasoning" for i in t.items):
            out += _open_message(t)            # an empty answer is still a message
        out += _close_message(t, "incomplete" if finish == "length" else "completed")
        status = "incomplete" if finish == "length" else "completed"
        done = _response(t, status, t.items, chunk["usage"], finish, model=model)
        out.append(_event(t, "response.incomplete" if status == "incomplete" else "response.completed",
                          response=done))
    return out
