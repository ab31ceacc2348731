"""The engine-worker service: the step loop of one DP rank (the imperative shell).

Per step:  read what the last round trip brought from the inbox -> local schedule ->
one all-gather that tells every rank every rank's load -> forward (or idle forward, or
pause) -> postprocess -> ONE pipelined Redis round trip that writes the token deltas,
the step stats and the acks and reads the next inbox entries.

Pure parts (EngineScheduler, BlockManager, RankStep, the backends' token rules) know
nothing of Redis or time. This file starts the rank and runs the step loop; each job it
calls has its own file: membership.py (slot, heartbeat, group), inbox_reader.py, ingest.py,
forward.py, outputs.py (the step's round trip), pause.py (pause and wake), hand_over.py
(leaving alone), api_watch.py; what they share is rank_state.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from typing import Any

from services.engine_worker.api_watch import watch_api_servers
from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.forward import Forward
from services.engine_worker.hand_over import HandOver
from services.engine_worker.inbox_reader import STOPPING_REDIS_GRACE_S, InboxReader
from services.engine_worker.ingest import ingest
from services.engine_worker.lockstep import Action, GroupBroken, StepView
from services.engine_worker.membership import (ClaimFailed, GroupLost, GroupMembership, GroupMismatch,
                                               VersionMismatch)
from services.engine_worker.outputs import Outputs
from services.engine_worker.pause import Pause
from services.engine_worker.rank_state import RankState
from services.engine_worker.slot_turnover import SlotTurnover
from services.engine_worker.rank_step import RankStep
from services.engine_worker.step_budget import from_settings as budget_from_settings
from services.engine_worker.step_view import F_STOP
from shared import keys as K
from shared import trace
from shared.advertise import AddressUnknown, resolve
from shared.bus import TRANSIENT, open_service_connection, retrying
from shared.cost_model import CostModel
from shared.logging import configure
from shared.settings import EngineSettings


# Values of the step row's F_STOP column.
STOP_GROUP = 1     # this rank stops: the whole group stops together (SIGINT, `lockstep up` stopping)
LEAVE = 2          # this rank leaves alone (SIGTERM): the others re-form without it
HOLD_POLL_MS = 2   # while the group holds (gated prefills, an idle group's hold): meet again this often


class EngineWorker:
    def __init__(self, settings: EngineSettings) -> None:
        self.s = settings
        self.keys = K.Keys(settings.namespace)
        self.log = configure("engine-worker", settings.log_level)
        self.token = uuid.uuid4().hex
        self.stopping = asyncio.Event()
        # SIGTERM: this rank leaves alone (hands its requests over, gives its slot back)
        # while the others go on; SIGINT: the whole group stops together.
        self.leaving = False
        self.left = False                         # the group saw this rank leave (at a step)
        self.group_stopped = False                # the whole group stopped together (not: this rank left it)
        self.cost = CostModel.load(settings.cost_model) if settings.cost_model else CostModel()
        core = EngineScheduler(
            BlockManager(settings.num_kv_blocks, settings.block_size),
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len)
        gate = BatchGate(rank=max(0, settings.rank), timeout_s=settings.gate_timeout_ms * settings.wait_scale / 1000)
        rs = RankStep(max(0, settings.rank), core, gate, budget_from_settings(settings))
        if rs.clock is not None and settings.backend == "sim":   # its full step is the cost model's
            cap = settings.max_num_batched_tokens
            rs.clock.prior_ms = self.cost.step_ms(cap, 0, cap) * settings.time_scale
        turnover = SlotTurnover(settings.max_num_seqs, settings.max_num_batched_tokens,
                                settings.num_kv_blocks * settings.block_size)
        self.state = RankState(settings.rank, core, gate, rs, turnover=turnover)

    # ------------------------------------------------------------------ start-up
    async def run(self) -> int:
        r = await open_service_connection(self.s.redis_url, self.log, self.stopping, self.s.redis_wait_s)
        if r is None:
            return 2
        self.r = r
        refused = await self._backend_refused()
        if refused:
            self.log.error("engine_backend_mismatch", error=refused)
            await self.r.aclose()
            return 2     # a setting: a restart cannot help (`lockstep engine` stops this host)
        st = self.state
        self.member = GroupMembership(self.s, r, self.keys, self.log, self.stopping, self.token,
                                      counters=lambda: (st.wave, st.step), adopt=self._adopt_counters)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_leave_signal)
        loop.add_signal_handler(signal.SIGINT, self._on_stop_signal)
        if self.s.spare:
            self._preload_backend()
            if await retrying(self.member.wait_as_spare, log=self.log, what="spare") is None:
                await self.r.aclose()
                return 0
        else:
            try:   # (a full Redis refuses the claim's SET: waited out, as every write is)
                await retrying(self.member.claim_rank, log=self.log, what="claim_rank", stop=self.stopping)
            except ClaimFailed as exc:
                self.log.error("rank_claim_failed", error=str(exc))
                return 3
        rank = st.rank = st.gate.rank = st.rs.rank = self.member.rank
        self.log = self.member.log = self.log.bind(rank=rank)
        self._wire(f"rank{rank}-{self.token[:8]}")
        liveness = self.member.start_liveness(st.note_beat_failed)
        watcher = asyncio.create_task(watch_api_servers(self.r, self.keys, st.core, self.s.heartbeat_ms / 1000,
                                                        st.aborted.append, self.log,
                                                        lambda: st.redis_trouble_at(time.monotonic())))
        try:
            self.reader.inbox_last, self.pauses.wave_last = await retrying(
                lambda: self.member.prepare_streams(self.reader.consumer), log=self.log, what="prepare_streams",
                stop=self.stopping)
            await retrying(self.member.announce_replacement, log=self.log, what="announce", stop=self.stopping)
            try:
                await self.member.form_group()
            except VersionMismatch:
                raise
            except Exception as exc:  # noqa: BLE001 - as in reform: c10d's store errors, a rendezvous timeout
                # Missed the rendezvous (a slow start: rank 0 gave up waiting and meets
                # again under a new generation). Retry here, bounded, like a re-formation:
                # exiting would re-import everything and, on a loaded machine, miss the
                # next one too (seen: a restarted rank 1 missed 4 in a row; rank 0 gave up).
                try:
                    if not await self.member.reform(f"first formation failed: {str(exc)[:160]}"):
                        return 0
                except GroupLost as lost:
                    self.log.error("engine_group_lost", error=str(lost))
                    return 4
            st.backend = self._make_backend()
            st.guides.vocab = getattr(st.backend, "grammar_vocab", None)   # a checkpoint's tokens (None: bytes)
            # (idle_forwards counts this process's: a replacement does not show its predecessor's)
            # (wave, step): the group's, as the formation adopted them (the next owner's floor)
            await self.r.hset(self.keys.rank_info(rank), mapping={"ready": time.time(), "wave": st.wave,
                                                                  "step": st.step, "idle_forwards": st.idle_forwards})
            from services.engine_worker.metrics import start_metrics
            port = self.s.metrics_port + rank if self.s.spare and self.s.metrics_port else self.s.metrics_port
            st.metrics = start_metrics(port, rank, self.s.metrics_host, self.log)
            self.log.info("engine_ready", world=self.s.ranks, backend=self.s.backend, pid=os.getpid())
            try:
                await self._step_loop()
                if self.leaving and not self.group_stopped:
                    await HandOver(self.r, self.keys, st, self.reader, self.outputs, self.log).hand_over()
            except GroupLost as exc:
                self.log.error("engine_group_lost", error=str(exc))
                return 4
            except TRANSIENT as exc:
                if not self.stopping.is_set():
                    raise
                # Told to stop, and Redis stayed away past the bound (inbox_reader.py): exit;
                # what this rank held stays pending in its inbox for the scheduler to resume.
                self.log.error("engine_stopped_without_redis", error=str(exc)[:200],
                               grace_s=STOPPING_REDIS_GRACE_S)
                return 6
            return 0
        except VersionMismatch as exc:      # at the first formation or a re-formation
            self.log.error("engine_group_mismatch" if isinstance(exc, GroupMismatch) else "engine_version_mismatch",
                           error=str(exc))
            return 7
        finally:
            watcher.cancel()
            await asyncio.to_thread(liveness)   # its last beat lands before the alive key is dropped
            await self.member.release(self.group_stopped, self.leaving)
            await self.r.aclose()

    async def _backend_refused(self) -> str | None:
        """Why this rank must not join: the cluster record (``lockstep init``/``up``) names
        another backend. The ranks of a group exchange the backend's tensors at every step,
        so one of another backend hung every collective (the group re-formed every few
        seconds, for ever). None where they agree or the record names none."""
        recorded = await retrying(lambda: self.r.hget(self.keys.cluster, "backend"), log=self.log,
                                  what="cluster_record", stop=self.stopping)
        recorded = recorded.decode() if isinstance(recorded, bytes) else recorded
        if not recorded or recorded == self.s.backend:
            return None
        return (f"this rank's backend is {self.s.backend} (LOCKSTEP_BACKEND) but the cluster in Redis runs backend "
                f"{recorded} ({self.keys.cluster}, written by `lockstep init` or `lockstep up`): every rank of a "
                f"group must run one backend. Set LOCKSTEP_BACKEND={recorded} (`lockstep engine`: --backend "
                f"{recorded}, or neither); to move the whole cluster to {self.s.backend}, stop it, run `lockstep "
                f"init` with LOCKSTEP_BACKEND={self.s.backend} and start every rank again")

    def _wire(self, consumer: str) -> None:
        """The jobs of a rank that holds a slot. ``consumer``: a new name per incarnation,
        so what a dead predecessor left pending stays under its own name, where the
        scheduler finds it and resumes it elsewhere."""
        st = self.state
        self.reader = InboxReader(self.r, self.keys, st, consumer, self.log, self.stopping)
        self.outputs = Outputs(self.keys, self.s, st, self.reader, self.member, self.log)
        self.pauses = Pause(self.r, self.keys, self.s, st, self.reader, self.member, self.stopping, self.log)
        self.forward = Forward(self.s, st, self.cost)

    def _adopt_counters(self, wave: int, step: int) -> None:
        """The group's (wave, step), adopted at every formation (membership.py)."""
        self.state.wave, self.state.step = wave, step

    def _on_leave_signal(self) -> None:
        if not self.stopping.is_set():
            self.leaving = True
            self.log.warning("engine_leave_requested")
        self.stopping.set()

    def _on_stop_signal(self) -> None:
        if not self.left:
            self.leaving = False   # a group stop wins over a leave not yet taken
        self.stopping.set()

    def _preload_backend(self) -> None:
        """A spare imports what its backend needs before it waits: the weights depend on
        the rank it will take, the imports do not (and are most of a start-up)."""
        if self.s.backend == "torch":
            import services.engine_worker.model.runner  # noqa: F401

    def _make_backend(self) -> Any:
        if self.s.backend == "torch":
            from services.engine_worker.model.factory import make_runner
            return make_runner(self.s, self.state.rank)     # the bundled model or the checkpoint in --model
        from services.engine_worker.sim_backend import SimBackend
        return SimBackend()

    # ------------------------------------------------------------------ step loop
    async def _step_loop(self) -> None:
        st = self.state
        self.member.stepping = True        # from now on liveness follows the loop's progress
        while True:
            self.member.mark_progress()
            ingest(st, self.reader.take_all(), self.log, self.reader.take_all_cancels())
            plan, row = st.rs.plan(time.monotonic(), self.stopping.is_set() and not self.leaving)
            if self.leaving:
                row[F_STOP] = LEAVE
            if st.reform_requested:
                st.reform_requested = False
                if not await self.member.reform("a replacement rank joined"):
                    return
            tx = time.perf_counter()
            if trace.ENABLED:
                trace.mark(f"step_start:{st.rank}")
            try:
                # On the loop thread: a thread hop costs more than the collective, and the
                # loop has nothing else to do meanwhile (liveness beats from its own thread).
                view: StepView = self.member.group.exchange(row)
            except GroupBroken as exc:         # a peer died or hung past the collective timeout
                if not await self.member.reform(f"step collective failed: {str(exc)[:160]}"):
                    return
                continue
            st.exchange_s += time.perf_counter() - tx
            if trace.ENABLED:
                trace.mark(f"step_synced:{st.rank}")
            stops = view.column(F_STOP)
            if LEAVE in stops and STOP_GROUP not in stops:
                # Every rank sees the same rows: the leavers go, the others re-form now
                # (and meet the slot's next owner) instead of waiting out a collective.
                leavers = [i for i, v in enumerate(stops) if v == LEAVE]
                if st.rank in leavers:
                    self.left = True
                    self.log.warning("engine_leaving_group", wave=st.wave, step=st.step)
                    return
                if not await self.member.reform(f"rank(s) {leavers} left the group"):
                    return
                continue
            action, released = st.rs.decide(plan, view, time.monotonic())
            if action is Action.STOP:
                self.log.info("engine_stopping", wave=st.wave, step=st.step)
                self.group_stopped = True
                return
            if action is Action.HOLD:
                # Every rank's work is held (by the batch gate, or an idle group's hold for
                # requests sent together): no forward, not even an idle one; look for the
                # missing shares and meet again.
                if not released:
                    await self._hold()
                continue
            if action is Action.PAUSE:
                await self.outputs.flush(pausing=True)
                st.wave += 1
                st.step = 0
                await self.pauses.pause()
                continue
            t0 = time.perf_counter()
            try:
                sampled = await self.forward.run(plan, action, view)
            except GroupBroken as exc:         # the all-to-all was cut: this step is recomputed
                if not await self.member.reform(f"forward collective failed: {str(exc)[:160]}"):
                    return
                continue
            outputs = st.core.postprocess(plan, sampled, time.time())
            dur_ms = (time.perf_counter() - t0) * 1000
            st.rs.note_step(dur_ms)
            await self.outputs.publish(plan, outputs, action, dur_ms)
            st.step += 1

    async def _hold(self) -> None:
        """Wait briefly for inbox entries (the rest of a batch) without a forward."""
        await self.outputs.flush()
        await self.reader.poll(HOLD_POLL_MS, max(1, self.s.max_num_seqs * 2))


def main(settings: EngineSettings) -> int:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    try:   # LOCKSTEP_GROUP_HOST=auto (containers): the address this host reaches Redis from
        settings = settings.model_copy(update={"group_host": resolve(settings.group_host, settings.redis_url)})
    except AddressUnknown as exc:
        print(f"engine-worker: LOCKSTEP_GROUP_HOST=auto: {exc}; set LOCKSTEP_GROUP_HOST to the address "
              "the other engine hosts reach this one at", file=sys.stderr)
        return 2
    worker = EngineWorker(settings)
    return asyncio.run(worker.run())
