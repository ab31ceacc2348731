"""OpenAI's logprobs objects from the engine's entries. Pure.

An entry is ``[logprob, [[id, logprob], ...top k]]`` (services/engine_worker/model/sampler.py),
or None where it was lost (a request resumed on another rank). A logprob below -9999 (or
-inf) is shown as -9999.0, as vLLM does, so the JSON stays valid.
"""

from __future__ import annotations

from typing import Any

from shared.tokenizer import token_bytes, token_text

FLOOR = -9999.0


class ByteNames:
    """Token names of the byte-level model (shared/tokenizer.py)."""

    text = staticmethod(token_text)
    bytes = staticmethod(token_bytes)

    @staticmethod
    def offsets(tokens: list[int], start: int) -> tuple[list[int], int]:
        return _char_starts(tokens, start)


class CheckpointNames:
    """Token names of a served checkpoint's tokenizer (shared/hf_tokenizer.py): the token's
    own text as vLLM shows it, its vocabulary entry when it decodes to nothing (a special)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def text(self, t: int) -> str:
        return self.tok.decode([t]) or self.tok.token_str(t)

    def bytes(self, t: int) -> list[int] | None:
        """The token's own bytes (OpenAI's): a piece of a multi-byte character is its bytes,
        which its text (U+FFFD) does not tell."""
        return list(self.tok.token_bytes(t)) if not self.tok.is_special(t) else None

    def offsets(self, tokens: list[int], start: int) -> tuple[list[int], int]:
        out, n = [], start
        for t in tokens:
            out.append(n)
            n += len(self.tok.decode([t]))
        return out, n


def names_for(tok: Any) -> Any:
    return ByteNames if tok is None else CheckpointNames(tok)


def _lp(v: float | None) -> float | None:
    if v is None:
        return None
    return v if v > FLOOR else FLOOR


def _char_starts(tokens: list[int], start: int) -> tuple[list[int], int]:
    """Each token's offset in the decoded text: characters that start before it (a UTF-8
    continuation byte or a special token starts none)."""
    out, n = [], start
    for t in tokens:
        out.append(n)
        if t < 256 and not 0x80 <= t < 0xC0:
            n += 1
    return out, n


class CompletionLogprobs:
    """Builds /v1/completions' ``logprobs`` (tokens, token_logprobs, top_logprobs,
    text_offset), token by token, so a stream can send each piece as it comes. The
    sampled token is always in its top_logprobs dict (vLLM's shape)."""

    def __init__(self, k: int, offset: int = 0, names: Any = ByteNames) -> None:
        self.k = k
        self.offset = offset      # text offset of the next token
        self.names = names

    def part(self, tokens: list[int], entries: list[Any] | None, first_is_none: bool = False) -> dict[str, Any]:
        entries = entries if entries is not None else [None] * len(tokens)
        name = self.names.text
        offs, self.offset = self.names.offsets(tokens, self.offset)
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for i, (t, e) in enumerate(zip(tokens, entries)):
            if e is None or (first_is_none and i == 0):
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_lp(e[0]))
            top = {name(i_): _lp(v) for i_, v in e[1][:self.k]}
            top.setdefault(name(t), _lp(e[0]))
            tops.append(top)
        return {"tokens": [name(t) for t in tokens], "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offs}


def prompt_logprobs(prompt: list[int], entries: list[Any], k: int, names: Any = ByteNames) -> list[Any]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per prompt token
    {"<id>": {"logprob", "rank", "decoded_token"}} of the k most likely and the token itself."""
    out: list[Any] = [None]
    for q in range(1, len(prompt)):
        e = entries[q - 1] if q - 1 < len(entries) else None
        if e is None:
            out.append(None)
            continue
        d = {str(i): {"logprob": _lp(v), "rank": r + 1, "decoded_token": names.text(i)}
             for r, (i, v) in enumerate(e[1][:k])}
        d.setdefault(str(prompt[q]), {"logprob": _lp(e[0]), "rank": e[2] if len(e) > 2 else None,
                                      "decoded_token": names.text(prompt[q])})
        out.append(d)
    return out


def join(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


def _item(t: int, v: float | None, names: Any) -> dict[str, Any]:
    return {"token": names.text(t), "logprob": _lp(v) if v is not None else FLOOR, "bytes": names.bytes(t)}


def chat_logprobs(tokens: list[int], entries: list[Any] | None, k: int, names: Any = ByteNames) -> dict[str, Any]:
    """/v1/chat/completions' ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    entries = entries if entries is not None else [None] * len(tokens)
    content = []
    for t, e in zip(tokens, entries):
        item = _item(t, e[0] if e is not None else None, names)
        item["top_logprobs"] = [_item(i, v, names) for i, v in e[1][:k]] if e is not None else []
        content.append(item)
    return {"content": content}
