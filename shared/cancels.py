"""Aborts and retirements reach a rank ahead of its inbox backlog.

A rank reads its inbox only while its waiting queue has room (the rest waits in Redis,
where recovery and the load view see it), so an abort written behind thousands of unread
requests waited until the rank got to it: the requests of clients long gone ran on and the
traffic after them queued behind. Every writer of an abort or a retirement to an inbox
pushes the same message onto the rank's ``cancels`` list first (shared/keys.py), in the
same pipeline; the rank pops that list every step and applies each one at once, or, for a
request it has not read yet, when it reads it (services/engine_worker/ingest.py). The
inbox entry stays the message of record: a rank that dies before it popped the list
leaves it to recovery as before."""

from __future__ import annotations

from typing import Any

from shared import keys as K

CANCELS_MAX = 10_000      # a rank that stopped popping (dead) keeps at most this many
CANCELS_TTL_S = 600       # ... for at most this long after the last push
POP_COUNT = 512           # popped per step (the rest on the next)


def push(pipe: Any, keys: K.Keys, rank: int, blob: bytes) -> None:
    """Queue, on ``pipe``, ``blob`` (an encoded Abort or Retire) for ``rank``'s cancels
    list. Before the inbox write of the same message: a rank that reads the inbox entry
    first never keeps a note of it that nothing clears."""
    key = keys.cancels(rank)
    pipe.rpush(key, blob)
    pipe.ltrim(key, -CANCELS_MAX, -1)
    pipe.expire(key, CANCELS_TTL_S)


def send(pipe: Any, keys: K.Keys, rank: int, blob: bytes, field: str) -> None:
    """The cancels push, then the inbox entry (``{field: blob}``)."""
    push(pipe, keys, rank, blob)
    pipe.xadd(keys.inbox(rank), {field: blob})
