"""The byte-level tokenizer: each UTF-8 byte is a token; a few ids above 255 are special."""

from __future__ import annotations

import codecs

EOS = 256
BOS = 257
VOCAB_SIZE = 260  # 256 bytes + EOS + BOS + 2 spare, a multiple of 4 for tidy matmuls


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of byte tokens into text without ever splitting a multi-byte
    character: incomplete sequences wait inside the decoder for their next bytes."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: list[int]) -> str:
        return self._dec.decode(bytes(t for t in tokens if t < 256))

    def flush(self) -> str:
        """The end of the output: bytes still waiting are a character the length cap cut
        in two, dropped (as vLLM does) rather than ending the text in U+FFFD. Invalid
        bytes inside the text stay U+FFFD, as decode shows them."""
        self._dec.reset()
        return ""


_SPECIAL_NAMES = {EOS: "<|eos|>", BOS: "<|bos|>"}


def token_text(t: int) -> str:
    """A token as logprobs name it: an ASCII byte is its character; a byte of a multi-byte
    character is ``bytes:\\xNN`` (as vLLM shows a token that is not valid UTF-8 alone);
    a special token its name. Distinct tokens have distinct names."""
    if t < 128:
        return chr(t)
    if t < 256:
        return f"bytes:\\x{t:02x}"
    return _SPECIAL_NAMES.get(t, f"<|reserved_{t}|>")


def token_bytes(t: int) -> list[int] | None:
    """A token's UTF-8 bytes (OpenAI's ``bytes`` field); None for a special token."""
    return [t] if t < 256 else None
