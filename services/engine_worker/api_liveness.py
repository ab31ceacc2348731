"""Which api-servers are gone, judged from their alive keys with a grace period. Pure.

An api-server refreshes ``<ns>:api:<id>:alive`` (3 s TTL) every second; an engine aborts
the requests of an api-server whose key is gone (nobody would read their tokens). A key
can also lapse while the api-server is alive: a Redis failover or restart that outlasts
the TTL. So a missing key only counts once it has stayed missing for ``grace_s`` of
successful checks; seen again, the api-server is forgiven. A check that could not reach
Redis says nothing, and neither does one made while this rank's own writes (its step's or
its heartbeat's: rank_state.py) are refused (a Redis at maxmemory, or failing over, still
answers reads: the api-servers' refreshes are refused the same way), within ``grace_s`` of
its last refused write: it forgives all."""

from __future__ import annotations


class ApiLiveness:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._missing_since: dict[str, float] = {}

    def observe(self, now: float, alive: dict[str, bool], writes_failed_at: float = float("-inf")) -> set[str]:
        """The api-servers to treat as dead after one successful check at ``now``;
        ``writes_failed_at``: when this rank last had a write to Redis refused."""
        if now - writes_failed_at < self.grace_s:
            self._missing_since.clear()
            return set()
        dead = set()
        for api, ok in alive.items():
            if ok:
                self._missing_since.pop(api, None)
                continue
            since = self._missing_since.setdefault(api, now)
            if now - since >= self.grace_s:
                dead.add(api)
        for api in list(self._missing_since):   # no request of it left here: forget it
            if api not in alive:
                del self._missing_since[api]
        return dead
