"""JSON request bodies into their Structs (bodies.py), with OpenAI-style errors: msgspec's
message ("Expected `float` <= 2.0 - at `$.temperature`") becomes a 400 whose ``param``
names the field and whose message says what is allowed. Lax, as vLLM's pydantic models
are: a whole number sent as 2.0 or "2" is an integer, "0.5" a number, "true" / 1 a
boolean; 1.5 for an integer or "ten" for a number is still a 400. Pure."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
import orjson

from services.api_server.errors import ApiError

T = TypeVar("T")

_DECODERS: dict[type, msgspec.json.Decoder] = {}

# What a field allows, where msgspec's words are too terse to say it.
HINTS = {
    "prompt": "a string, a list of token ids, or a list of either (a batch)",
    "stop": "a string or a list of strings",
    "response_format": '{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": {...}}}',
    "structured_outputs": "an object with exactly one of json, regex, choice, grammar, json_object",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "tools": '[{"type": "function", "function": {"name", "description"?, "parameters"?}}, ...]',
    "logit_bias": "an object of token id -> bias in -100..100",
    "stream_options": '{"include_usage": bool, "continuous_usage_stats": bool}',
}
# Lists of objects whose errors name the element (and, for messages, its field), as in
# "messages[2].content"; every other error names the top-level field.
_DEEP = {"messages": 2, "tools": 1}
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")          # an escaped UTF-16 surrogate
_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")   # a whole pair of them
_AT = re.compile(r"^(.*) - at `\$(.*)`$")
_STEP = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")
_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "array": "a list",
          "object": "an object", "null": "null"}


BOM = b"\xef\xbb\xbf"


def decode(raw: bytes | Any, typ: type[T]) -> tuple[T, tuple[str, ...]]:
    """(the body, the unknown top-level field names, which are ignored). ``raw``: the body's
    bytes, or an already decoded JSON value (the unit tests)."""
    if isinstance(raw, (bytes, bytearray)) and raw[:3] == BOM:
        raw = raw[3:]       # a UTF-8 BOM (PowerShell 5's files): Python's json.loads, so vLLM, accepts it
    try:
        try:
            if isinstance(raw, (bytes, bytearray, memoryview, str)):
                dec = _DECODERS.get(typ) or _DECODERS.setdefault(typ, msgspec.json.Decoder(typ, strict=False))
                return dec.decode(raw), ()
            return msgspec.convert(raw, typ, strict=False), ()
        except msgspec.ValidationError as exc:
            if not _unknown_at_top(str(exc)):
                raise
        # Unknown top-level fields (rare): find them all and decode without them.
        doc = orjson.loads(raw) if isinstance(raw, (bytes, bytearray, memoryview, str)) else raw
        known = typ.__struct_fields__  # type: ignore[attr-defined]
        unknown = tuple(k for k in doc if k not in known)
        return msgspec.convert({k: v for k, v in doc.items() if k in known}, typ, strict=False), unknown
    except msgspec.ValidationError as exc:
        raise _api_error(str(exc), raw, typ) from None
    except (msgspec.DecodeError, orjson.JSONDecodeError) as exc:
        why = str(exc)
        if isinstance(raw, (bytes, bytearray, memoryview, str)) and _SURROGATE.search(
                _PAIR.sub(b"", raw.encode() if isinstance(raw, str) else bytes(raw))):
            # the decoders' own words for it ("Input data was truncated") mislead
            why = ("a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which is "
                   "not text; send the character itself or its whole surrogate pair")
        raise ApiError(400, f"invalid JSON body: {why}") from None
    except RecursionError:   # the decoders recurse per level of a free-form object (metadata, a schema)
        raise ApiError(400, "invalid JSON body: nested too deeply (more than a few hundred levels of objects "
                            "or lists); flatten it") from None


def _unknown_at_top(msg: str) -> bool:
    return msg.startswith("Object contains unknown field") and " - at `" not in msg


def _api_error(msg: str, raw: Any, typ: type) -> ApiError:
    m = _AT.match(msg)
    what, path = (m.group(1), m.group(2)) if m else (msg, "")
    steps = [a or b for a, b in _STEP.findall(path)]
    if not steps:
        if what.startswith("Object missing required field"):
            name = what.split("`")[1]
            return ApiError(400, f"'{name}' is required", param=name)
        return ApiError(400, "the request body must be a JSON object")
    top = steps[0]
    keep = 1 + _DEEP.get(top, 0)
    param = top + "".join(f"[{s}]" if s.isdigit() else f".{s}" for s in steps[1:keep])
    where = top + "".join(f"[{s}]" if s.isdigit() or s == "..." else f".{s}" for s in steps[1:])
    text = _explain(what, raw, steps, typ)
    hint = HINTS.get(top)
    return ApiError(400, f"'{where}' {text}" + (f" ({top}: {hint})" if hint else ""), param=param)


def _explain(what: str, raw: Any, steps: list[str], typ: type) -> str:
    """msgspec's message (without its path) in our words, with the value sent."""
    got = _value_at(raw, steps)
    got_s = "" if got is _MISSING else f", got {_show(got)}"
    if m := re.match(r"Expected `([^`]+)`, got `([^`]+)`", what):
        return f"must be {_types(m.group(1))}" + (got_s or f", got {_types(m.group(2))}")
    if m := re.match(r"Expected `([^`]+)` of length ([<>]=) (\d+)", what):
        many = m.group(1) in ("array", "object")
        if m.group(2) == ">=" and m.group(3) == "1":
            return f"must be a non-empty {'list' if m.group(1) == 'array' else _types(m.group(1))[2:]}"
        unit = ("item" if many else "character") + ("" if m.group(3) == "1" else "s")
        bound = "at most" if m.group(2) == "<=" else "at least"
        return f"must be {_types(m.group(1))} of {bound} {m.group(3)} {unit}{'' if many else got_s}"
    if m := re.match(r"Expected `([^`]+)` ([<>]=?) (\S+)", what):
        return f"must be {_types(m.group(1))} {m.group(2)} {_num(m.group(3))}{got_s}"
    if what == "Number out of range":
        return "is out of range (too large a number)"
    if what.startswith("Invalid enum value"):
        allowed = _literals(typ, steps)
        return f"must be one of {', '.join(_show(v) for v in allowed)}{got_s}" if allowed else what
    if m := re.match(r"Object missing required field `(\w+)`", what):
        return f"needs the field '{m.group(1)}'"
    if m := re.match(r"Object contains unknown field `(\w+)`", what):
        return f"has no field '{m.group(1)}'"
    return what[:1].lower() + what[1:] + got_s


