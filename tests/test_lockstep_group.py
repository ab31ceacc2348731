"""The step collective over real torch.distributed (gloo) between processes: every rank
gets every rank's row, in rank order, step after step."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from shared.redis_server import free_port

WORLD = 3
STEPS = 5


def _rank(rank: int, port: int, out: "mp.Queue") -> None:
    from services.engine_worker.lockstep import FIELDS, LockstepGroup
    group = LockstepGroup.init(rank, WORLD, "127.0.0.1", port, timeout_s=30)
    try:
        views = []
        for step in range(STEPS):
            row = [rank * 100 + step * 10 + f for f in range(FIELDS)]
            views.append(group.exchange(row).rows)
        out.put((rank, views))
    finally:
        group.close()


def test_every_rank_sees_every_row_in_rank_order():
    from services.engine_worker.lockstep import FIELDS
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    expected = [[[r * 100 + step * 10 + f for f in range(FIELDS)] for r in range(WORLD)] for step in range(STEPS)]
    assert all(got[r] == expected for r in range(WORLD)), got


def test_a_row_of_the_wrong_width_is_a_local_error():
    from services.engine_worker.lockstep import LockstepGroup
    with pytest.raises(ValueError):
        LockstepGroup(0, 1).exchange([1, 2, 3])
