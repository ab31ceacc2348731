"""Waking a paused engine group with the dispatch that ends the pause.

When the group pauses, rank 0 sets ``<ns>:paused`` to the wave that starts at the next
wake. A dispatcher (the scheduler; api-servers with client dispatch) sends its inbox
writes in a MULTI/EXEC transaction together with ``WAKE_IF_PAUSED``: if the key is
there, the script deletes it and writes the wake notice for that wave. Blocked readers
are served after EXEC, so the rank that gets the work reads its inbox entry and the
notice in one reply (and sends no notice of its own), and every other rank wakes on the
notice at the same moment: one hop through Redis instead of two.

Without the key (the group runs, or a rank already woke it) nothing is written; on a
Redis server that replies with one stream only, the receiving rank misses the notice
and sends its own: slower, never wrong (ranks ignore notices for a wave they are past).
"""

from __future__ import annotations

from typing import Any

from shared import keys as K

WAKE_IF_PAUSED = """
local wave = redis.call('GET', KEYS[1])
if wave then
  redis.call('DEL', KEYS[1])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'd', '{"w":' .. wave .. ',"r":-1}')
end
return wave
"""


def wake_if_paused(pipe: Any, keys: K.Keys) -> None:
    """Queue the conditional wake-up on ``pipe`` (a transaction with the inbox writes)."""
    pipe.eval(WAKE_IF_PAUSED, 2, keys.paused, keys.wave, K.WAVE_STREAM_MAXLEN)
