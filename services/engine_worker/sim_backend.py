"""The ``sim`` backend: the device cost model instead of a forward pass.

Its tokens are a pure function of (request seed, prompt, position), so the output never
depends on the rank, the batch or a resume on another rank. An unseeded request that
samples (temperature > 0) takes its sequence id as its seed, so that ``n`` choices and
repeated requests differ as a real model's draws do (the id is kept across ranks); a
greedy one (temperature 0) stays a function of its prompt. The text it produces mixes
ASCII with 2- and 3-byte UTF-8 characters on purpose: it exercises the api-server's
guarantee never to split a multi-byte character.

Logprobs are made up, deterministically and plausibly (``sim_logprobs``): at each position
one token takes most of the mass (the token the sim generates, or a hashed byte for a
prompt position), the other bytes share the rest in halves, in a hashed order. So a test
can check every logprob path without torch: sorted top lists, the sampled token on top,
probabilities summing to at most 1, the same numbers on every run.
"""

from __future__ import annotations

import hashlib
import math

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


def _id_key(seq_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(seq_id.encode(), digest_size=8).digest(), "little")


def _prompt_key(prompt: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(bytes(t & 0xFF for t in prompt), digest_size=8).digest(), "little")


def sim_logprobs(h: int, token: int, k: int, top: int | None = None) -> list:
    """A made-up distribution keyed by ``h``: [logprob of ``token``, [[id, logprob], ...k best], rank].
    ``top`` is the most likely token (default: a byte derived from ``h``)."""
    h = _mix(h, 0x51)
    top = (h >> 8) % 256 if top is None else top
    p0 = 0.5 + 0.49 * ((h >> 20) % 1000) / 1000
    step = 2 * ((h >> 40) % 128) + 1          # odd: i * step walks all 256 bytes
    rest = [(top + i * step) % 256 for i in range(1, 256)] if top < 256 else \
        [((h >> 12) + i * step) % 256 for i in range(256)]
    lp0, lr = math.log(p0), math.log1p(-p0)
    ranked = [(top, lp0)] + [(t, lr - (i + 1) * math.log(2)) for i, t in enumerate(rest)]
    rank = next((i + 1 for i, (t, _) in enumerate(ranked) if t == token), len(ranked) + 1)
    mine = ranked[rank - 1][1] if rank <= len(ranked) else lr - 300 * math.log(2)   # a special token
    return [mine, [[t, v] for t, v in ranked[:k]], rank]


class SimBackend:
    """Returns each sampled token from the request's token stream; the step's device time
    is applied by the worker from the cost model (it needs the group-wide maximum)."""

    def __init__(self) -> None:
        self._streams: dict[str, SimTokenStream] = {}

    def run(self, chunks: list[ChunkInput], prompts: dict[str, list[int]],
            eos_from: dict[str, float], masks: dict[str, bytes] | None = None) -> dict[str, int]:
        """``eos_from[id]``: the first position where EOS may end the request (its
        min_tokens; inf with ignore_eos): before it the sim writes a space instead.
        ``masks``: a guided request's allowed tokens (structured output): the sim draws one
        of them by hash, as random weights would, so its output follows the grammar."""
        out: dict[str, int] = {}
        for c in chunks:
            if not c.sample:
                continue
            if masks and c.seq_id in masks:
                out[c.seq_id] = _guided_pick(masks[c.seq_id], _mix(_prompt_key(prompts[c.seq_id]), c.context_len))
                continue
            stream = self._streams.get(c.seq_id)
            if stream is None:
                seed = c.seed
                if seed is None and c.temperature > 0:   # unseeded draws differ per request
                    seed = _id_key(c.seq_id)
                stream = self._streams[c.seq_id] = SimTokenStream(seed, prompts[c.seq_id])
            pos = c.context_len - c.prompt_len   # index of the token being generated
            tok = stream.token_at(pos)
            if tok == EOS and pos < eos_from.get(c.seq_id, 0):
                tok = ord(" ")
            out[c.seq_id] = tok
        return out

    def logprobs(self, chunks: list[ChunkInput], sampled: dict[str, int], prompts: dict[str, list[int]],
                 want: dict[str, tuple[int | None, int | None, list[int]]]
                 ) -> tuple[dict[str, list], dict[str, tuple[int, list]]]:
        """The torch runner's ``run_logprobs`` extras for the sim (sim_logprobs): the sampled
        token is always the most likely one."""
        tok_lp: dict[str, list] = {}
        prompt_lp: dict[str, tuple[int, list]] = {}
        for c in chunks:
            w = want.get(c.seq_id)
            if w is None:
                continue
            key = _prompt_key(prompts[c.seq_id])
            if w[0] is not None and c.sample and c.seq_id in sampled:
                tok = sampled[c.seq_id]
                tok_lp[c.seq_id] = sim_logprobs(_mix(key, c.context_len), tok, w[0], top=tok)
            if w[1] is not None:
                prompt = w[2]
                hi = min(c.context_len + 1, len(prompt))
                if c.start_pos + 1 < hi:
                    prompt_lp[c.seq_id] = (c.start_pos + 1, [sim_logprobs(_mix(key, q), prompt[q], w[1])
                                                             for q in range(c.start_pos + 1, hi)])
        return tok_lp, prompt_lp

    def free_seq(self, seq_id: str) -> None:
        self._streams.pop(seq_id, None)


def _guided_pick(mask: bytes, h: int) -> int:
    allowed = [i * 8 + b for i, byte in enumerate(mask) if byte for b in range(8) if byte >> b & 1]
    return allowed[h % len(allowed)] if allowed else EOS


def eos_from(params) -> float:
    """The first position where the sim may emit EOS for a request with these params."""
    return math.inf if params.ignore_eos else params.min_tokens
