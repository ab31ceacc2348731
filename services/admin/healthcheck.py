"""Container health checks (compose.yaml): ``python -m services.admin.healthcheck ROLE``.

- ``scheduler``: Redis answers and some scheduler holds the leadership lease (a standby
  is healthy while another one leads).
- ``engine``: Redis answers and a rank slot whose heartbeat is alive was claimed from
  this host (``<ns>:rank:{r}:info`` host == this container's hostname) by a rank whose
  step loop makes progress (``stalled_s`` 0: a wedged rank stops renewing its slot and
  reports how long it has been stuck), or this host's hot spare is waiting for one
  (``<ns>:spare:*`` value ``pid@host``).

Settings (Redis URL, namespace, ranks) come from the same LOCKSTEP_* variables as the
service. Exit 0 when healthy, 1 with one line on stderr when not.
"""

from __future__ import annotations

import asyncio
import socket
import sys

from shared import keys as K
from shared.bus import connect
from shared.settings import EngineSettings


async def check(role: str) -> str | None:
    s = EngineSettings.from_env()
    k = K.Keys(s.namespace)
    r = connect(s.redis_url, timeout_s=3.0)
    try:
        await r.ping()
        if role == "scheduler":
            return None if await r.exists(k.leader) else "no scheduler holds the leadership lease"
        if role == "engine":
            host = socket.gethostname()
            pipe = r.pipeline(transaction=False)
            for i in range(s.ranks):
                pipe.hmget(k.rank_info(i), ["host", "stalled_s"])
                pipe.exists(k.rank_alive(i))
            res = await pipe.execute()
            wedged = []
            for i in range(s.ranks):
                (h, stalled), alive = res[2 * i], res[2 * i + 1]
                if h != host.encode():
                    continue
                if float(stalled or 0) > 0:
                    wedged.append(f"rank {i} is wedged: its step loop made no progress for {float(stalled):g}s")
                elif alive:
                    return None
            if wedged:
                return "; ".join(wedged)
            spares = [key async for key in r.scan_iter(match=k.spare("*"), count=1000)]
            if spares and any(v and v.split(b"@", 1)[-1] == host.encode() for v in await r.mget(spares)):
                return None
            return f"no live rank slot claimed from host {host}, and no hot spare waiting there"
        return f"unknown role {role!r} (scheduler or engine)"
    finally:
        await r.aclose()


def main(argv: list[str]) -> int:
    role = argv[1] if len(argv) > 1 else ""
    try:
        problem = asyncio.run(asyncio.wait_for(check(role), 5.0))
    except Exception as exc:  # noqa: BLE001 - any failure is unhealthy
        problem = f"{exc.__class__.__name__}: {exc}"
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
