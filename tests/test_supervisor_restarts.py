"""How the supervisor of `lockstep up` / `lockstep engine` counts deaths (pure rules,
driven with real short-lived processes; Redis unreachable, so no slot is released):
per rank whichever process held it, per role for the others, and the waiting spares
together. A rank whose every process dies stops the supervisor; spares that keep dying
are not started for a minute but do not stop a cluster that serves without them (they
did, while a crash-looping rank replaced by fresh spares never counted at all)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.admin.supervisor import MAX_RESTARTS_PER_MIN, Supervisor


class Dying(Supervisor):
    """Every child it starts exits at once with code 1."""

    url = "redis://127.0.0.1:1/0"
    namespace = "sup"
    world = 2

    def __init__(self, log_dir: Path, spares: int) -> None:
        self.said: list[str] = []
        super().__init__(log_dir, out=self.said.append)
        self.spares = spares

    @staticmethod
    def _popen(args, env, log) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    def run_rounds(self, n: int) -> bool:
        for _ in range(n):
            for c in self.children:
                c.proc.wait(30)
            if not self.supervise():
                return False
        return True


@pytest.mark.timeout(120)
def test_a_rank_whose_every_process_dies_stops_the_supervisor(tmp_path):
    sup = Dying(tmp_path, spares=0)
    sup._spawn("engine-1", ["engine-worker"], {})
    assert not sup.run_rounds(MAX_RESTARTS_PER_MIN + 1)
    assert any("engine-1 keeps exiting (more than" in m for m in sup.said), sup.said


@pytest.mark.timeout(120)
def test_spares_that_keep_dying_are_held_back_without_stopping_the_cluster(tmp_path):
    sup = Dying(tmp_path, spares=1)
    sup._next_look = float("inf")      # no Redis here: only the restart path starts spares
    sup._spawn_spare()
    assert sup.run_rounds(MAX_RESTARTS_PER_MIN + 1)
    assert any("hot spares keep exiting" in m for m in sup.said), sup.said
    assert sup.children == []          # none started again for a minute
    assert sup.run_rounds(1)


class Sleeping(Supervisor):
    """Children that run until killed (a frozen engine stands for itself), on a real Redis."""

    namespace = "sup"
    world = 2

    def __init__(self, log_dir: Path, url: str, namespace: str) -> None:
        self.said: list[str] = []
        super().__init__(log_dir, out=self.said.append)
        self.url, self.namespace, self.spares = url, namespace, 0

    @staticmethod
    def _popen(args, env, log) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


@pytest.mark.timeout(60)
def test_an_engine_still_running_after_its_slot_lapsed_is_killed_and_replaced(tmp_path, redis_url, namespace,
                                                                              monkeypatch):
    # A frozen rank (kill -STOP, a wedged step loop) stopped the whole group for as long as
    # it stayed frozen under `lockstep up --spares 0`: only a process that exits was replaced.
    import socket
    import time

    import redis

    from services.admin import supervisor as sup_mod
    from shared.keys import Keys

    monkeypatch.setattr(sup_mod, "WEDGED_AFTER_S", 0.5)
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    sup = Sleeping(tmp_path, redis_url, namespace)
    try:
        sup._spawn("engine-1", ["engine-worker"], {})
        sup._spawn("spare-1", ["engine-worker"], {})       # waiting for a slot: never judged
        sup._spawn("engine-0", ["engine-worker"], {})      # leaving: gave its slot back, slow to exit
        frozen, leaving = sup.children[0].proc, sup.children[2].proc
        for rank, proc in ((1, frozen), (0, leaving)):
            r.hset(k.rank_info(rank), mapping={"pid": proc.pid, "token": f"t{rank}", "host": socket.gethostname()})
            r.set(k.rank_alive(rank), f"t{rank}")
        assert sup.supervise() and frozen.poll() is None   # holds its slot: healthy

        r.delete(k.rank_alive(1))                          # its heartbeat stopped: the slot lapsed
        # the other released its slot on its way out and said so first (it was killed
        # mid-leave: its hand-over and group close take seconds)
        r.set(k.exiting(socket.gethostname(), leaving.pid), 0, px=60_000)
        r.delete(k.rank_alive(0))
        sup._next_look = 0.0
        sup.reap_wedged(None)                              # Redis unreadable: nothing judged across it
        assert sup.supervise() and frozen.poll() is None   # not yet: the first look without it
        time.sleep(0.6)
        sup._next_look = 0.0
        assert sup.supervise()
        assert frozen.wait(10) == -9
        assert any("still runs" in m and "slot lapsed" in m for m in sup.said), sup.said
        assert sup.supervise()                             # next round: started again for its rank
        assert sup.children[0].proc is not frozen and sup.children[0].proc.poll() is None
        assert any("engine-1 exited with code -9; restarted it" in m for m in sup.said), sup.said
        assert sup.children[1].proc.poll() is None         # the spare was left alone
        assert leaving.poll() is None                      # and the rank on its way out
    finally:
        for c in sup.children:
            c.proc.kill()
            c.proc.wait(10)
        r.close()


@pytest.mark.timeout(60)
def test_the_supervisor_reads_redis_over_one_kept_connection(tmp_path, redis_url, namespace):
    # It looks at the rank slots once a second; it opened (and closed) a fresh connection
    # for every look, and one more for each process it suspected.
    import os

    import redis

    r = redis.Redis.from_url(redis_url)
    sup = Sleeping(tmp_path, redis_url, namespace)
    mine = f"-{os.getpid()}"

    def connection_ids() -> set[int]:
        return {c["id"] for c in r.client_list() if c.get("name", "").endswith(mine)}
    try:
        sup._spawn("engine-0", ["engine-worker"], {})
        others = connection_ids()                          # (earlier tests' supervisors in this process)
        seen = set()
        for _ in range(4):
            sup._next_look = 0.0
            assert sup.supervise()
            seen |= connection_ids() - others
        assert len(seen) == 1, seen
        sup.stop()
        assert connection_ids() - others == set()          # closed as the supervisor stops
    finally:
        for c in sup.children:
            c.proc.kill()
            c.proc.wait(10)
        r.close()


class Stubborn(Supervisor):
    """Children that ignore SIGTERM and SIGINT (a service stuck in its shutdown)."""

    url = "redis://127.0.0.1:1/0"
    namespace = "sup"
    world = 1
    spares = 0

    @staticmethod
    def _popen(args, env, log) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN); print(1, flush=True); "
                                 "time.sleep(120)"], stdout=subprocess.PIPE)


@pytest.mark.timeout(60)
def test_a_stop_ends_every_group_within_its_one_deadline(tmp_path):
    # `lockstep up` stops api-servers, then the scheduler, then the engines; each group had
    # a deadline of its own, so a stop under load took 18 s of the 10 it allowed.
    import signal
    import time

    from services.admin.supervisor import STOP_FLOOR_S

    sup = Stubborn(tmp_path)
    for role in ("api-0", "scheduler-0", "engine-0"):
        sup._spawn(role, [], {})
    for c in sup.children:
        c.proc.stdout.readline()                           # its signal handlers are set
    procs = [c.proc for c in sup.children]
    timeout_s = 2 * STOP_FLOOR_S + 1.0
    t0 = time.monotonic()
    sup._stop_children([("api", signal.SIGTERM), ("scheduler", signal.SIGTERM), ("engine", signal.SIGINT)],
                       timeout_s)
    took = time.monotonic() - t0
    assert all(p.poll() == -9 for p in procs)              # killed at their turn's end
    assert took < timeout_s + 1.0, took
    assert sup.children == []


@pytest.mark.timeout(60)
def test_no_engine_is_judged_wedged_while_redis_refuses_writes(tmp_path, redis_url, namespace, monkeypatch):
    # A rank's heartbeat is a write: while a full Redis refuses writes every slot lapses,
    # and an OOM of 25 s had 3 of 4 healthy ranks killed as wedged.
    import socket
    import time

    import redis

    from services.admin import supervisor as sup_mod
    from shared.keys import Keys

    monkeypatch.setattr(sup_mod, "WEDGED_AFTER_S", 0.5)
    r, k = redis.Redis.from_url(redis_url), Keys(namespace)
    sup = Sleeping(tmp_path, redis_url, namespace)
    try:
        sup._spawn("engine-1", ["engine-worker"], {})
        engine = sup.children[0].proc
        r.hset(k.rank_info(1), mapping={"pid": engine.pid, "token": "t1", "host": socket.gethostname()})
        r.set(k.rank_alive(1), "t1")
        assert sup.supervise()
        r.delete(k.rank_alive(1))                          # its heartbeat refused: the slot lapsed
        r.config_set("maxmemory", 1)                       # (noeviction: every write refused)
        for _ in range(3):
            sup._next_look = 0.0
            assert sup.supervise()
            time.sleep(0.3)
        assert engine.poll() is None, sup.said             # not judged across the refusal
        r.config_set("maxmemory", 0)
        sup._next_look = 0.0
        assert sup.supervise() and engine.poll() is None   # the count starts again once writes pass
        time.sleep(0.6)
        sup._next_look = 0.0
        assert sup.supervise()
        assert engine.wait(10) == -9                       # still without its slot: wedged after all
    finally:
        r.config_set("maxmemory", 0)
        for c in sup.children:
            c.proc.kill()
            c.proc.wait(10)
        r.close()
