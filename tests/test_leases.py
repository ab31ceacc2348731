"""Fenced leases (issue #14 item 6), against the real embedded Redis: rank slots and the
scheduler lease are renewed and released only by their owner's token, and a rank's slot
is renewed only while its step loop makes progress (a wedged rank loses its slot and
fails the container health check)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from tests.helpers import poll_until
import redis

from services.admin import healthcheck
from services.engine_worker.membership import GroupMembership
from services.scheduler.service import SchedulerService
from shared import keys as K
from shared import lease
from shared.bus import connect
from shared.logging import configure
from shared.settings import EngineSettings, SchedulerSettings

pytestmark = [pytest.mark.timeout(60)]


def _wait(pred, timeout: float, what: str):
    return poll_until(pred, timeout, what, interval=0.02)


def test_lease_scripts_are_fenced_by_token(redis_url, namespace):
    r = redis.Redis.from_url(redis_url)
    key = K.Keys(namespace).rank_alive(0)
    try:
        r.set(key, "new-owner", px=5000)
        # A stale owner's heartbeat neither overwrites nor extends the new owner's lease.
        assert lease.renew(r, key, "stale-owner", 60_000) == b"new-owner"
        assert r.get(key) == b"new-owner" and r.pttl(key) <= 5000
        # Release by a non-owner deletes nothing; by the owner it does.
        assert lease.release(r, key, "stale-owner") == 0 and r.get(key) == b"new-owner"
        assert lease.release(r, key, "new-owner") == 1 and r.get(key) is None
        # A free lease is taken back on renewal (a restarted server), unless told not to.
        assert lease.renew(r, key, "a", 1000, reacquire=False) is None and r.get(key) is None
        assert lease.renew(r, key, "a", 1000) == b"a" and r.get(key) == b"a"
    finally:
        r.close()


def _rank(redis_url: str, namespace: str) -> GroupMembership:
    """The membership of an engine rank, without a group: enough to run its liveness
    thread against Redis. Losing the slot sets ``lost`` (the real one exits the process)."""
    lost = threading.Event()
    m = GroupMembership(EngineSettings(redis_url=redis_url, namespace=namespace, ranks=1, heartbeat_ms=100,
                                       collective_timeout_s=0.2),
                        None, K.Keys(namespace), configure("engine-worker", "error"), asyncio.Event(),
                        uuid.uuid4().hex, counters=lambda: (0, 0), adopt=lambda w, s: None,
                        on_slot_lost=lambda holder: lost.set())
    m.rank, m.lost = 0, lost   # type: ignore[attr-defined]
    return m


def test_heartbeat_never_overwrites_a_new_owner(redis_url, namespace):
    rank = _rank(redis_url, namespace)
    r = redis.Redis.from_url(redis_url)
    key = rank.keys.rank_alive(0)
    r.set(key, rank.token, px=300)
    stop = rank.start_liveness()
    try:
        _wait(lambda: r.pttl(key) > 0 and r.get(key) == rank.token.encode(), 5, "first beat")
        r.set(key, "replacement", px=5000)      # a spare took the slot while we were stuck
        assert rank.lost.wait(5), "the stale owner did not notice it lost its slot"
        assert r.get(key) == b"replacement"
    finally:
        stop()
        r.close()


def test_a_refused_beat_is_reported_to_the_rank(namespace):
    """A full Redis refuses the liveness thread's beat: the rank hears of it (its api-server
    watch discounts lapsed alive keys then, even while its step loop makes no round trip)."""
    from shared.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        rank = _rank(server.url, namespace)
        admin = redis.Redis.from_url(server.url)
        refused = threading.Event()
        stop = rank.start_liveness(lambda now: refused.set())
        try:
            _wait(lambda: admin.hget(rank.keys.rank_info(0), "token") == rank.token.encode(), 5, "first beat")
            assert not refused.is_set()
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", "1")
            assert refused.wait(5), "a refused beat was not reported"
        finally:
            admin.config_set("maxmemory", "0")
            stop()
            admin.close()


def test_wedged_rank_loses_its_slot_and_fails_the_health_check(redis_url, namespace, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_REDIS_URL", redis_url)
    monkeypatch.setenv("LOCKSTEP_NAMESPACE", namespace)
    monkeypatch.setenv("LOCKSTEP_RANKS", "1")
    rank = _rank(redis_url, namespace)
    r = redis.Redis.from_url(redis_url)
    key = rank.keys.rank_alive(0)
    r.set(key, rank.token, px=300)
    rank.stepping, rank.progress_t = True, time.monotonic()
    stop = rank.start_liveness()
    try:
        _wait(lambda: r.hget(rank.keys.rank_info(0), "token") == rank.token.encode(), 5, "first beat")
        assert asyncio.run(healthcheck.check("engine")) is None
        # The loop stops going round (bound: 2 x 0.2 s + 3 x 0.1 s): no more renewals.
        rank.progress_t = time.monotonic() - 60
        _wait(lambda: r.get(key) is None, 5, "the wedged rank's slot lapses")
        problem = asyncio.run(healthcheck.check("engine"))
        assert problem is not None and "wedged" in problem, problem
        # It recovers (nobody took the slot meanwhile): it holds the slot again, healthy.
        rank.progress_t = time.monotonic() + 3600
        _wait(lambda: r.get(key) == rank.token.encode(), 5, "slot renewed again")
        _wait(lambda: asyncio.run(healthcheck.check("engine")) is None, 5, "healthy again")
    finally:
        stop()
        r.close()


def test_scheduler_never_overwrites_another_leaders_lease(redis_url, namespace):
    async def go():
        svc = SchedulerService(SchedulerSettings(redis_url=redis_url, namespace=namespace, lease_ms=150, ranks=1))
        svc.attach(connect(redis_url))
        try:
            await svc.r.set(svc.keys.leader, "other-leader", px=5000)
            await svc.leadership.renew_lease()
            assert svc.stop.is_set()                                   # it stepped down
            assert await svc.r.get(svc.keys.leader) == b"other-leader"   # and left the lease alone
            assert await svc.r.pttl(svc.keys.leader) > 4000
            # Its exit path releases only its own lease.
            assert await lease.release(svc.r, svc.keys.leader, svc.id) == 0
            assert await svc.r.get(svc.keys.leader) == b"other-leader"
        finally:
            await svc.r.aclose()
    asyncio.run(go())


class _Events:
    def __init__(self) -> None:
        self.events: list[str] = []

    def _note(self, event: str, **kw) -> None:
        self.events.append(event)
    info = warning = error = debug = _note


def test_the_lease_keeper_extends_only_while_the_loop_goes_round(redis_url, namespace):
    from services.scheduler.lease_keeper import LeaseKeeper
    r = redis.Redis.from_url(redis_url)
    key = K.Keys(namespace).leader
    log = _Events()
    keeper = LeaseKeeper(redis_url, key, "me", 300, log)
    keeper.bound_s = 1.0
    stop = keeper.start()
    try:
        r.set(key, "me", px=300)
        deadline = time.monotonic() + 1.5          # 5 leases: it would have lapsed 4 times
        while time.monotonic() < deadline:
            keeper.mark_progress()
            assert r.get(key) == b"me"
            time.sleep(0.05)
        # the loop stops going round: the lease lapses once the bound has passed, and it says why
        _wait(lambda: r.get(key) is None, 5, "a wedged leader's lease lapses")
        assert "scheduler_stalled" in log.events
        # it never takes a free lease (the loop does, and announces it) nor another's
        keeper.mark_progress()
        time.sleep(0.5)
        assert r.get(key) is None
        r.set(key, "other", px=5000)
        time.sleep(0.5)
        assert r.get(key) == b"other" and r.pttl(key) < 4700
    finally:
        stop()
        r.close()


def test_a_leader_whose_loop_stalls_a_moment_keeps_leading(redis_url, namespace):
    # A 1.2 s stall of the scheduler's event loop (a burst of dispatches, a host short of CPU)
    # let the 300 ms lease lapse and a standby take it: the leader stepped down and was
    # restarted, and every request in flight was placed again.
    k = K.Keys(namespace)
    taken: list[bool] = []

    def standby() -> None:
        r = redis.Redis.from_url(redis_url)
        try:
            end = time.monotonic() + 1.2
            while time.monotonic() < end and not taken:
                if r.set(k.leader, "standby", nx=True, px=5000):
                    taken.append(True)
                time.sleep(0.02)
        finally:
            r.close()

    async def go() -> None:
        svc = SchedulerService(SchedulerSettings(redis_url=redis_url, namespace=namespace, lease_ms=300, ranks=1))
        task = asyncio.create_task(svc.run())
        try:
            r = connect(redis_url)
            try:
                for _ in range(500):
                    if await r.get(k.leader) == svc.id.encode() and svc.leadership.keeper is not None:
                        break
                    await asyncio.sleep(0.02)
                assert await r.get(k.leader) == svc.id.encode()
                t = threading.Thread(target=standby)
                t.start()
                time.sleep(1.2)                       # the loop stalls (blocking, on purpose)
                t.join(5)
                await asyncio.sleep(0.5)              # and goes on
                assert not taken, "a standby took the lease of a leader that only stalled"
                assert not svc.stop.is_set() and await r.get(k.leader) == svc.id.encode()
            finally:
                await r.aclose()
        finally:
            svc.stop.set()
            assert await asyncio.wait_for(task, 10) == 0
    asyncio.run(go())


def test_a_rank_that_re_forms_slowly_is_not_taken_for_wedged(redis_url, namespace):
    # One re-formation attempt past the stall bound (a close waiting out a broken group, a
    # gloo mesh slow to connect) made a healthy rank report itself stalled; its slot lapsed
    # and the supervisor killed it as wedged, a second restart for one frozen peer.
    rank = _rank(redis_url, namespace)
    rank.stepping, rank.progress_t = True, time.monotonic()
    bound = rank._stall_bound_s()

    async def slow_formation() -> None:
        await asyncio.sleep(bound * 2)

    async def no_group() -> None:
        return None

    async def go() -> None:
        rank.form_group, rank._leave_group = slow_formation, no_group
        task = asyncio.create_task(rank.reform("test"))
        await asyncio.sleep(bound * 1.5)
        assert rank._stalled_s() is None, "a re-formation in progress counted as a stall"
        assert await asyncio.wait_for(task, 10) is True
        # a loop stuck outside any re-formation still stalls
        rank.progress_t = time.monotonic() - 2 * bound
        assert rank._stalled_s() is not None
    rank.formed_once = True        # (a first formation would announce itself in Redis)
    asyncio.run(go())


def test_a_rank_that_re_forms_wakes_the_ranks_paused_in_its_generation(redis_url, namespace):
    # An all-gather ends at different moments on different ranks: one that had every row
    # when a peer died paused, while the one whose collective failed re-formed without it
    # (rank 0 retried "3/4 clients joined" for its whole reform_timeout_s, seen in CI).
    from shared.bus import decode_entries
    from shared.messages import WaveNotice

    async def go() -> None:
        r = connect(redis_url)
        m = GroupMembership(EngineSettings(redis_url=redis_url, namespace=namespace, ranks=2, rank=0),
                            r, K.Keys(namespace), configure("engine-worker", "error"), asyncio.Event(),
                            uuid.uuid4().hex, counters=lambda: (0, 0), adopt=lambda w, s: None)
        m.rank, m.gen, m.formed_once = 0, 3, True

        async def formed() -> None:
            return None
        m.form_group, m._leave_group = formed, formed
        try:
            assert await asyncio.wait_for(m.reform("test"), 10) is True
            entries = await r.xrange(m.keys.wave)
            notices = [WaveNotice.from_dict(doc) for _, _, doc in decode_entries([(m.keys.wave.encode(), entries)])]
            # what a paused rank of generation 3 reads as "re-form" (pause.py)
            assert [(n.r, n.reform) for n in notices] == [(0, 3)], notices
        finally:
            await r.aclose()
    asyncio.run(go())
