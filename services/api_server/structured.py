"""Which structured output a request asks for (response_format, vLLM's guided_* and
structured_outputs), as the [kind, text] that SamplingParams.guide carries. Pure."""

from __future__ import annotations

from typing import Any

import msgspec

from services.api_server.bodies import GenerationBody
from services.api_server.errors import ApiError

ANY_JSON_OBJECT = '{"type": "object"}'
_ONE_OF = "json, regex, choice, grammar, json_object"


def _dumps(v: Any) -> str:
    # msgspec, not orjson: a request's JSON may hold integers past 64 bits, which it decoded
    return msgspec.json.encode(v).decode()


def _guide_of(kind: str, v: Any) -> list[str]:
    if kind == "json":
        return ["json", v if isinstance(v, str) else _dumps(v)]
    if kind == "choice":
        return ["choice", _dumps(v)]
    return [kind, v]


def guide(b: GenerationBody, vocab: Any = None) -> tuple[str, list[str]] | None:
    """(the field that asked, [kind, text]) of the request's structured output, checked
    by compiling it (shared/grammar.py) for ``vocab``, the served checkpoint's tokens (None:
    the byte model's); None without one. One field at most."""
    found: list[tuple[str, list[str]]] = []
    rf = b.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", ["json", ANY_JSON_OBJECT]))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema", param="response_format")
        found.append(("response_format", _guide_of("json", rf.json_schema.schema)))
    for name, kind, v in (("guided_json", "json", b.guided_json), ("guided_regex", "regex", b.guided_regex),
                          ("guided_choice", "choice", b.guided_choice), ("guided_grammar", "grammar", b.guided_grammar)):
        if v is not None:
            found.append((name, _guide_of(kind, v)))
    so = b.structured_outputs
    if so is not None:
        asked = [(k, v) for k in so.__struct_fields__ if (v := getattr(so, k)) is not None and v is not False]
        if len(asked) != 1:
            raise ApiError(400, f"'structured_outputs' takes exactly one of {_ONE_OF}", param="structured_outputs")
        k, v = asked[0]
        found.append(("structured_outputs", ["json", ANY_JSON_OBJECT] if k == "json_object" else _guide_of(k, v)))
    if not found:
        return None
    if len(found) > 1:
        raise ApiError(400, f"'{found[1][0]}' and '{found[0][0]}' both ask for structured output; send one",
                       param=found[1][0])
    from shared import grammar   # llguidance: only for requests that ask
    name, g = found[0]
    why = grammar.check(*g, vocab)
    if why is not None:
        raise ApiError(400, f"'{name}' cannot be compiled: {why[:300]}", param=name)
    return name, g
