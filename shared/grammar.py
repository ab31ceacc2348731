"""Structured output: a request's grammar, compiled by llguidance for the served model's tokens.

A guide is ``[kind, text]`` on the wire (SamplingParams.guide): kind ``json`` (text: a
JSON schema), ``regex``, ``choice`` (text: a JSON list of strings) or ``grammar`` (Lark or
GBNF). The api-server compiles it once to refuse a bad one with a 400; each engine compiles
it again into a matcher that gives the allowed tokens of every step (services/engine_worker/
guided.py). Both compile for the served model's :class:`Vocab`: the bundled model's byte
tokens (its 256 bytes; ids 256.. special, shared/tokenizer.py), or a checkpoint's own
tokenizer.json, so llguidance sees exactly the vocabulary the sampler draws from.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

KINDS = ("json", "regex", "choice", "grammar")
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Vocab:
    """The served model's tokens as a grammar sees them: llguidance's tokenizer, the ids
    that end a sequence (all a finished grammar allows), and a step mask's length."""

    def __init__(self, ll: Any, eos: tuple[int, ...]) -> None:
        self.ll = ll
        self.eos = eos
        self.mask_bytes = (ll.vocab_size + 31) // 32 * 4   # llguidance's bitmask: whole 32-bit words

    def only_eos(self) -> bytes:
        """The mask of a finished (or broken) grammar: the sequence ends here."""
        b = bytearray(self.mask_bytes)
        for t in self.eos:
            b[t // 8] |= 1 << (t % 8)
        return bytes(b)


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
def byte_vocab() -> Vocab:
    import llguidance
    from shared.tokenizer import EOS
    return Vocab(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab())), (EOS,))


@lru_cache(maxsize=4)
def checkpoint_vocab(model_dir: str, eos: tuple[int, ...], n_vocab: int | None = None) -> Vocab:
    """A checkpoint's vocabulary from its tokenizer.json (about a second for a 150k-token
    vocabulary, so cached). ``n_vocab``: the model's output size (config.json
    ``vocab_size``), which is often larger than the tokenizer's (padding rows no grammar
    allows); ``eos``: the ids that end its sequences (generation_config.json)."""
    import llguidance
    if not eos:
        raise ValueError(f"{model_dir}: no EOS token (generation_config.json eos_token_id), so a finished "
                         "grammar could not end the output")
    text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
    ll = llguidance.LLTokenizer(text, eos_token=list(eos))
    if n_vocab is not None and n_vocab > ll.vocab_size:
        ll = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=list(eos))
    return Vocab(ll, eos)


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


def check(kind: str, text: str, vocab: Vocab | None = None) -> str | None:
    """None when the guide compiles for this model (default: the byte model), else why not."""
    import llguidance
    try:
        g = grammar(kind, text)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g, (vocab or byte_vocab()).ll)
    if is_err:
        return "; ".join(msgs) or "invalid grammar"
    return None


def matcher(kind: str, text: str, vocab: Vocab | None = None) -> Any:
    """A fresh matcher at the start of the output (default: for the byte model)."""
    import llguidance
    return llguidance.LLMatcher((vocab or byte_vocab()).ll, grammar(kind, text), log_level=0)
