"""Structured output: a request's grammar, compiled by llguidance for this model's tokens.

A guide is ``[kind, text]`` on the wire (SamplingParams.guide): kind ``json`` (text: a
JSON schema), ``regex``, ``choice`` (text: a JSON list of strings) or ``grammar`` (Lark or
GBNF). The api-server compiles it once to refuse a bad one with a 400; each engine compiles
it again into a matcher that gives the allowed tokens of every step (services/engine_worker/
guided.py). The byte-level tokenizer's tokens are its 256 bytes; ids 256.. are special
(shared/tokenizer.py), so llguidance sees exactly the vocabulary the sampler draws from.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

KINDS = ("json", "regex", "choice", "grammar")
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _ByteVocab:
    """The byte tokenizer as llguidance's TokenizerWrapper reads it."""

    def __init__(self) -> None:
        from shared.tokenizer import BOS, EOS, VOCAB_SIZE
        self.eos_token_id = EOS
        self.bos_token_id = BOS
        # llguidance marks special tokens with a leading 0xFF byte
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<|special_%d|>" % i for i in range(256, VOCAB_SIZE)]
        self.special_token_ids = list(range(256, VOCAB_SIZE))

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


@lru_cache(maxsize=1)
def byte_tokenizer() -> Any:
    import llguidance
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab()))


def grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a guide (ValueError when the kind is unknown)."""
    import llguidance
    if kind not in KINDS:
        raise ValueError(f"unknown guide kind {kind!r}")
    if kind == "json":
        # Compact JSON (", " and ": " only, no free whitespace): free whitespace lets a weak
        # model loop on spaces and newlines until max_tokens; a schema's own "x-guidance"
        # options still apply over these defaults.
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    fmt = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
    return llguidance.grammar_from(fmt, text)


def check(kind: str, text: str) -> str | None:
    """None when the guide compiles for this model, else why not."""
    import llguidance
    try:
        g = grammar(kind, text)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g, byte_tokenizer())
    if is_err:
        return "; ".join(msgs) or "invalid grammar"
    return None


def matcher(kind: str, text: str) -> Any:
    """A fresh matcher at the start of the output."""
    import llguidance
    return llguidance.LLMatcher(byte_tokenizer(), grammar(kind, text), log_level=0)
