"""When to refresh the TTL of a long-lived key written every step (an api-server's output
stream): at most once per ``every_s``. The TTL (an hour) only removes a stream whose
api-server is gone, so refreshing it every step bought nothing and was 2 of every rank's
~5 + 2 x api-servers commands a step (scripts/redis-load)."""

from __future__ import annotations


class TtlRefresh:
    def __init__(self, every_s: float = 1.0, max_keys: int = 4096) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        self._last: dict[str, float] = {}

    def due(self, key: str, now: float) -> bool:
        """True (and noted) when ``key``'s TTL was last refreshed ``every_s`` or more ago
        (or never); ``now`` on a monotonic clock."""
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return False
        if last is None and len(self._last) >= self.max_keys:   # api-servers come and go: forget the stalest
            self._last = {k: t for k, t in self._last.items() if now - t < self.every_s}
        self._last[key] = now
        return True
