"""Parse and validate OpenAI request bodies into one internal shape (pure, no I/O).

Hand-written rather than pydantic models: it is on the hot path of every request, and
it lets every message say exactly what is wrong and which parameter it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from services.api_server import tools
from services.api_server.errors import ApiError
from shared.messages import SamplingParams
from services.api_server import hf_text
from shared.tokenizer import BOS, EOS, VOCAB_SIZE, StreamDecoder, encode

MAX_STOP_STRINGS = 64       # vLLM has no limit; a bound still (each costs an endswith per token)
MAX_STOP_LEN = 1024
MAX_LOGPROBS = 20          # as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 128          # engine requests one HTTP request may make: prompts x max(n, best_of)


# Parameters that this server knows but does not implement yet. Each is accepted only at
# its neutral value (the one that changes nothing); anything else is a 400 that names the
# field (docs/api.md). name -> (neutral values, JSON schema of the neutral values).
_NEUTRAL: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "bad_words": (([],), {"type": "array", "maxItems": 0}),
    "include_stop_str_in_output": ((False,), {"type": "boolean", "enum": [False]}),
    "skip_special_tokens": ((True,), {"type": "boolean", "enum": [True]}),
}
_NEUTRAL_COMPLETION: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    **_NEUTRAL,
    "suffix": (("",), {"type": "string", "maxLength": 0}),
}
_NEUTRAL_CHAT: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    **_NEUTRAL,
    "functions": (([],), {"type": "array", "maxItems": 0}),
    "function_call": (("none",), {"type": "string", "enum": ["none"]}),
    "modalities": ((["text"],), {"type": "array", "items": {"type": "string", "enum": ["text"]}, "maxItems": 1}),
    "audio": ((), {"type": "null"}),
    "prediction": ((), {"type": "null"}),
    "reasoning_effort": ((), {"type": "null"}),
    "web_search_options": ((), {"type": "null"}),
    "store": ((False,), {"type": "boolean", "enum": [False]}),
}
_WHY = {"functions": "use 'tools' and 'tool_choice'", "function_call": "use 'tools' and 'tool_choice'"}

# Accepted and informational only: they never change the output (docs/api.md).
_INFORMATIONAL = {"user": {"type": "string"}, "metadata": {"type": "object"}, "service_tier": {"type": "string"}}

_COMMON: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"},
                                                        "continuous_usage_stats": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean"},
    "top_k": {"type": "integer", "minimum": -1, "description": "-1 or 0: no cut"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "data_parallel_rank": {"type": "integer", "minimum": 0},
    "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id (as a string) -> bias added to its logit"},
    "min_tokens": {"type": "integer", "minimum": 0, "description": "at most max_tokens"},
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
    "guided_json": {"anyOf": [{"type": "object"}, {"type": "string"}], "description": "a JSON schema"},
    "guided_regex": {"type": "string"},
    "guided_choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "guided_grammar": {"type": "string", "description": "a Lark or GBNF grammar"},
    "structured_outputs": {"type": "object", "description": "exactly one of json, regex, choice, grammar, json_object",
                           "properties": {"json": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                                          "regex": {"type": "string"},
                                          "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                                          "grammar": {"type": "string"}, "json_object": {"type": "boolean"}}},
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                        "description": "vLLM's: each prompt token's logprob and the top k (not with stream)"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
    "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                "description": "candidates per prompt (>= n), the n with the highest cumulative logprob are returned"},
    "stop_token_ids": {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
                       "items": {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}},
    **_INFORMATIONAL,
}
_UNSUPPORTED_NOTE = "not supported yet: only the neutral value shown is accepted; any other value is a 400"


def _neutral_schemas(table: dict[str, tuple[tuple[Any, ...], dict[str, Any]]]) -> dict[str, Any]:
    return {k: {**schema, "description": _UNSUPPORTED_NOTE} for k, (_, schema) in table.items()}


COMPLETION_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "prompt"],
    "properties": {**_COMMON, **_neutral_schemas(_NEUTRAL_COMPLETION),
                   "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_CHOICES},
                                        {"type": "array", "maxItems": MAX_CHOICES,
                                         "items": {"type": "array", "items": {"type": "integer"}}}]},
                   "echo": {"type": "boolean"},
                   "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                   "max_tokens": {"type": "integer", "minimum": 0,
                                  "description": "0 only with echo: the prompt (and its logprobs) alone"}},
    "additionalProperties": True,
    "description": "Unknown fields are ignored (logged once per field name at warning level); see docs/api.md.",
}
CHAT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "messages"],
    "properties": {**_COMMON, **_neutral_schemas(_NEUTRAL_CHAT),
                   "max_completion_tokens": {"type": "integer", "minimum": 1},
                   "tools": {"type": "array", "maxItems": 128, "items": {
                       "type": "object", "required": ["type", "function"],
                       "properties": {"type": {"type": "string", "enum": ["function"]},
                                      "function": {"type": "object", "required": ["name"],
                                                   "properties": {"name": {"type": "string"},
                                                                  "description": {"type": "string"},
                                                                  "parameters": {"type": "object"}}}}}},
                   "parallel_tool_calls": {"type": "boolean",
                                           "description": "false: tool_choice \"required\" makes one call"},
                   "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                             {"type": "object", "required": ["type", "function"],
                                              "properties": {"type": {"type": "string", "enum": ["function"]},
                                                             "function": {"type": "object", "required": ["name"],
                                                                          "properties": {"name": {"type": "string"}}}}}],
                                   "description": "\"auto\" needs a tool parser: a 400 here, as vLLM without one"},
                   "logprobs": {"type": "boolean"},
                   "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                   "messages": {"type": "array", "minItems": 1, "items": {
                       "type": "object", "required": ["role"],
                       "properties": {"role": {"type": "string",
                                               "enum": ["system", "developer", "user", "assistant", "tool"]},
                                      "content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                      "tool_calls": {"type": "array"}, "tool_call_id": {"type": "string"}}}}},
    "additionalProperties": True,
    "description": "Unknown fields are ignored (logged once per field name at warning level); see docs/api.md.",
}
KNOWN_COMPLETION = frozenset(COMPLETION_SCHEMA["properties"])
KNOWN_CHAT = frozenset(CHAT_SCHEMA["properties"])


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
    logprobs: int | None = None    # completions: top k (the sampled token's always); chat: top_logprobs
    drop_output: bool = False      # echo with max_tokens 0: one token is generated and not shown
    prompts: list[tuple[list[int], str]] | None = None   # batched completions: every prompt (and text)
    n: int = 1
    best_of: int = 1
    best_of_lp: bool = False       # logprobs asked only to rank best_of candidates: not shown
    tool_call: Any = None          # tools.ToolCall: the output is tool calls (chat)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    prompt_logprobs: int | None = None   # vLLM's prompt_logprobs: top k per prompt token

    @property
    def multi(self) -> bool:
        """More than one engine request answers this one, or streamed tool calls (multi.py)."""
        return self.n > 1 or self.best_of > 1 or self.prompts is not None or (self.stream and self.tool_call is not None)
    ignored: tuple[str, ...] = ()  # unknown top-level fields, ignored (docs/api.md)
    tok: Any = None                # a served checkpoint's tokenizer (None: bytes)

    def decoder(self) -> Any:
        """A streaming detokenizer of this request's model."""
        return self.tok.stream_decoder() if self.tok is not None else StreamDecoder()


