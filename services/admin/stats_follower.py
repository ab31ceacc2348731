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

    async def start_id(self) -> None:
        tail = await self.r.xrevrange(self.stream, count=1)
        self.last = tail[0][0] if tail else "0-0"

    async def run(self) -> None:
        from shared.messages import loads
        while True:
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
