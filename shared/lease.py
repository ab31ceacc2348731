"""Fenced leases: a key whose value is its owner's token, renewed and released only by
that owner (rank slots ``<ns>:rank:{r}:alive``, the scheduler lease ``<ns>:leader``).

A plain ``SET key token PX`` heartbeat overwrites whoever holds the key now (a stale
owner, back from a stall, takes the slot of the process that replaced it), and GET-then-
DEL deletes a key that changed hands between the two calls. Both are one Lua script
here, atomic on the server: compare-and-renew and compare-and-delete.

Each function returns what ``client.eval`` returns: the value itself for a synchronous
client or pipeline (the liveness thread), an awaitable for an asyncio client.
"""

from __future__ import annotations

from typing import Any

from shared.replies import as_str

# KEYS[1] lease; ARGV[1] token, ARGV[2] PX, ARGV[3] '1' = take the key back if it is free.
# Returns the holder after the call: the token when the lease is (still, or again) ours,
# another owner's token, or nil (free and not taken back).
RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] or (not v and ARGV[3] == '1') then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return v
"""

# KEYS[1] lease; ARGV[1] token. Deletes the key only if the token holds it: 1, else 0.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def renew(client: Any, key: str, token: str, px: int, *, reacquire: bool = True) -> Any:
    """Extend the lease if ``token`` holds it (or, with ``reacquire``, if it is free: a
    restarted server or a lapse nobody used); never overwrite another owner."""
    return client.eval(RENEW, 1, key, token, int(px), "1" if reacquire else "0")


def release(client: Any, key: str, token: str) -> Any:
    """Delete the lease only if ``token`` holds it."""
    return client.eval(RELEASE, 1, key, token)


def is_holder(result: Any, token: str) -> bool:
    """Whether a ``renew`` result says the lease is ``token``'s."""
    return result is not None and as_str(result) == token