def chat_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The model's chat format: role tags on their own lines, then the assistant's turn."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}" \
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"


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


def _logit_bias(body: dict, vocab: int = VOCAB_SIZE) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise ApiError(400, f"'logit_bias' key {k!r} is not a token id", param="logit_bias") from None
        if not 0 <= t < vocab:
            raise ApiError(400, f"'logit_bias' token {t} is outside 0..{vocab - 1}", param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise ApiError(400, f"'logit_bias' of token {t} must be a number in -100..100", param="logit_bias")
        if b:
            out[t] = float(b)
    return out


def _stop_token_ids(body: dict, vocab: int = VOCAB_SIZE) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ApiError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
    if any(not 0 <= t < vocab for t in v):
        raise ApiError(400, f"'stop_token_ids' must be within 0..{vocab - 1}", param="stop_token_ids")
    return sorted(set(v))


ANY_JSON_OBJECT = '{"type": "object"}'


def _guide_of(name: str, kind: str, v: Any) -> list[str]:
    """[kind, text] of one structured-output field's value."""
    if kind == "json":
        if isinstance(v, dict):
            return ["json", orjson.dumps(v).decode()]
        if isinstance(v, str):
            return ["json", v]
        raise ApiError(400, f"'{name}' must be a JSON schema (an object)", param=name)
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
            raise ApiError(400, f"'{name}' must be a non-empty list of non-empty strings", param=name)
        return ["choice", orjson.dumps(v).decode()]
    if not isinstance(v, str) or not v:
        raise ApiError(400, f"'{name}' must be a non-empty string", param=name)
    return [kind, v]


def guide(body: dict) -> tuple[str, list[str]] | None:
    """(the field that asked, [kind, text]) of the request's structured output, checked
    by compiling it (shared/grammar.py); None without one. One field at most."""
    from shared import grammar
    found: list[tuple[str, list[str]]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ApiError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           param="response_format")
        if rf["type"] == "json_object":
            found.append(("response_format", ["json", ANY_JSON_OBJECT]))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema",
                               param="response_format")
            found.append(("response_format", _guide_of("response_format", "json", js["schema"])))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            found.append((name, _guide_of(name, kind, body[name])))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(400, "'structured_outputs' must be an object", param="structured_outputs")
        asked = [(k, v) for k, v in so.items() if v is not None and v is not False]
        if len(asked) != 1 or asked[0][0] not in ("json", "regex", "choice", "grammar", "json_object"):
            raise ApiError(400, "'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object",
                           param="structured_outputs")
        k, v = asked[0]
        found.append(("structured_outputs", ["json", ANY_JSON_OBJECT] if k == "json_object"
                      else _guide_of("structured_outputs", k, v)))
    if not found:
        return None
    if len(found) > 1:
        raise ApiError(400, f"'{found[1][0]}' and '{found[0][0]}' both ask for structured output; send one",
                       param=found[1][0])
    name, g = found[0]
    why = grammar.check(*g)
    if why is not None:
        raise ApiError(400, f"'{name}' cannot be compiled: {why[:300]}", param=name)
    return name, g


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives per token (None: no logprobs)."""
    if chat:
        on = _bool(body, "logprobs", False)
        k = _num(body, "top_logprobs", int, None, lo=0, hi=MAX_LOGPROBS)
        if k is not None and k > 0 and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (k or 0) if on else None
    return _num(body, "logprobs", int, None, lo=0, hi=MAX_LOGPROBS)


def _is_neutral(v: Any, neutral: tuple[Any, ...]) -> bool:
    if v is None:
        return True
    for n in neutral:
        if type(v) is bool or type(n) is bool:
            if v is n:
                return True
        elif v == n:
            return True
    return False


def _unsupported(body: dict, chat: bool) -> None:
    """A known parameter at a non-neutral value is refused, naming the field."""
    table = _NEUTRAL_CHAT if chat else _NEUTRAL_COMPLETION
    for name, (neutral, _) in table.items():
        if name in body and not _is_neutral(body[name], neutral):
            why = _WHY.get(name)
            raise ApiError(400, f"'{name}' is not supported yet by this server (only the neutral value "
                           f"{'null' if not neutral else ' or '.join(_show(n) for n in neutral)} is accepted)"
                           + (f"; {why}" if why else ""), param=name, code="unsupported_parameter")


def _show(v: Any) -> str:
    return orjson.dumps(v).decode()


def unknown_fields(body: dict, kind: str) -> list[str]:
    """Top-level fields this server does not know: ignored, as vLLM does (docs/api.md)."""
    known = KNOWN_CHAT if kind == "chat" else KNOWN_COMPLETION
    return [k for k in body if k not in known]


def _prompts(prompt: Any, one: Callable[[Any], tuple[list[int], str]]) -> list[tuple[list[int], str]]:
    """A completion's prompt(s): a string, a token list, or a list of either (batched);
    ``one`` turns one prompt into (tokens, text)."""
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        if len(prompt) > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} prompts in one request", param="prompt")
        out = []
        for i, x in enumerate(prompt):
            try:
                out.append(one(x))
            except ApiError as exc:
                raise ApiError(400, f"prompt[{i}]: {exc.message}", param="prompt") from None
        return out
    return [one(prompt)]


def _prompt_tokens(prompt: Any) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        return encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t > 255 for t in prompt):
            raise ApiError(400, "token ids must be bytes (0..255) for this byte-level model", param="prompt")
        return list(prompt), bytes(prompt).decode("utf-8", errors="replace")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role {m['role']!r} is not supported", param=f"messages[{i}].role")
        content = m.get("content")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
        if content is None and m["role"] == "assistant":
            # an assistant turn that called tools: the calls are its text in the prompt
            content = tools.render_calls(calls) if calls else ""
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
        if calls:
            out[-1]["tool_calls"] = calls
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            out[-1]["tool_call_id"] = m["tool_call_id"]
    return out


def parse(body: Any, kind: str, *, served_model: str, max_model_len: int, num_ranks: int,
          header_rank: str | None = None, tok: Any = None) -> ParsedRequest:
    """``tok``: a served checkpoint's tokenizer (shared/hf_tokenizer.py); None = bytes."""
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
    tool_defs, tool_call = tools.parse_tools(body) if chat else ([], None)
    batch: list[tuple[list[int], str]] = []
    if chat and tok is not None:
        text, prompt = hf_text.chat_prompt(tok, _messages(body))
    elif chat:
        text = tools.tools_block(tool_defs) + chat_template(_messages(body))
        prompt = encode(text)
    else:
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", param="prompt")
        batch = _prompts(body["prompt"], _prompt_tokens if tok is None else partial(hf_text.completion_prompt, tok))
        if any(not toks for toks, _ in batch):
            raise ApiError(400, "the prompt is empty", param="prompt")
        prompt, text = max(batch, key=lambda pt: len(pt[0]))   # the room check below takes the longest
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_model_len - len(prompt)
    echo = bool(body.get("echo")) and not chat
    max_tokens = _num(body, max_name, int, None, lo=0 if echo else 1)
    drop_output = max_tokens == 0          # echo only: the engine makes one token, not shown
    if drop_output:
        max_tokens = 1
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
        top_k=_num(body, "top_k", int, -1, lo=-1),
        min_p=_num(body, "min_p", float, 0.0, lo=0.0, hi=1.0),
        presence_penalty=_num(body, "presence_penalty", float, 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_num(body, "frequency_penalty", float, 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_num(body, "repetition_penalty", float, 1.0, lo=0.0, hi=2.0, lo_open=True),
    )
    lp = _logprobs(body, chat)
    params.logprobs = lp
    if echo and lp is not None:
        params.prompt_logprobs = lp
    plp = _num(body, "prompt_logprobs", int, None, lo=0, hi=MAX_LOGPROBS)
    if plp is not None:
        if _bool(body, "stream", False):
            raise ApiError(400, "'prompt_logprobs' cannot be streamed", param="prompt_logprobs")
        params.prompt_logprobs = max(plp, params.prompt_logprobs or 0)
    vocab = VOCAB_SIZE if tok is None else tok.vocab_size
    params.logit_bias = _logit_bias(body, vocab)
    params.stop_token_ids = _stop_token_ids(body, vocab)
    if tok is not None:
        hf_text.checkpoint_stops(params, tok)
    params.min_tokens = _num(body, "min_tokens", int, 0, lo=0)
    if params.min_tokens > params.max_tokens:
        raise ApiError(400, f"'min_tokens' ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})",
                       param="min_tokens")
    g = guide(body)
    if tool_call is not None:
        if g is not None:
            raise ApiError(400, f"'{g[0]}' cannot be combined with tool_choice {_show(body.get('tool_choice'))}",
                           param=g[0])
        g = ("tool_choice", tool_call.guide)
    if g is not None and tok is not None:
        raise ApiError(400, f"'{g[0]}' is not supported yet when serving a checkpoint (its grammar is built for the "
                       "byte-level model's tokens)", param=g[0], code="unsupported_parameter")
    if g is not None:
        # a finished grammar allows only EOS: both would make it unreachable
        for name, on in (("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens > 0)):
            if on:
                raise ApiError(400, f"'{name}' cannot be combined with structured output ('{g[0]}')", param=name)
        params.guide = g[1]
    stream = _bool(body, "stream", False)
    n = _num(body, "n", int, 1, lo=1, hi=MAX_CHOICES)
    best_of = _num(body, "best_of", int, n, lo=1, hi=MAX_CHOICES)
    if best_of < n:
        raise ApiError(400, f"'best_of' ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > n and stream:
        raise ApiError(400, "'best_of' greater than n cannot be streamed", param="best_of")
    prompts = batch if len(batch) > 1 else None
    if (len(prompts) if prompts else 1) * best_of > MAX_CHOICES:
        raise ApiError(400, f"prompts x best_of (or n) must be at most {MAX_CHOICES}", param="n")
    best_of_lp = best_of > n and params.logprobs is None
    if best_of_lp:
        params.logprobs = 0        # the candidates are ranked by their cumulative logprob
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    # vLLM's: usage in every chunk (with include_usage)
    continuous_usage = include_usage and bool(opts.get("continuous_usage_stats"))
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
                         include_usage=include_usage, rank=rank, echo=echo, prompt_text=text,
                         ignored=tuple(unknown_fields(body, kind)), logprobs=lp, drop_output=drop_output,
                         prompts=prompts, n=n, best_of=best_of, best_of_lp=best_of_lp, tool_call=tool_call,
                         continuous_usage=continuous_usage, prompt_logprobs=plp, tok=tok)


# --- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------

TOKENIZE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Either 'prompt' (completion-style) or 'messages' (chat-style, through the chat template).",
    "properties": {
        "model": {"type": "string"},
        "prompt": {"type": "string"},
        "messages": CHAT_SCHEMA["properties"]["messages"],
        "add_generation_prompt": {"type": "boolean"},
        "add_special_tokens": {"type": "boolean"},
        "return_token_strs": {"type": "boolean"},
        "tools": {"type": "array", "description": "as in chat completions: counted as the prompt shows them"},
    },
}
DETOKENIZE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["tokens"],
    "properties": {"model": {"type": "string"},
                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}}},
}
SPECIAL_TOKENS = {EOS: "<|eos|>", BOS: "<|bos|>"}


