"""How one engine process belongs to the DP+EP group: rank slot, heartbeat, rendezvous,
and re-forming the group when a rank dies or a replacement joins.

An object the worker owns, with explicit inputs: the settings, the Redis client, the log,
the stop event, and two callbacks for the group's (wave, step) counters, which the worker
steps and a formation may replace (``counters`` reads them, ``adopt`` sets them).

- A rank slot is claimed with ``SET <ns>:rank:<r>:alive <token> NX PX`` and kept alive by
  a liveness thread (independent of the event loop, which the step collective blocks)
  while the step loop makes progress (``mark_progress``).
- The group has a generation (``<ns>:dist`` ``gen``): rank 0 publishes where generation g+1
  meets; the others wait for a generation newer than theirs. On a failed collective, or a
  replacement's notice while paused, every rank leaves and meets again.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any, Callable

from services.engine_worker import group_signature
from services.engine_worker.lockstep import GroupBroken, LockstepGroup
from services.engine_worker.step_view import STEP_PROTOCOL
from shared import keys as K
from shared import lease
from shared.bus import connect_sync, ensure_group
from shared.replies import str_keys
from shared.messages import FIELD, WaveNotice, encode
from shared.redis_server import free_port


EXITING_KEEP_MS = 120_000    # <ns>:exiting:<host>:<pid>: longer than any way out takes


class ClaimFailed(RuntimeError):
    pass


class GroupLost(RuntimeError):
    """This rank could not rejoin its engine group within ``reform_timeout_s``: the
    process exits non-zero and its supervisor replaces it."""


class VersionMismatch(RuntimeError):
    """Rank 0 runs another step protocol (another lockstep version): the rows would not
    line up, so this rank refuses to join and the process exits with code 7. Retrying
    cannot help: the group must run one version."""


class GroupMismatch(VersionMismatch):
    """Rank 0 runs another backend, device kind or model (group_signature.py): the
    collectives cannot line up, so this rank refuses to join and exits with code 7, as for
    another version."""


class GroupMembership:
    """This process's place in the engine group (see the module docstring). Owns the rank,
    the group (``group``, what the step loop exchanges on), its generation and the
    re-formation count."""

    def __init__(self, settings: Any, r: Any, keys: K.Keys, log: Any, stopping: asyncio.Event, token: str,
                 counters: Callable[[], tuple[int, int]], adopt: Callable[[int, int], None],
                 on_slot_lost: Callable[[Any], None] | None = None) -> None:
        self.s, self.r, self.keys, self.log, self.stopping, self.token = settings, r, keys, log, stopping, token
        self.counters, self.adopt = counters, adopt
        if on_slot_lost is not None:
            self._on_slot_lost = on_slot_lost   # type: ignore[method-assign] - tests: not exit
        self.rank = settings.rank               # -1 until a slot is claimed (any free one)
        self.gen = 0                            # generation of the engine group this rank is in
        self.reforms = 0
        self.group: LockstepGroup | None = None
        self.stepping = False                   # the step loop runs (liveness then follows its progress)
        self.progress_t: float | None = None    # monotonic time of the step loop's last round
        self.consumer = ""                      # this incarnation's inbox consumer (prepare_streams)
        self.ran = False                        # rank 0: the group formed under it (dist's "ran")
        self.formed_once = False                # this process has been in a formed group
        self.signature = group_signature.encode(group_signature.signature(settings))

    async def claim_rank(self) -> int:
        """Take a rank slot with SET NX PX: the first free one, or the one asked for; it
        becomes ``rank``."""
        ttl = self.s.heartbeat_ms * 3
        wanted = [self.rank] if self.rank >= 0 else list(range(self.s.ranks))
        deadline = time.monotonic() + max(10.0, ttl / 1000 * 2)
        while time.monotonic() < deadline:
            rank = await self._try_claim(wanted, ttl)
            if rank is not None:
                self.rank = rank
                return rank
            await asyncio.sleep(ttl / 1000 / 4)   # a dead rank's key lapses within ttl
        raise ClaimFailed(f"no free rank slot among {wanted} in namespace {self.s.namespace!r}; "
                          f"are {self.s.ranks} engine-workers already running?")

    async def _try_claim(self, wanted: list[int], ttl: int) -> int | None:
        pipe = self.r.pipeline(transaction=False)
        for r in wanted:
            pipe.set(self.keys.rank_alive(r), self.token, nx=True, px=ttl)
        replies = await pipe.execute(raise_on_error=False)
        won = [r for r, ok in zip(wanted, replies) if ok is True]
        refused = next((e for e in replies if isinstance(e, Exception)), None)
        if refused is not None and not won:
            raise refused       # (a full Redis: the caller waits it out)
        if len(won) > 1:   # one slot per process: give back the others at once
            pipe = self.r.pipeline(transaction=False)
            for r in won[1:]:
                lease.release(pipe, self.keys.rank_alive(r), self.token)
            await pipe.execute()
        return won[0] if won else None

    async def wait_as_spare(self) -> int | None:
        """Hot spare: everything is imported and connected; wait, without limit, for a rank
        slot to free and take it. ``lockstep up`` pushes the rank of a process it saw die to
        the vacancies list (the pop wakes this at once, and the slot is taken at once);
        without a supervisor the slot frees when the dead rank's alive key lapses, and is
        taken once it stayed free for two heartbeats (a live rank re-takes its own within one). Only the
        slots of a group that has run are taken (``ran`` in ``ls:dist``, kept while the
        group re-forms): a spare replaces ranks, it does not race the ranks still starting
        up for theirs. Returns None when asked to stop first."""
        ttl = self.s.heartbeat_ms * 3
        beat_s = self.s.heartbeat_ms / 1000
        wanted = [self.rank] if self.rank >= 0 else list(range(self.s.ranks))
        me = self.keys.spare(self.token)
        self.log.info("spare_waiting", ranks=len(wanted))
        free_since: dict[int, float] = {}   # rank -> when this spare first saw its slot free
        vacant: set[int] = set()            # announced by a supervisor that saw its process die
        try:
            while not self.stopping.is_set():
                pipe = self.r.pipeline(transaction=False)
                pipe.set(me, f"{os.getpid()}@{socket.gethostname()}", px=ttl)
                pipe.hget(self.keys.dist, "ran")
                for r in wanted:
                    pipe.exists(self.keys.rank_alive(r))
                _, ran, *held = await pipe.execute()
                now = time.monotonic()
                for r, h in zip(wanted, held):
                    if h:
                        free_since.pop(r, None)
                    else:
                        free_since.setdefault(r, now)
                # A free slot is a dead rank's once it stayed free for two heartbeats: right
                # after a Redis restart (empty, or from a snapshot whose alive keys expired)
                # every slot is free until its live owner's next beat, and a spare taking
                # one then evicted a healthy rank. An announced vacancy is taken at once.
                ready = [r for r in wanted if r in free_since and (r in vacant or now - free_since[r] >= 2 * beat_s)]
                rank = await self._try_claim(ready, ttl) if ran == b"1" and ready else None
                if rank is not None:
                    self.log.warning("spare_took_rank", rank=rank)
                    self.rank = rank
                    return rank
                # A pop only says "try now": stale entries are harmless, the SET NX decides.
                popped = await self.r.blpop([self.keys.vacancies], timeout=beat_s)
                vacant = {int(popped[1])} if popped and popped[1].isdigit() else set()
            return None
        finally:
            try:
                await self.r.delete(me)
            except Exception:  # noqa: BLE001 - it lapses within its TTL anyway
                pass

    def mark_progress(self) -> None:
        """The step loop (or a pause, a hold, a re-formation) went round once more."""
        self.progress_t = time.monotonic()

    def _stall_bound_s(self) -> float:
        """Longest a healthy rank's loop may go without a round: a step (at most
        ``collective_timeout_s``, by that setting's rule) plus a collective waiting out a
        hung peer (``collective_timeout_s``) plus a few heartbeats of slack."""
        return 2 * self.s.collective_timeout_s + 3 * self.s.heartbeat_ms / 1000

    def _stalled_s(self) -> float | None:
        """Seconds since the step loop's last round when that exceeds the bound (a wedged
        rank), else None. Before the step loop starts (start-up, model load) never."""
        t = self.progress_t
        if t is None or not self.stepping:
            return None
        idle = time.monotonic() - t
        return idle if idle > self._stall_bound_s() else None

    def _on_slot_lost(self, holder: Any) -> None:
        """Another process holds this rank's slot now (ours lapsed: a stall, a partition):
        this process is stale and must not run as that rank any longer. It exits at
        once, as a crash would; the group re-forms with the slot's new owner."""
        self.log.error("rank_slot_lost", holder=str(holder)[:40])
        os._exit(5)

    def start_liveness(self, on_beat_failed: Callable[[float], None] = lambda now: None) -> Callable[[], None]:
        """Renew this rank's alive key (and identity) from a thread with its own connection.

        The step collective runs on the event loop thread (a thread hop would cost more
        than the collective itself), and a hung peer holds it there for up to
        collective_timeout_s, longer than the key lives: liveness must not depend on the
        loop. But it follows it: the key is renewed only while the step loop makes
        progress (``mark_progress`` within ``_stall_bound_s``); a wedged rank stops
        renewing, its slot lapses and a spare takes it, and ``stalled_s`` in its info
        tells the health check why. Renewal is fenced (shared/lease.py): it never
        overwrites another owner's token; finding one, this process leaves
        (``_on_slot_lost``). ``on_beat_failed`` gets the monotonic time of each failed beat
        (from this thread). Returns what stops it (blocking until its last beat is written)."""
        done = threading.Event()
        ttl = self.s.heartbeat_ms * 3
        alive_key, info_key = self.keys.rank_alive(self.rank), self.keys.rank_info(self.rank)
        identity = {"pid": os.getpid(), "host": socket.gethostname(), "backend": self.s.backend, "token": self.token,
                    "step_tokens": self.s.max_num_batched_tokens, "max_seqs": self.s.max_num_seqs,
                    "protocol": STEP_PROTOCOL, "signature": self.signature}
        client = connect_sync(self.s.redis_url, timeout_s=max(0.5, self.s.heartbeat_ms / 1000),
                              connect_timeout_s=max(0.5, self.s.heartbeat_ms / 1000))
        log = self.log

        def beat() -> None:
            failing_since: float | None = None     # monotonic: the first failed beat of this run of them
            said_at = 0.0
            while not done.is_set():
                stalled = self._stalled_s()
                try:
                    pipe = client.pipeline(transaction=False)
                    if stalled is None:
                        lease.renew(pipe, alive_key, self.token, ttl)
                    # Identity too, so a restarted (empty) Redis learns it again within a beat:
                    # the consumer name above all (without it the scheduler took this live
                    # rank's inbox consumer for a dead one's, and resumed its requests elsewhere)
                    pipe.hset(info_key, mapping={**identity, "stalled_s": round(stalled or 0.0, 1),
                                                 **({"consumer": self.consumer} if self.consumer else {})})
                    if self.ran:
                        # ... and that the group has run (rank 0): a spare takes a free slot
                        # only then, so without it a rank that died after the restart was
                        # never replaced and the group waited for it until it gave up
                        pipe.hset(self.keys.dist, "ran", 1)
                    if self.group is not None and self.s.ranks > 1:
                        # ... and the generation this rank's group formed under (only where
                        # the fields are gone: a rendezvous in progress owns them). Without
                        # them a replacement joining a paused group after the restart sent
                        # no notice (announce_replacement), the survivors slept on, and its
                        # requests waited for ever.
                        pipe.hsetnx(self.keys.dist, "gen", self.gen)
                        pipe.hsetnx(self.keys.dist, "formed", 1)
                    res = pipe.execute()
                    if stalled is not None:
                        log.error("rank_stalled", stalled_s=round(stalled, 1), bound_s=self._stall_bound_s())
                    elif not lease.is_holder(res[0], self.token):
                        self._on_slot_lost(res[0])
                        return
                    if failing_since is not None:
                        log.info("heartbeat_restored", after_s=round(time.monotonic() - failing_since, 1))
                    failing_since = None
                except Exception as exc:  # noqa: BLE001 - keep beating through blips
                    now = time.monotonic()
                    on_beat_failed(now)
                    if failing_since is None:
                        failing_since = said_at = now
                        log.warning("heartbeat_failed", error=str(exc)[:200])
                    elif now - said_at >= 30:
                        # said again while it lasts: a Redis that refuses this connection for good
                        # (maxclients reached) leaves the slot lapsed and the group short of a rank
                        said_at = now
                        log.error("heartbeat_failing", for_s=round(now - failing_since), error=str(exc)[:200],
                                  hint="this rank's slot lapses while it lasts; if Redis says 'max number of "
                                       "clients reached', raise its maxclients (docs/operations.md)")
                done.wait(self.s.heartbeat_ms / 1000)
            client.close()

        thread = threading.Thread(target=beat, name=f"rank{self.rank}-liveness", daemon=True)
        thread.start()

        def stop() -> None:
            done.set()
            thread.join(timeout=2 * max(0.5, self.s.heartbeat_ms / 1000))

        return stop

    async def prepare_streams(self, consumer: str) -> tuple[bytes, bytes]:
        """The inbox's consumer group and this process's identity in ``<ns>:rank:<r>:info``;
        returns where reading starts: the inbox's last delivered id and the last wake notice."""
        inbox_last, wave_last = b"0-0", b"0-0"
        inbox = self.keys.inbox(self.rank)
        await ensure_group(self.r, inbox, K.ENGINE_GROUP, "0")
        groups = await self.r.xinfo_groups(inbox)
        for g in groups:
            g = str_keys(g)
            if g["name"] in (K.ENGINE_GROUP, K.ENGINE_GROUP.encode()):
                inbox_last = g["last-delivered-id"]
        last = await self.r.xrevrange(self.keys.wave, count=1)
        if last:
            wave_last = last[0][0]
        self.consumer = consumer
        await self.r.hset(self.keys.rank_info(self.rank), mapping={
            "pid": os.getpid(), "host": socket.gethostname(), "backend": self.s.backend,
            "started": time.time(), "token": self.token, "consumer": consumer,
            "step_tokens": self.s.max_num_batched_tokens, "max_seqs": self.s.max_num_seqs,
            "protocol": STEP_PROTOCOL, "signature": self.signature})
        return inbox_last, wave_last

    async def _rendezvous(self) -> tuple[str, int]:
        """Rank 0 publishes where the group meets, with a generation one above the last;
        the others wait (bounded) for a generation newer than the one they were in."""
        if self.s.ranks == 1:
            return self.s.group_host, 0
        if self.rank == 0:
            old, old_sig = await self.r.hmget(self.keys.dist, "gen", "signature")
            if old_sig is not None and old_sig.decode() != self.signature:
                await self._refuse_a_live_group(old_sig.decode())
            self.gen = max(self.gen, int(old or 0)) + 1
            port = free_port()
            open_ms = self._open_ms()
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(self.keys.dist, mapping={
                "addr": self.s.group_host, "port": port, "world": self.s.ranks, "token": self.token, "t": time.time(),
                "gen": self.gen, "formed": 0, "protocol": STEP_PROTOCOL, "signature": self.signature,
                "open_ms": open_ms})
            pipe.set(self.keys.dist_open, self.gen, px=open_ms)
            await pipe.execute()
            return self.s.group_host, port
        deadline = time.monotonic() + max(self.s.collective_timeout_s, 60.0)
        while time.monotonic() < deadline and not self.stopping.is_set():
            self.mark_progress()
            pipe = self.r.pipeline(transaction=False)
            pipe.hgetall(self.keys.dist)
            pipe.get(self.keys.rank_alive(0))
            pipe.get(self.keys.dist_open)
            d, rank0, still_open = await pipe.execute()
            # A rendezvous near the end of rank 0's wait is not joined: a rank that started
            # late (a replacement) connected as rank 0 gave up, timed out, and met the next
            # one late again (seen: four windows in a row, ~30 s). Redis's clock says when
            # (dist:open's PX), the same for every host; a rank 0 without it is joined as before.
            if d and rank0 and d.get(b"token") == rank0 and int(d.get(b"gen", 0)) > self.gen and \
                    (b"open_ms" not in d or still_open == d.get(b"gen")):
                self._check_protocol(d.get(b"protocol"))
                self._check_signature(d.get(b"signature"))
                self.gen = int(d[b"gen"])
                return d[b"addr"].decode(), int(d[b"port"])
            await asyncio.sleep(0.05)
        raise TimeoutError("rank 0 did not publish the rendezvous address in time")

    def _open_ms(self) -> int:
        """How long a rendezvous may be joined: rank 0 waits collective_timeout_s for the
        others, and a joiner needs the rest (a connect, its keys) to be in before that."""
        wait = self.s.collective_timeout_s
        return max(200, int((wait - min(1.5, wait / 3)) * 1000))

    def _check_protocol(self, published: bytes | None) -> None:
        if published is not None and published.decode() == str(STEP_PROTOCOL):
            return
        theirs = f"step protocol {published.decode()}" if published is not None else \
            "a lockstep version without a step protocol (an older one)"
        raise VersionMismatch(
            f"rank 0 runs {theirs}, this rank step protocol {STEP_PROTOCOL}: the ranks of a group exchange "
            f"fixed-width step rows, so every rank must run the same lockstep version. Stop the whole "
            f"group and start every rank on one version (docs/operations.md, 'One version per group').")

    def _check_signature(self, published: bytes | None) -> None:
        if published is None or published.decode() == self.signature:   # (None: rank 0 predates it)
            return
        diff = group_signature.differences(group_signature.decode(self.signature),
                                           group_signature.decode(published.decode()))
        raise GroupMismatch(
            f"rank 0 runs another group: {'; '.join(diff)}. Every rank of a group runs one backend, device "
            f"kind and model (the experts' all-to-all exchanges its tensors at every step): start this rank with "
            f"rank 0's settings (LOCKSTEP_BACKEND, LOCKSTEP_DEVICE, LOCKSTEP_MODEL, LOCKSTEP_DTYPE; `lockstep "
            f"config` shows them), or stop the whole group and start every rank with the new ones")

    async def _refuse_a_live_group(self, theirs: str) -> None:
        """Rank 0 whose group ran with another signature: where ranks of that group are
        still live (this process replaced rank 0: a spare or a restart started with other
        settings), this one is the odd rank, and refuses, rather than every good rank
        refusing it. With none of them live the group starts anew with this signature."""
        pipe = self.r.pipeline(transaction=False)
        for rank in range(1, self.s.ranks):
            pipe.exists(self.keys.rank_alive(rank))
            pipe.hget(self.keys.rank_info(rank), "signature")
        got = await pipe.execute()
        live = [rank for rank, alive, sig in zip(range(1, self.s.ranks), got[::2], got[1::2])
                if alive and sig is not None and sig.decode() == theirs]
        if live:
            diff = group_signature.differences(group_signature.decode(self.signature), group_signature.decode(theirs))
            raise GroupMismatch(
                f"this rank 0 would run another group than its live rank(s) {', '.join(map(str, live))}: "
                f"{'; '.join(diff).replace('on rank 0', 'on them')}. Start rank 0 with their settings "
                f"(LOCKSTEP_BACKEND, LOCKSTEP_DEVICE, LOCKSTEP_MODEL, LOCKSTEP_DTYPE; `lockstep config` shows "
                f"them), or stop the whole group and start every rank with the new ones")

    async def form_group(self) -> None:
        addr, port = await self._rendezvous()
        group = await asyncio.to_thread(
            LockstepGroup.init, self.rank, self.s.ranks, addr, port, self.s.collective_timeout_s, self.s.device,
            self.s.group_host)   # this rank listens where it advertises (lockstep engine --advertise-addr)
        try:
            await self._adopt_group_counters(group)
        except GroupBroken:
            await asyncio.to_thread(group.close)
            raise
        self.group = group
        self.formed_once = True
        if self.rank == 0:
            # formed: this generation (reset by the next rendezvous); ran: the group has
            # run at least once, so its free slots are a spare's to take (kept across them,
            # and renewed by the heartbeat: start_liveness).
            await self.r.hset(self.keys.dist, mapping={"formed": 1, "ran": 1})
            self.ran = True
        self.log.info("engine_group_formed", gen=self.gen, world=self.s.ranks)

    async def _adopt_group_counters(self, group: LockstepGroup) -> None:
        """The (wave, step) counters belong to the group, not to a process: a replacement
        starts at (0, 0) while the survivors have moved on, and a group whose ranks count
        different waves ignores its own wake notices (a rank asleep at wave 2 skips a
        notice for wave 1 while its peer waits for it in the step collective). So every
        formation starts with one gather of the counters, and every rank adopts the
        largest (wave, step) of the group: the survivors keep theirs (they are equal:
        they stepped in lockstep), the replacement takes them over, and each rank's
        reports stay ordered per rank for the scheduler's aggregator. A group whose every
        rank is new (all died at once) has no survivor to carry them: it continues from the
        newest (wave, step) the namespace's ranks and scheduler recorded (_counters_floor).
        Restarting at (0, 0) there, every report was older than what the scheduler had seen
        for that rank, so it dropped them all and its view of the ranks froze."""
        was_wave, was_step = self.counters()
        floor = await self._counters_floor()
        rows = await asyncio.to_thread(group.gather, list(max((was_wave, was_step), floor)))
        wave, step = max((int(w), int(st)) for w, st in rows)
        if (wave, step) != (was_wave, was_step):
            self.log.info("engine_counters_adopted", wave=wave, step=step, was_wave=was_wave, was_step=was_step)
        self.adopt(wave, step)

    async def _counters_floor(self) -> tuple[int, int]:
        """The newest (wave, step) recorded for this namespace's group: every rank's last
        step (``<ns>:rank:<r>:info``) and the scheduler's last snapshot. (0, 0) where none is,
        or Redis does not answer within the bound (the gather still agrees on one pair)."""
        try:
            pipe = self.r.pipeline(transaction=False)
            for rank in range(self.s.ranks):
                pipe.hmget(self.keys.rank_info(rank), ["wave", "step"])
            pipe.hmget(self.keys.snapshot, ["wave", "step"])
            got = await asyncio.wait_for(pipe.execute(), 5)
        except Exception:  # noqa: BLE001 - a floor is an improvement, never a reason to fail
            return 0, 0
        return max(((int(w), int(st)) for w, st in got if w is not None and st is not None), default=(0, 0))

    async def announce_replacement(self) -> None:
        """Joining a group that already ran (this rank replaces a dead one): wake the
        paused survivors so they re-form now instead of at their next collective timeout."""
        d = await self.r.hgetall(self.keys.dist)
        if d and d.get(b"formed") == b"1":
            formed = int(d.get(b"gen", 0))
            if self.rank != 0:
                self.gen = formed
            # Tagged with the generation it replaces: ranks already past it ignore the notice.
            await self.r.xadd(self.keys.wave, {FIELD: encode(WaveNotice(-1, self.rank, formed))},
                              maxlen=K.WAVE_STREAM_MAXLEN, approximate=True)
            self.log.warning("engine_replacing_rank", gen=self.gen)

    async def reform(self, why: str) -> bool:
        """The group broke (a rank died or hung) or a replacement joined: leave the old
        group and meet again under a new generation. Work on this rank stays in memory;
        a step whose collectives were cut is simply computed again.

        Returns True once the group is whole again, False when asked to stop meanwhile
        (the step loop then ends: the old group is gone, no collective may run on it).
        Bounded: a rank that cannot rejoin within ``reform_timeout_s`` raises GroupLost and
        the process exits non-zero, so its supervisor replaces it (a fresh process, fresh
        torch state) instead of this one retrying in-process forever."""
        self.log.warning("engine_group_reforming", reason=why, gen=self.gen)
        await self._wake_paused_peers()
        # A re-formation is progress, bounded by reform_timeout_s, however long one attempt
        # takes (a close that waits out a broken group, a gloo mesh slow to connect): past
        # the stall bound a healthy rank stopped renewing its slot, and the supervisor
        # killed it as wedged. Ticked from the event loop: a loop that is stuck still stalls.
        ticker = asyncio.create_task(self._tick_while_forming())
        try:
            return await self._reform(why)
        finally:
            ticker.cancel()

    async def _wake_paused_peers(self) -> None:
        """Ask ranks paused in this generation to re-form too. An all-gather ends at
        different moments on different ranks: one that had every row when a peer died
        decided to pause while this one's collective failed, and slept through every
        rendezvous of this one until work came (seen: rank 0 retrying 3/4 for its whole
        reform_timeout_s). Best effort: without it a paused rank wakes on its next work."""
        if not self.gen:
            return    # never in a group: a replacement's own notice (announce_replacement) does it
        try:
            await asyncio.wait_for(self.r.xadd(self.keys.wave, {FIELD: encode(WaveNotice(-1, self.rank, self.gen))},
                                               maxlen=K.WAVE_STREAM_MAXLEN, approximate=True), 2)
        except Exception:  # noqa: BLE001 - Redis trouble: the paused ranks wake on their next work
            pass

    async def _tick_while_forming(self) -> None:
        while True:
            self.mark_progress()
            await asyncio.sleep(self.s.heartbeat_ms / 1000)

    async def _reform(self, why: str) -> bool:
        await self._leave_group()
        deadline = time.monotonic() + self.s.reform_timeout_s
        while not self.stopping.is_set():
            self.mark_progress()
            try:
                if not self.formed_once:
                    # Never in a group yet (a replacement whose first rendezvous failed):
                    # the survivors may not have heard it (a notice sent before their
                    # heartbeats put the group's generation back after a Redis restart).
                    await self.announce_replacement()
                await self.form_group()
                self.reforms += 1
                return True
            except VersionMismatch:
                raise
            except Exception as exc:  # noqa: BLE001 - retry the rendezvous until the group is whole
                odd = await self._other_versions()
                self.log.warning("engine_group_retry", error=str(exc)[:200],
                                 **({"other_versions": odd} if odd else {}))
                await self._leave_group()
                if time.monotonic() >= deadline:
                    raise GroupLost(f"the engine group did not re-form within {self.s.reform_timeout_s:g}s "
                                    f"(last error: {str(exc)[:160]})"
                                    + (f"; {odd}: run every rank on one lockstep version" if odd else "")) from None
                try:
                    await asyncio.wait_for(self.stopping.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        return False

    async def _other_versions(self) -> str:
        """Rank 0 after a failed formation: the live ranks whose record shows another step
        protocol. A rank that checks refuses rank 0's rendezvous itself (_check_protocol);
        one from before the check joins, and its rows break the collective instead."""
        if self.rank != 0 or self.s.ranks == 1:
            return ""
        try:
            pipe = self.r.pipeline(transaction=False)
            for rank in range(1, self.s.ranks):
                pipe.get(self.keys.rank_alive(rank))
                pipe.hget(self.keys.rank_info(rank), "protocol")
            got = await asyncio.wait_for(pipe.execute(), 2)   # bounded: the retry loop has a deadline
        except Exception:  # noqa: BLE001 - a hint for the log, never a reason to fail
            return ""
        odd = [f"rank {rank} runs step protocol {(proto or b'none').decode()}"
               for rank, alive, proto in zip(range(1, self.s.ranks), got[::2], got[1::2])
               if alive is not None and proto != str(STEP_PROTOCOL).encode()]
        return f"{', '.join(odd)} (this rank {STEP_PROTOCOL})" if odd else ""

    async def _leave_group(self) -> None:
        old, self.group = self.group, None
        try:
            if old is not None:
                await asyncio.wait_for(asyncio.to_thread(old.close), 10)
            else:
                await asyncio.to_thread(LockstepGroup.close_default)
        except Exception:  # noqa: BLE001 - a broken group may not close cleanly
            pass

    async def release(self, group_stopped: bool, leaving: bool) -> None:
        """Give the slot back (and with it what the next owner needs); close the group.
        ``group_stopped``: the whole group stopped together; ``leaving``: this rank left alone."""
        try:
            pipe = self.r.pipeline(transaction=False)
            # first: a supervisor that sees this process run on without its slot (closing
            # the group, ending the interpreter) knows it is leaving, not wedged
            pipe.set(self.keys.exiting(socket.gethostname(), os.getpid()), self.rank, px=EXITING_KEEP_MS)
            lease.release(pipe, self.keys.rank_alive(self.rank), self.token)   # only if still ours
            if self.rank == 0 and group_stopped:
                # Only when the whole group stops: a rank 0 that leaves alone (lost the
                # group, killed) keeps ``ran`` there, so a spare may take its slot.
                pipe.delete(self.keys.dist)
            if leaving and not group_stopped:
                # A planned leave (a rolling restart): a spare may take the slot now (the
                # pop wakes it), and the drain was this process's: the slot's next owner
                # gets work once the group re-forms. (The consumer is left for the
                # scheduler to delete: if the hand-over failed it still holds entries.)
                pipe.lpush(self.keys.vacancies, self.rank)
                pipe.ltrim(self.keys.vacancies, 0, 63)
                pipe.srem(self.keys.drained, self.rank)
            await pipe.execute()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        grp = self.group
        if grp is not None:
            try:
                await asyncio.to_thread(grp.close)
            except Exception:  # noqa: BLE001 - a broken group may not close cleanly
                pass

