"""Parse and validate OpenAI request bodies into one internal shape (pure, no I/O).

Hand-written rather than pydantic models: it is on the hot path of every request, and
it lets every message say exactly what is wrong and which parameter it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.api_server.errors import ApiError
from shared.messages import SamplingParams
from shared.tokenizer import encode

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 64


_COMMON: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean"},
    "n": {"type": "integer", "enum": [1]},
    "data_parallel_rank": {"type": "integer", "minimum": 0},
    "user": {"type": "string"},
}
COMPLETION_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "prompt"],
    "properties": {**_COMMON, "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
                   "echo": {"type": "boolean"}, "logprobs": {"type": "null"}},
}
CHAT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "messages"],
    "properties": {**_COMMON, "max_completion_tokens": {"type": "integer", "minimum": 1},
                   "messages": {"type": "array", "minItems": 1, "items": {
                       "type": "object", "required": ["role", "content"],
                       "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                                      "content": {"type": "string"}}}}},
}


def openapi_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body this module parses by hand."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@dataclass(slots=True)
class ParsedRequest:
    kind: str                      # "completion" | "chat"
    model: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    rank: int | None
    echo: bool = False
    prompt_text: str = ""


def chat_template(messages: list[dict[str, Any]]) -> str:
    """The model's chat format: role tags on their own lines, then the assistant's turn."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def _num(body: dict, name: str, typ: type, default: Any, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not isinstance(v, int)):
        want = "an integer" if typ is int else "a number"
        raise ApiError(400, f"'{name}' must be {want}, got {type(v).__name__}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(400, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise ApiError(400, f"'{name}' must be <= {hi}, got {v}", param=name)
    return typ(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean", param=name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(not s or len(s.encode()) > MAX_STOP_LEN for s in stops):
        raise ApiError(400, f"each stop string must be 1..{MAX_STOP_LEN} bytes", param="stop")
    return stops


def _unsupported(body: dict, chat: bool) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "'n' > 1 is not supported yet; send n separate requests", param="n")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "'best_of' is not supported", param="best_of")
    if chat:
        if body.get("tools") or body.get("tool_choice") not in (None, "none") or body.get("functions"):
            raise ApiError(400, "tools and function calling are not supported yet", param="tools")
        if body.get("logprobs") or body.get("top_logprobs"):
            raise ApiError(400, "'logprobs' is not supported yet", param="logprobs")
    elif body.get("logprobs") is not None:
        raise ApiError(400, "'logprobs' is not supported yet", param="logprobs")


def _prompt_tokens(prompt: Any) -> tuple[list[int], str]:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t > 255 for t in prompt):
            raise ApiError(400, "token ids must be bytes (0..255) for this byte-level model", param="prompt")
        return list(prompt), bytes(prompt).decode("utf-8", errors="replace")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "batched prompts are not supported yet; send one prompt per request", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role {m['role']!r} is not supported", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def parse(body: Any, kind: str, *, served_model: str, max_model_len: int, num_ranks: int,
          header_rank: str | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    chat = kind == "chat"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model")
    if model != served_model:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    _unsupported(body, chat)
    if chat:
        text = chat_template(_messages(body))
        prompt = encode(text)
    else:
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", param="prompt")
        prompt, text = _prompt_tokens(body["prompt"])
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_model_len - len(prompt)
    max_tokens = _num(body, max_name, int, None, lo=1)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = len(prompt) + (max_tokens or 1)
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{asked} tokens ({len(prompt)} in the prompt, {max_tokens or 1} for the completion). "
                       "Please reduce the prompt or the completion length.", param=max_name,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", float, 1.0, lo=0.0, hi=2.0),
        top_p=_num(body, "top_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True),
        seed=_num(body, "seed", int, None),
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    if include_usage and not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    rank_raw = body.get("data_parallel_rank", header_rank)
    rank = None
    if rank_raw is not None:
        try:
            rank = int(rank_raw)
            if isinstance(rank_raw, bool) or isinstance(rank_raw, float):
                raise ValueError
        except (TypeError, ValueError):
            raise ApiError(400, "'data_parallel_rank' must be an integer", param="data_parallel_rank") from None
        if not 0 <= rank < num_ranks:
            raise ApiError(400, f"data_parallel_rank {rank} does not exist: this cluster has ranks 0..{num_ranks - 1}",
                           param="data_parallel_rank")
    return ParsedRequest(kind=kind, model=model, prompt=prompt, params=params, stream=stream,
                         include_usage=include_usage, rank=rank, echo=bool(body.get("echo")) and not chat,
                         prompt_text=text)
