"""Reading the engines' step stats (``<ns>:stats``) for the length of a benchmark run."""

from __future__ import annotations

import asyncio
from typing import Any


class StatsFollower:
    """Follows ``<ns>:stats`` from the run's start, so trimming cannot lose entries."""

    def __init__(self, r: Any, stream: str) -> None:
        self.r, self.stream = r, stream
        self.rows: list[dict[str, Any]] = []
        self.last: bytes | str = "0-0"
        self._stop = asyncio.Event()
        self._until: tuple[int, int] | None = None   # stop(): read up to this entry id, then return
        self.error: Exception | None = None          # Redis went away mid-run: the rows stop there

    async def start_id(self) -> None:
        tail = await self.r.xrevrange(self.stream, count=1)
        self.last = tail[0][0] if tail else "0-0"

    async def run(self) -> None:
        """Read until stop() and the stream's end at it; a Redis error ends the reading
        (kept in ``error``: the bench's client-side figures stand without the rows)."""
        from redis.exceptions import RedisError
        try:
            await self._follow()
        except (RedisError, OSError) as exc:
            self.error = exc

    async def _follow(self) -> None:
        from shared.bus import entry_id_key
        from shared.messages import loads
        while True:
            if self._stop.is_set() and self._until is None:
                # the stream's end at the stop: read up to it, not for as long as anyone
                # else keeps the engines stepping (a bench beside other traffic never ended)
                tail = await self.r.xrevrange(self.stream, count=1)
                self._until = entry_id_key(tail[0][0]) if tail else (0, 0)
            if self._until is not None and entry_id_key(self.last) >= self._until:
                return
            resp = await self.r.xread({self.stream: self.last}, block=200, count=10_000)
            got = 0
            for _, entries in resp or ():
                for eid, fields in entries:
                    self.last = eid
                    got += 1
                    raw = fields.get(b"d")
                    if raw is None:
                        continue
                    try:
                        self.rows.append(loads(raw))
                    except ValueError:
                        continue
            if not got and self._stop.is_set():
                return

    def stop(self) -> None:
        self._stop.set()
