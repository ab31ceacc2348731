"""The ``sim`` backend: the device cost model instead of a forward pass.

Its tokens are a pure function of (request seed, prompt, position), so the output never
depends on the rank, the batch or a resume on another rank. The text it produces mixes
ASCII with 2- and 3-byte UTF-8 characters on purpose: it exercises the api-server's
guarantee never to split a multi-byte character.
"""

from __future__ import annotations

import hashlib

from services.engine_worker.batch import ChunkInput
from shared.tokenizer import EOS

# Mostly ASCII words, some multi-byte characters.
_ALPHABET = [c.encode() for c in "abcdefghijklmnopqrstuvwxyz     .,é€ü"]
_EOS_EVERY = 997  # a chance of EOS at a character boundary of 1/_EOS_EVERY (when not ignored)


def _mix(a: int, b: int) -> int:
    # splitmix64-style mixing: cheap, well distributed, stable across processes.
    x = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class SimTokenStream:
    """The deterministic byte stream of one request: position -> token."""

    __slots__ = ("key", "buf", "chars")

    def __init__(self, seed: int | None, prompt: list[int]) -> None:
        digest = hashlib.blake2b(bytes(t & 0xFF for t in prompt), digest_size=8).digest()
        self.key = _mix(int.from_bytes(digest, "little"), seed or 0)
        self.buf: list[int] = []   # tokens generated so far: whole characters, or EOS
        self.chars = 0

    def token_at(self, pos: int) -> int:
        while len(self.buf) <= pos:
            h = _mix(self.key, self.chars)
            self.chars += 1
            if self.chars > 1 and h % _EOS_EVERY == 0:
                self.buf.append(EOS)
                continue
            self.buf.extend(_ALPHABET[(h >> 16) % len(_ALPHABET)])
        return self.buf[pos]


class SimBackend:
    """Returns each sampled token from the request's token stream; the step's device time
    is applied by the worker from the cost model (it needs the group-wide maximum)."""

    def __init__(self) -> None:
        self._streams: dict[str, SimTokenStream] = {}

    def run(self, chunks: list[ChunkInput], prompts: dict[str, list[int]], ignore_eos: dict[str, bool]) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in chunks:
            if not c.sample:
                continue
            stream = self._streams.get(c.seq_id)
            if stream is None:
                stream = self._streams[c.seq_id] = SimTokenStream(c.seed, prompts[c.seq_id])
            pos = c.context_len - c.prompt_len   # index of the token being generated
            tok = stream.token_at(pos)
            if tok == EOS and ignore_eos.get(c.seq_id):
                tok = ord(" ")
            out[c.seq_id] = tok
        return out

    def free_seq(self, seq_id: str) -> None:
        self._streams.pop(seq_id, None)