def _types(spec: str) -> str:
    """'int | null' -> 'an integer' (null always means the default: not worth saying)."""
    names = [_WORDS.get(t, t) for t in spec.split(" | ") if t != "null"] or ["null"]
    return " or ".join(names)


def _num(s: str) -> str:
    return s[:-2] if s.endswith(".0") else s


_MISSING = object()


def _value_at(raw: Any, steps: list[str]) -> Any:
    """The value sent at the path (an error message shows it); _MISSING when unknown."""
    try:
        v = orjson.loads(raw) if isinstance(raw, (bytes, bytearray, memoryview, str)) else raw
        for s in steps:
            v = v[int(s)] if s.isdigit() else v[s]
        return v
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
        return _MISSING


def _literals(typ: type, steps: list[str]) -> tuple[Any, ...]:
    """The values a Literal field at the path allows (from the Struct's type info)."""
    t: Any = mi.type_info(typ)
    for s in steps:
        t = _pick(t, s)
        if t is None:
            return ()
    for u in _members(t):
        if isinstance(u, mi.LiteralType):
            return tuple(sorted(u.values))
    return ()


def _members(t: Any) -> list[Any]:
    """The types a field may hold, unions and annotations unwrapped."""
    if isinstance(t, mi.Metadata):
        return _members(t.type)
    if isinstance(t, mi.UnionType):
        return [m for u in t.types for m in _members(u)]
    return [t]


def _pick(t: Any, step: str) -> Any:
    for u in _members(t):
        if isinstance(u, mi.StructType) and not step.isdigit():
            return next((f.type for f in u.fields if f.encode_name == step), None)
        if isinstance(u, mi.ListType) and step.isdigit():
            return u.item_type
        if isinstance(u, mi.DictType) and step == "...":
            return u.value_type
    return None


def _show(v: Any) -> str:
    s = msgspec.json.encode(v).decode()
    return s if len(s) <= 60 else s[:57] + "..."