def token_str(t: int) -> str:
    """A token's name: the byte itself when it is printable ASCII, else <0xNN>, or a special's name."""
    if t >= 256:
        return SPECIAL_TOKENS.get(t, f"<|reserved_{t}|>")
    return chr(t) if 32 <= t < 127 else f"<0x{t:02X}>"


def _check_model(body: dict, served_model: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model != served_model:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")


def parse_tokenize(body: Any, served_model: str, tok: Any = None) -> tuple[list[int], bool]:
    """(tokens, return_token_strs) for a /tokenize body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, served_model)
    strs = _bool(body, "return_token_strs", False)
    _bool(body, "add_special_tokens", True)   # accepted: this tokenizer adds no special tokens
    has_prompt, has_msgs = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_msgs:
        raise ApiError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise ApiError(400, "'prompt' must be a string", param="prompt")
        return (encode(body["prompt"]) if tok is None else tok.encode(body["prompt"])), strs
    if tok is not None:
        return hf_text.chat_prompt(tok, _messages(body), _bool(body, "add_generation_prompt", True))[1], strs
    # tools are shown in the prompt as a chat completion shows them, so the count is the same
    text = tools.tools_block(tools._tools(body)) + chat_template(_messages(body), _bool(body, "add_generation_prompt", True))
    return encode(text), strs


def parse_detokenize(body: Any, served_model: str, tok: Any = None) -> list[int]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, served_model)
    toks = body.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    vocab = VOCAB_SIZE if tok is None else tok.vocab_size
    if any(t < 0 or t >= vocab for t in toks):
        raise ApiError(400, f"token ids must be within 0..{vocab - 1}", param="tokens")
    return toks
