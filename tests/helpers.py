"""Small helpers for tests: expected sim output, bounded polling."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

from services.engine_worker.sim_backend import SimTokenStream
from shared.tokenizer import EOS, StreamDecoder, encode

T = TypeVar("T")


def sim_expected_text(prompt_tokens: list[int], max_tokens: int, seed: int | None = None,
                      ignore_eos: bool = True) -> str:
    """What the sim backend generates for a prompt: a pure function of (seed, prompt, position),
    as the api-server decodes it (a character cut by the length cap dropped)."""
    stream = SimTokenStream(seed, prompt_tokens)
    out = bytearray()
    for pos in range(max_tokens):
        tok = stream.token_at(pos)
        if tok == EOS:
            if not ignore_eos:
                break
            tok = ord(" ")
        out.append(tok)
    dec = StreamDecoder()
    return dec.feed(list(out)) + dec.flush()


def completion_prompt(text: str) -> list[int]:
    return encode(text)


async def wait_until(pred: Callable[[], Awaitable[T]], timeout: float = 10.0, interval: float = 0.05) -> T:
    """Poll an async predicate until it returns a truthy value, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(interval)


def poll_until(pred: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05) -> T:
    """Call ``pred`` (synchronously) until it returns a truthy value; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last value {value!r})")
        time.sleep(interval)

