"""Child processes of one machine: spawn them, replace the ones that die, stop them in order.

``lockstep up`` (a whole cluster on one machine) and ``lockstep engine`` (this host's
ranks of a group that spans many) both supervise engine processes the same way, so the
rules live here once: an engine that dies frees its rank slot at once and announces it
(a hot spare, on any host, takes the rank over); a fresh spare is started in its place,
or, without spares, the process starts again for its own rank; a child that keeps dying
stops the supervisor. Children get PDEATHSIG, so even a SIGKILL of the supervisor takes
them down.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, TypeVar

from shared import keys as K
from shared import lease
from shared.bus import connect
from shared.redis_server import die_with_parent

T = TypeVar("T")

MAX_RESTARTS_PER_MIN = 5
# An engine process still running this long after its rank slot lapsed (read in
# successive looks at Redis, so an outage is not taken for it) is wedged: frozen, stuck in
# its step loop, or cut off from Redis. Killed, it is replaced like a crash.
WEDGED_AFTER_S = 5.0
# A stop's one deadline keeps this long for each later group of services to end cleanly
# (an engine group's stop: its last step, its output streams' last writes).
STOP_FLOOR_S = 2.0


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


class Supervisor:
    """The children of one machine. Subclasses set ``url`` (the Redis URL) and define
    ``namespace``, ``world`` (the group's rank count) and ``spares`` (hot spares kept)."""

    url: str
    namespace: str
    world: int
    spares: int
    _host = socket.gethostname().encode()   # the host its engines record in their rank info

    def __init__(self, log_dir: Path, out: Callable[[str], Any] = print) -> None:
        self.out = out
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.spare_env: dict[str, str] = {}
        self.spares_started = 0
        self._deaths: dict[str, list[float]] = {}   # recent deaths: per rank, per role, of the spares
        self._spares_held_until = 0.0               # no spare started before (they kept dying)
        self._next_look = 0.0
        self._held_pids: set[int] = set()           # engine processes seen holding a rank slot
        self._unheld_since: dict[int, float] = {}   # ... and no longer holding it, since
        self._loop: asyncio.Runner | None = None     # the looks at Redis: one loop, one client
        self._redis: Any = None

    def _look(self, read: Callable[[Any], Awaitable[T]]) -> T:
        """Run one read of Redis with the supervisor's client, kept between looks (it
        opened a fresh connection every second). A failed read drops the client, and the
        next look connects again; the error is the caller's."""
        if self._loop is None:
            self._loop = asyncio.Runner()

        async def go() -> T:
            if self._redis is None:
                self._redis = connect(self.url, timeout_s=2.0)
            return await read(self._redis)
        try:
            return self._loop.run(go())
        except Exception:
            self._close_redis()
            raise

    def _close_redis(self) -> None:
        client, self._redis = self._redis, None
        if self._loop is None:
            return
        try:
            if client is not None:
                self._loop.run(asyncio.wait_for(client.aclose(), 2.0))
        except Exception:  # noqa: BLE001 - a dead connection needs no goodbye
            pass
        finally:
            self._loop.close()
            self._loop = None

    def say(self, msg: str) -> None:
        """A supervisor event, with the time it happened (to lay beside the services' logs)."""
        self.out(f"lockstep: {time.strftime('%H:%M:%S')} {msg}")

    def _spawn(self, role: str, args: list[str], env: dict[str, str]) -> None:
        log = self.log_dir / f"{role}.log"
        self.children.append(Child(role, self._popen(args, env, log), log, args, env))

    def _spawn_spare(self) -> None:
        self.spares_started += 1
        self._spawn(f"spare-{self.spares_started}", ["engine-worker"], self.spare_env)

    @staticmethod
    def _popen(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        fh = open(log, "ab")
        try:
            return subprocess.Popen([sys.executable, "-m", "services.admin.cli", *args], env=env,
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=die_with_parent)
        finally:
            fh.close()

    def _restart(self, c: Child, code: int) -> bool:
        """Replace a dead child; give up if it keeps dying. An engine process's slot is
        freed at once and announced, so a hot spare takes the rank over (the scheduler
        resumes the dead one's requests meanwhile); a fresh spare is started in its
        place. Without spares the process starts again for its own rank.

        Deaths count per rank, whichever process held it (a rank whose every process
        dies stops the supervisor: nothing could serve), per role for the other
        services, and for the waiting spares together: spares that keep dying are not
        started again for a minute, but the cluster serving without them goes on."""
        engine = c.role.startswith(("engine-", "spare-"))
        # An engine that exits 0 while the cluster runs left on purpose (SIGTERM: a rolling
        # restart of one rank); it handed its requests over and gave its slot back. Its
        # replacement is routine, not a crash: it does not count towards the limit.
        planned = engine and code == 0
        how = "left the group (planned)" if planned else f"exited with code {code}"
        rank = None
        if engine:
            try:
                rank = self._look(lambda r: self._release_rank(r, c.proc.pid))
            except Exception:  # noqa: BLE001 - the heartbeat TTL frees the slot anyway
                pass
        named = c.role.removeprefix("engine-")
        held = rank if rank is not None else int(named) if c.role.startswith("engine-") and named.isdigit() else None
        key = f"rank {held}" if held is not None else "spares" if c.role.startswith("spare-") else c.role
        now = time.monotonic()
        if not planned:
            self._deaths[key] = [t for t in self._deaths.get(key, []) if now - t < 60] + [now]
            if len(self._deaths[key]) > MAX_RESTARTS_PER_MIN:
                if key != "spares":
                    return False
                self.children.remove(c)
                self._spares_held_until = now + 60
                self.say(f"hot spares keep exiting (more than {MAX_RESTARTS_PER_MIN} times in a minute); "
                         f"none started for a minute, the cluster serves on without. Log: {c.log}")
                return True
        if engine and self.spares > 0:
            self.children.remove(c)
            spare = f"a hot spare takes rank {rank}; " if rank is not None else ""
            if self._waiting_spares() >= self.spares or now < self._spares_held_until:
                self.say(f"{c.role} {how}; {spare}Log: {c.log}")
                return True
            self._spawn_spare()
            self.say(f"{c.role} {how}; {spare}started "
                     f"{self.children[-1].role} in its place. Log: {c.log}")
            return True
        c.proc = self._popen(c.args, c.env, c.log)
        self.say(f"{c.role} {how}; restarted it. Log: {c.log}")
        return True

    async def _held_slots(self, r: Any, proof_of_writes: bool = False) -> dict[int, tuple[int, bytes]]:
        """rank → (pid, token) of every rank slot held now (its alive key carries the
        token its info names): one pipelined read; with ``proof_of_writes`` it writes this
        supervisor's key first, and raises if Redis refuses that write."""
        k = K.Keys(self.namespace)
        pipe = r.pipeline(transaction=False)
        if proof_of_writes:
            pipe.set(k.supervisor(self._host.decode()), os.getpid(), px=3000)
        for rank in range(self.world):
            pipe.hmget(k.rank_info(rank), ["pid", "token", "host"])
            pipe.get(k.rank_alive(rank))
        res = (await pipe.execute())[int(proof_of_writes):]
        held = {}
        for rank in range(self.world):
            (pid, token, host), alive = res[2 * rank], res[2 * rank + 1]
            # (a pid of another host's process is not one of ours)
            if token is not None and alive == token and host in (None, self._host):
                held[rank] = (int(pid or 0), token)
        return held

    def held_by_pid(self) -> dict[int, int]:
        """pid → the rank it holds, for every rank slot held now. Raises where Redis
        refuses writes: a rank's heartbeat is one, so a slot lapses then whatever its
        process does (an OOM of 25 s had 3 of 4 healthy ranks killed as wedged)."""
        held = self._look(lambda r: self._held_slots(r, proof_of_writes=True))
        return {pid: rank for rank, (pid, _) in held.items()}

    def reap_wedged(self, held_by_pid: dict[int, int] | None) -> None:
        """Kill an engine process that held a rank slot and has not for WEDGED_AFTER_S
        while it still runs (``held_by_pid`` None: Redis could not be read, and nothing is
        judged across it). A frozen rank stopped the whole group for as long as it stayed
        frozen: only a process that exits was replaced, and without spares nothing took its
        slot. Its replacement (a spare, or the process started again) follows next round."""
        now = time.monotonic()
        if held_by_pid is None:
            self._unheld_since.clear()
            return
        for c in self.children:
            pid = c.proc.pid
            if not c.role.startswith(("engine-", "spare-")) or c.proc.poll() is not None:
                continue
            if pid in held_by_pid:
                self._held_pids.add(pid)
                self._unheld_since.pop(pid, None)
                continue
            if pid not in self._held_pids:
                continue              # starting, or a spare waiting for a slot
            since = self._unheld_since.setdefault(pid, now)
            if now - since >= WEDGED_AFTER_S and not self._exiting(pid):
                self.say(f"{c.role} (pid {pid}) still runs {now - since:.0f}s after its rank slot lapsed "
                         f"(frozen, stuck, or cut off from Redis); killed it to replace it. Log: {c.log}")
                c.proc.kill()
                self._held_pids.discard(pid)
                self._unheld_since.pop(pid, None)

    def _exiting(self, pid: int) -> bool:
        """The process gave its slot back and is on its way out (it says so in Redis before
        the release: a rank leaving alone, a group stop, a refusal), however long that takes;
        True too when Redis cannot tell (never kill on a guess)."""
        key = K.Keys(self.namespace).exiting(self._host.decode(), pid)
        try:
            return bool(self._look(lambda r: r.exists(key)))
        except Exception:  # noqa: BLE001 - unknown: judged again next round
            return True

    def _waiting_spares(self) -> int:
        return sum(1 for c in self.children if c.role.startswith("spare-") and c.proc.poll() is None)

    def top_up_spares(self, held_by_pid: dict[int, int]) -> None:
        """A spare of this machine that took a rank slot serves that rank now: name it for
        the rank and start a fresh spare, so ``spares`` always wait here. Without it a host
        of spares that took a dead host's ranks had none left for the next loss."""
        for c in self.children:
            if c.role.startswith("spare-") and c.proc.poll() is None and c.proc.pid in held_by_pid:
                rank = held_by_pid[c.proc.pid]
                self.say(f"{c.role} serves rank {rank} now; it is engine-{rank} (log {c.log})")
                c.role = f"engine-{rank}"
        if time.monotonic() < self._spares_held_until:
            return
        for _ in range(self.spares - self._waiting_spares()):
            self._spawn_spare()
            self.say(f"started {self.children[-1].role} to keep {self.spares} hot "
                     f"spare{'s' * (self.spares != 1)} waiting. Log: {self.children[-1].log}")

    async def _release_rank(self, r: Any, dead_pid: int) -> int | None:
        """The supervisor saw an engine process die: free the slot it held now instead of
        waiting for its heartbeat to lapse, and announce it (a hot spare pops the list and
        claims the slot at once; the scheduler resumes the requests as the rank leaves).
        Returns the rank it held, if any (a spare holds none)."""
        k = K.Keys(self.namespace)
        for rank, (pid, token) in (await self._held_slots(r)).items():
            if pid == dead_pid:
                # Compare-and-delete: a spare may have taken the slot since the read.
                if not await lease.release(r, k.rank_alive(rank), token.decode()):
                    return None
                pipe = r.pipeline(transaction=True)
                pipe.lpush(k.vacancies, rank)
                pipe.ltrim(k.vacancies, 0, 63)
                await pipe.execute()
                return rank
        return None

    def supervise(self) -> bool:
        """One round of the supervisor: replace the children that exited and, once a
        second, kill the engines wedged (reap_wedged) and replace the spares that took a
        rank slot. False (and the children stopped) when one keeps exiting. ``lockstep
        chaos`` drives it too."""
        for c in list(self.children):
            code = c.proc.poll()
            if code is None:
                continue
            if not self._restart(c, code):
                self.say(f"{c.role} keeps exiting (more than {MAX_RESTARTS_PER_MIN} times in a minute); "
                         f"stopping. Log: {c.log}")
                self.stop()
                return False
        if time.monotonic() >= self._next_look and any(c.role.startswith(("engine-", "spare-"))
                                                        for c in self.children):
            self._next_look = time.monotonic() + 1.0
            try:
                held = self.held_by_pid()
            except Exception:  # noqa: BLE001 - Redis blip: looked at again in a second
                held = None
            self.reap_wedged(held)
            if held is not None and self.spares > 0:
                self.top_up_spares(held)
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_children([(("engine", "spare"), signal.SIGTERM)], timeout_s)

    def _stop_children(self, order: Iterable[tuple[Any, int]], timeout_s: float) -> None:
        """Signal each group of children (role prefix, signal) in turn and wait for it,
        all within ``timeout_s``: each group may run until the deadline less STOP_FLOOR_S
        for each group after it, and what still runs then is killed. (A deadline per group
        let a stop under load take 18 s of the 10 it allowed.)"""
        order = list(order)
        deadline = time.monotonic() + timeout_s
        for i, (prefix, sig) in enumerate(order):
            group = [c for c in self.children if c.role.startswith(prefix) and c.proc.poll() is None]
            for c in group:
                c.proc.send_signal(sig)
            until = deadline - STOP_FLOOR_S * (len(order) - 1 - i)
            for c in group:
                try:
                    c.proc.wait(max(0.1, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(5)
        self.children = [c for c in self.children if c.proc.poll() is None]
        self._close_redis()

    def wait_for_signal(self, poll_s: float = 0.2) -> int:
        """Block until SIGINT/SIGTERM/SIGHUP (then stop the children: 0) or until a child
        keeps dying (1), replacing the ones that exit meanwhile."""
        stop = {"sig": None}

        def on_signal(signum: int, _: Any) -> None:
            stop["sig"] = signum

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
        while stop["sig"] is None:
            if not self.supervise():
                return 1
            time.sleep(poll_s)
        self.out("lockstep: stopping...")
        self.stop()
        return 0


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
