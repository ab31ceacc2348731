"""The engine-worker service: the step loop of one DP rank (the imperative shell).

Per step:  read what the last round trip brought from the inbox -> local schedule ->
one all-gather that tells every rank every rank's load -> forward (or idle forward, or
pause) -> postprocess -> ONE pipelined Redis round trip that writes the token deltas,
the step stats and the acks and reads the next inbox entries.

Pure parts (EngineScheduler, BlockManager, the backends' token rules) know nothing of
Redis or time; this file is the only place they meet I/O.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import defaultdict
from typing import Any

from shared import keys as K
from shared.bus import (Recorder, atomic, decode_entries, ensure_group, entry_id_key, execute_recorded,
                        open_service_connection, retrying)
from shared.cost_model import CostModel
from shared.logging import configure
from shared.messages import FIELD, Abort, Delta, MessageError, Request, dumps, encode_deltas, request_owner
from shared.settings import EngineSettings
from shared.stats import RankStats
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.api_watch import watch_api_servers
from services.engine_worker.membership import ClaimFailed, GroupLost, GroupMembership
from services.engine_worker.recv_marks import RecvMarks
from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.lockstep import Action, GroupBroken, StepView
from services.engine_worker.step_view import F_STOP
from services.engine_worker.rank_step import RankStep
from services.engine_worker.step_budget import from_settings as budget_from_settings
from services.engine_worker.scheduler import EngineScheduler
from services.engine_worker.sequence import Sequence
from services.engine_worker.sim_backend import eos_from
from services.engine_worker.step_logprobs import StepLogprobs
from services.engine_worker.guided import Guides
from shared import trace


# Values of the step row's F_STOP column.
STOP_GROUP = 1     # this rank stops: the whole group stops together (SIGINT, `lockstep up` stopping)
LEAVE = 2          # this rank leaves alone (SIGTERM): the others re-form without it
HOLD_POLL_MS = 2   # while every rank only has gated prefills: meet again this often (bounded by the gate timeout)


class EngineWorker:
    def __init__(self, settings: EngineSettings) -> None:
        self.s = settings
        self.keys = K.Keys(settings.namespace)
        self.log = configure("engine-worker", settings.log_level)
        self.token = uuid.uuid4().hex
        self.rank = settings.rank
        self.wave = 0
        self.step = 0
        self.idle_forwards = 0
        self.inbox_last = b"0-0"          # last inbox entry delivered to this rank
        self.wave_last = b"0-0"           # last wake notice seen
        self.entry_of: dict[str, bytes] = {}   # seq id -> inbox entry id (acked at finish)
        self.recv = RecvMarks()           # dispatcher incarnation -> highest dispatch seq received (bounded)
        self.fetched: list[tuple[bytes, dict[str, Any]]] = []
        # Inbox entries taken straight from the wake-up read, before this consumer claimed
        # them (entry id -> request id, None for an abort): the claim rides on the next
        # step's read, which must neither admit them twice nor leave a finished one pending.
        self.prefetched: dict[bytes, str | None] = {}
        self.stopping = asyncio.Event()
        # SIGTERM: this rank leaves alone (hands its requests over, gives its slot back)
        # while the others go on; SIGINT: the whole group stops together.
        self.leaving = False
        self.left = False                         # the group saw this rank leave (at a step)
        self.cost = CostModel.load(settings.cost_model) if settings.cost_model else CostModel()
        self.core = EngineScheduler(
            BlockManager(settings.num_kv_blocks, settings.block_size),
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len)
        self.gate = BatchGate(rank=max(0, settings.rank), timeout_s=settings.gate_timeout_ms / 1000)
        budget = budget_from_settings(settings)
        # the step decisions (schedule, row, alignment, batch gate): the simulator runs the same object
        self.rs = RankStep(max(0, settings.rank), self.core, self.gate, budget)
        self.prompts: dict[str, list[int]] = {}
        self.eos_from: dict[str, float] = {}     # sim: first position EOS may end a request
        self.lp = StepLogprobs()                  # logprobs of the requests that ask for them
        self.guides = Guides()                    # grammar matchers of structured-output requests
        self._acks: list[bytes] = []              # inbox entries to ack in the next round trip
        self._aborted: list[Sequence] = []        # aborted seqs whose final delta is pending
        self._early: list[Any] = []               # outputs decided at admission (rejections)
        self.round_trips = 0                      # Redis round trips of the step loop (goal: one per step)
        self.exchange_s = 0.0                     # wall time in the step collective (incl. waiting for peers)
        self._reread_from: str | bytes | None = None   # after a Redis error: re-read our pending entries from here
        self._history_read = False                # the read in flight is such a re-read (paged until empty)
        self._reform_requested = False
        self.group_stopped = False                # the whole group stopped together (not: this rank left it)
        self.consumer = ""

    # ------------------------------------------------------------------ start-up
    async def run(self) -> int:
        r = await open_service_connection(self.s.redis_url, self.log, self.stopping)
        if r is None:
            return 2
        self.r = r
        self.member = GroupMembership(self.s, r, self.keys, self.log, self.stopping, self.token,
                                      counters=lambda: (self.wave, self.step), adopt=self._adopt_counters)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_leave_signal)
        loop.add_signal_handler(signal.SIGINT, self._on_stop_signal)
        if self.s.spare:
            self._preload_backend()
            rank = await retrying(self.member.wait_as_spare, log=self.log, what="spare")
            if rank is None:
                await self.r.aclose()
                return 0
            self.rank = self.member.rank = rank
        else:
            try:
                self.rank = self.member.rank = await self.member.claim_rank()
            except ClaimFailed as exc:
                self.log.error("rank_claim_failed", error=str(exc))
                return 3
        self.log = self.member.log = self.log.bind(rank=self.rank)
        self.gate.rank = self.rs.rank = self.rank
        # A new consumer name per incarnation: what a dead predecessor left pending stays
        # under its own name, where the scheduler finds it and resumes it elsewhere.
        self.consumer = f"rank{self.rank}-{self.token[:8]}"
        liveness = self.member.start_liveness()
        watcher = asyncio.create_task(watch_api_servers(self.r, self.keys, self.core, self.s.heartbeat_ms / 1000,
                                                        self._aborted.append, self.log))
        try:
            self.inbox_last, self.wave_last = await self.member.prepare_streams(self.consumer)
            await self.member.announce_replacement()
            try:
                await self.member.form_group()
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
            self.backend = self._make_backend()
            await self.r.hset(self.keys.rank_info(self.rank), mapping={"ready": time.time(), "wave": 0, "step": 0})
            from services.engine_worker.metrics import start_metrics
            port = self.s.metrics_port + self.rank if self.s.spare and self.s.metrics_port else self.s.metrics_port
            self.metrics = start_metrics(port, self.rank)
            self.log.info("engine_ready", world=self.s.ranks, backend=self.s.backend, pid=os.getpid())
            try:
                await self._step_loop()
            except GroupLost as exc:
                self.log.error("engine_group_lost", error=str(exc))
                return 4
            if self.leaving and not self.group_stopped:
                await self._hand_over()
            return 0
        finally:
            watcher.cancel()
            await asyncio.to_thread(liveness)   # its last beat lands before the alive key is dropped
            await self.member.release(self.group_stopped, self.leaving)
            await self.r.aclose()

    def _adopt_counters(self, wave: int, step: int) -> None:
        """The group's (wave, step), adopted at every formation (membership.py)."""
        self.wave, self.step = wave, step

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
            return make_runner(self.s, self.rank)     # the bundled model or the checkpoint in --model
        from services.engine_worker.sim_backend import SimBackend
        return SimBackend()

    # ------------------------------------------------------------------ step loop
    async def _step_loop(self) -> None:
        self.member.stepping = True        # from now on liveness follows the loop's progress
        while True:
            self.member.mark_progress()
            self._ingest()
            plan, row = self.rs.plan(time.monotonic(), self.stopping.is_set() and not self.leaving)
            if self.leaving:
                row[F_STOP] = LEAVE
            if self._reform_requested:
                self._reform_requested = False
                if not await self.member.reform("a replacement rank joined"):
                    return
            tx = time.perf_counter()
            if trace.ENABLED:
                trace.mark(f"step_start:{self.rank}")
            try:
                # On the loop thread: a thread hop costs more than the collective, and the
                # loop has nothing else to do meanwhile (liveness beats from its own thread).
                view: StepView = self.member.group.exchange(row)
            except GroupBroken as exc:         # a peer died or hung past the collective timeout
                if not await self.member.reform(f"step collective failed: {str(exc)[:160]}"):
                    return
                continue
            self.exchange_s += time.perf_counter() - tx
            if trace.ENABLED:
                trace.mark(f"step_synced:{self.rank}")
            stops = view.column(F_STOP)
            if LEAVE in stops and STOP_GROUP not in stops:
                # Every rank sees the same rows: the leavers go, the others re-form now
                # (and meet the slot's next owner) instead of waiting out a collective.
                leavers = [i for i, v in enumerate(stops) if v == LEAVE]
                if self.rank in leavers:
                    self.left = True
                    self.log.warning("engine_leaving_group", wave=self.wave, step=self.step)
                    return
                if not await self.member.reform(f"rank(s) {leavers} left the group"):
                    return
                continue
            action, released = self.rs.decide(plan, view, time.monotonic())
            if action is Action.STOP:
                self.log.info("engine_stopping", wave=self.wave, step=self.step)
                self.group_stopped = True
                return
            if action is Action.HOLD:
                # Every rank's work is held by the batch gate: no forward (not even an idle
                # one); look for the missing shares and meet again.
                if not released:
                    await self._hold()
                continue
            if action is Action.PAUSE:
                self.wave += 1
                self.step = 0
                await self._flush_outputs(paused=self.rank == 0)
                await self._pause()
                continue
            t0 = time.perf_counter()
            try:
                sampled = await self._forward(plan, action, view)
            except GroupBroken as exc:         # the all-to-all was cut: this step is recomputed
                if not await self.member.reform(f"forward collective failed: {str(exc)[:160]}"):
                    return
                continue
            outputs = self.core.postprocess(plan, sampled, time.time())
            dur_ms = (time.perf_counter() - t0) * 1000
            self.rs.note_step(dur_ms)
            await self._publish(plan, outputs, action, dur_ms)
            self.step += 1

    async def _forward(self, plan: Any, action: Action, view: StepView) -> dict[str, int]:
        t0 = time.perf_counter()
        if self.s.backend == "torch":
            chunks = plan.chunks if action is Action.RUN else []
            want = self.lp.wants(chunks)
            extras = self._sampling_extras(chunks, self.guides.masks(chunks, self.core.get))
            if want:
                sampled, tok_lp, prompt_lp = await asyncio.to_thread(self.backend.run_logprobs, chunks, extras, want)
                self.lp.add(tok_lp, prompt_lp)
            else:
                sampled = await asyncio.to_thread(self.backend.run, chunks, extras)
        else:
            sampled = self.backend.run(plan.chunks, self.prompts, self.eos_from,
                                       self.guides.masks(plan.chunks, self.core.get)) if action is Action.RUN else {}
            want = self.lp.wants(plan.chunks) if action is Action.RUN else None
            if want:
                self.lp.add(*self.backend.logprobs(plan.chunks, sampled, self.prompts, want))
            # Lockstep: the step lasts as long as the busiest rank's modeled forward.
            modeled_s = self.cost.step_ms(view.max_tokens, view.max_ctx) * self.s.time_scale / 1000
            left = modeled_s - (time.perf_counter() - t0)
            if left > 0:
                await asyncio.sleep(left)
        if action is Action.IDLE:
            self.idle_forwards += 1
        return sampled

    def _sampling_extras(self, chunks: list[Any], masks: dict[str, bytes] | None = None) -> dict[str, Any] | None:
        """top_k, min_p, penalties, logit_bias and min_tokens' masking of the sampled sequences
        that ask for them (torch only); None, the common case, when none does."""
        from services.engine_worker.model.sampler import RowExtra
        from shared.tokenizer import EOS
        out: dict[str, Any] = {}
        for c in chunks:
            if not c.sample:
                continue
            seq = self.core.get(c.seq_id)
            if seq is None:
                continue
            p = seq.params
            early = len(seq.generated) < p.min_tokens
            mask = masks.get(c.seq_id) if masks else None
            if p.top_k > 0 or p.min_p > 0 or p.penalized or p.logit_bias or early or mask is not None:
                # before min_tokens neither EOS (unless ignored) nor a stop token may be drawn
                suppress = ([] if p.ignore_eos else [EOS]) + list(p.stop_token_ids) if early else []
                out[c.seq_id] = RowExtra(p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
                                         p.repetition_penalty, list(seq.prompt) if p.penalized else [],
                                         list(seq.generated) if p.penalized else [], p.logit_bias, suppress, mask)
        return out or None

    def _ingest(self) -> None:
        """Admit what the last round trip fetched from the inbox (requests and aborts)."""
        fetched, self.fetched = self.fetched, []
        for eid, doc in fetched:
            kind = doc.get("k")
            if kind == "req":
                try:
                    req = Request.from_dict(doc)
                except MessageError as exc:   # malformed for good: drop it, keep stepping
                    self._acks.append(eid)
                    self.log.error("bad_inbox_entry", entry=eid.decode(), error=str(exc))
                    continue
                if req.id in self.entry_of:          # already running here
                    if self.entry_of[req.id] != eid:  # a second dispatch of it: drop that copy
                        self._acks.append(eid)
                    continue
                if req.dispatcher:
                    self.recv.note(req.dispatcher, req.dispatch_seq, time.monotonic())
                seq = Sequence.from_request(req, req.dispatcher or "", req.dispatch_seq)
                self.entry_of[req.id] = eid
                self.prompts[req.id] = req.prompt
                self.eos_from[req.id] = eos_from(req.params)
                self.lp.track(req.id, req.params, req.prompt)
                self.guides.track(req.id, req.params)
                self.log.debug("request_admitted", request_id=req.id, wave=self.wave, step=self.step,
                               prompt_tokens=len(req.prompt), resumed_at=len(req.generated))
                rejected = self.core.add(seq, time.time())
                if rejected is not None:      # can never run here, or nothing left to generate
                    self._early.append(rejected)
                else:
                    self.rs.arrived(seq, time.monotonic())
            elif kind == "abort":
                try:
                    ab = Abort.from_dict(doc)
                except MessageError as exc:
                    self._acks.append(eid)
                    self.log.error("bad_inbox_entry", entry=eid.decode(), error=str(exc))
                    continue
                seq = self.core.abort(ab.id)
                self._acks.append(eid)
                if seq is not None:
                    self._aborted.append(seq)
            else:
                self._acks.append(eid)
                self.log.warning("inbox_entry_ignored", kind=kind)

    async def _publish(self, plan: Any, outputs: list[Any], action: Action, dur_ms: float) -> None:
        """One pipelined round trip: deltas, request state, step stats, acks, next inbox read."""
        now = time.time()
        pipe = Recorder()
        finished = self._write_outputs(pipe, outputs, now)
        ran = action is Action.RUN
        outstanding, pending = self.core.load()
        stats = RankStats(
            rank=self.rank, wave=self.wave, step=self.step, waiting=self.core.num_waiting,
            running=self.core.num_running, scheduled=plan.num_tokens if ran else 0,
            prefill=plan.prefill_tokens if ran else 0, decode=plan.decode_tokens if ran else 0,
            kv_used=self.core.kv_used, kv_total=self.core.kv_total,
            outstanding=outstanding, idle=action is Action.IDLE,
            dur_ms=round(dur_ms, 3), t=now, finished=finished, held=plan.held, recv=self.recv.as_dict(time.monotonic()),
            extra={"gate_full": self.gate.released_full, "gate_timeout": self.gate.released_timeout,
                   "preemptions": self.core.num_preemptions, "reforms": self.member.reforms, "gen": self.member.gen, "round_trips": self.round_trips,
                   "exchange_s": round(self.exchange_s, 6),
                   "comm_s": round(getattr(self.backend, "comm_seconds", 0.0), 6)},
            prefill_pending=pending)
        if getattr(self, "metrics", None) is not None:
            self.metrics.on_step(stats)
        blob = dumps(stats.to_dict())
        step_key = self.keys.step(self.wave, self.step)
        pipe.hset(step_key, str(self.rank), blob)
        pipe.expire(step_key, K.STEP_HASH_TTL_S)
        pipe.xadd(self.keys.stats, {FIELD: blob}, maxlen=K.STATS_STREAM_MAXLEN, approximate=True)
        pipe.hset(self.keys.rank_info(self.rank), mapping={"stats": blob, "idle_forwards": self.idle_forwards,
                                                           "wave": self.wave, "step": self.step})
        room = max(0, self.s.max_num_seqs * 2 - self.core.num_waiting, len(self.prefetched))
        if room:
            pipe.xreadgroup(K.ENGINE_GROUP, self.consumer, {self.keys.inbox(self.rank): self._read_from()},
                            count=room)
        if trace.ENABLED:
            trace.mark(f"publish_sent:{self.rank}")
        results = await self._execute(pipe)
        if room:
            self._take_fetched(results[-1])

    async def _flush_outputs(self, paused: bool = False) -> None:
        """Before a pause: send what is pending (rejections, aborts, acks) without a step.
        ``paused`` (rank 0): record which wave the next wake starts, so that the dispatch
        that ends the pause wakes every rank at once (shared/wake.py)."""
        if self._early or self._aborted or self._acks or paused:
            pipe = Recorder()
            self._write_outputs(pipe, [], time.time())
            if paused:
                pipe.set(self.keys.paused, self.wave)
            await self._execute(pipe)

    def _write_outputs(self, pipe: Any, outputs: list[Any], now: float) -> int:
        """Queue deltas (one stream entry per api-server), request records and acks."""
        by_api: dict[str, list[Delta]] = defaultdict(list)
        acks, self._acks = self._acks, []
        if self._early:
            outputs = [*self._early, *outputs]
            self._early = []
        finished = 0
        lp = self.lp if self.lp.ids else None
        for out in outputs:
            seq = out.seq
            delta = Delta(seq.id, out.pos, out.new_tokens, out.finish_reason,
                          prompt_tokens=len(seq.prompt) if out.finish_reason else 0,   # read with finish only
                          rank=self.rank, error=seq.error, epoch=seq.epoch)
            if lp is not None:
                lp.fill(delta)
            by_api[seq.api].append(delta)
            if out.finish_reason is not None:
                finished += 1
                acks.append(self._forget(seq.id))
                self.log.debug("request_finished", request_id=seq.id, wave=self.wave, step=self.step,
                               finish=out.finish_reason, tokens=len(seq.generated))
                pipe.hset(self.keys.req(seq.id), mapping={
                    "state": "finished", "finish": out.finish_reason, "rank": self.rank,
                    "tokens": len(seq.generated), "t_finished": now})
                pipe.expire(self.keys.req(seq.id), self.s.request_record_ttl_s)
        aborted, self._aborted = self._aborted, []
        for seq in aborted:
            by_api[seq.api].append(Delta(seq.id, len(seq.generated), [], "abort",
                                         prompt_tokens=len(seq.prompt), rank=self.rank, epoch=seq.epoch))
            acks.append(self._forget(seq.id))
            pipe.hset(self.keys.req(seq.id), mapping={"state": "finished", "finish": "abort", "rank": self.rank,
                                                       "tokens": len(seq.generated), "t_finished": now})
            pipe.expire(self.keys.req(seq.id), self.s.request_record_ttl_s)
        for api, deltas in by_api.items():
            pipe.xadd(self.keys.out(api), {FIELD: encode_deltas(deltas)}, maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
            pipe.expire(self.keys.out(api), K.OUT_STREAM_TTL_S)   # gone an hour after its replica
        acks = [a for a in acks if a]
        if acks:
            pipe.xack(self.keys.inbox(self.rank), K.ENGINE_GROUP, *acks)
        return finished

    async def _execute(self, pipe: Recorder) -> list[Any]:
        """One round trip; through a Redis outage it backs off and replays (the work on
        this rank stays in memory; readers dedupe, so a replayed write is harmless)."""
        self.round_trips += 1
        return await execute_recorded(self.r, pipe, log=self.log, what="step", on_retry=self._on_redis_retry)

    async def _on_redis_retry(self) -> None:
        # A reply may have been lost after the server delivered inbox entries to us: read
        # this consumer's pending entries once more (ingest ignores what it already has).
        # A restarted server may have lost the consumer group: recreate it.
        self._reread_from = "0"
        await ensure_group(self.r, self.keys.inbox(self.rank), K.ENGINE_GROUP, "0")

    def _read_from(self) -> str | bytes:
        """'>' (new entries), or after a possibly lost reply this consumer's own pending
        entries, page by page from the last one read until a page comes back empty (each
        read takes at most ``count``: one page could strand the rest in our pending list)."""
        self._history_read = self._reread_from is not None
        return ">" if self._reread_from is None else self._reread_from

    def _take_fetched(self, resp: Any) -> None:
        if self._history_read:
            self._history_read = False
            raw = _raw_entries(resp)
            self._reread_from = raw[-1][0] if raw else None   # next page after it; None: done
            # A pending entry deleted from the stream comes back without fields: ack it.
            self._acks.extend(eid for eid, fields in raw if fields is None)
        for _, eid, doc in decode_entries(resp):
            if eid in self.prefetched:
                # Admitted at wake-up; this read only made it ours. Already finished or an
                # abort: ack it now that the ack counts.
                rid = self.prefetched.pop(eid)
                if rid is None or self.entry_of.get(rid) != eid:
                    self._acks.append(eid)
                continue
            self._fetch(eid, doc)

    def _fetch(self, eid: bytes, doc: dict[str, Any]) -> None:
        self.fetched.append((eid, doc))
        if entry_id_key(eid) > entry_id_key(self.inbox_last):
            self.inbox_last = eid

    def _forget(self, seq_id: str) -> bytes | None:
        self.prompts.pop(seq_id, None)
        self.rs.forget(seq_id)
        self.eos_from.pop(seq_id, None)
        self.lp.forget(seq_id)
        self.guides.forget(seq_id)
        free = getattr(self.backend, "free_seq", None)
        if free is not None:
            free(seq_id)
        return self.entry_of.pop(seq_id, None)

    async def _hold(self) -> None:
        """Wait briefly for inbox entries (the rest of a batch) without a forward."""
        await self._flush_outputs()
        pipe = Recorder()
        pipe.xreadgroup(K.ENGINE_GROUP, self.consumer, {self.keys.inbox(self.rank): self._read_from()},
                        count=max(1, self.s.max_num_seqs * 2), block=HOLD_POLL_MS)
        self._take_fetched((await self._execute(pipe))[-1])

    # ------------------------------------------------------------------ pause / wake
    async def _pause(self) -> None:
        """Nobody has work: sleep on Redis (no busy loop, no dummy forwards) until work
        reaches this rank's inbox or a wake-up notice for this wave arrives. Reads resume
        from the last ids seen, so an arrival between the decision and the read is never
        missed.

        Work read here is admitted at once (the consumer-group claim rides on the first
        step's round trip). The rank that found it wakes the others with a notice, unless
        the same read brought the dispatcher's notice (shared/wake.py): then every rank
        woke at the same moment and nobody waits for a second hop."""
        inbox = self.keys.inbox(self.rank)
        arrived: list[tuple[bytes, dict[str, Any]]] = []
        notified = False
        while not (arrived or notified or self._reform_requested or self.stopping.is_set()):
            self.member.mark_progress()   # paused is legitimate: the read returns every heartbeat
            self.round_trips += 1
            resp = await retrying(lambda: self.r.xread({inbox: self.inbox_last, self.keys.wave: self.wave_last},
                                                       block=self.s.heartbeat_ms, count=16),
                                  log=self.log, what="pause", on_retry=self._on_redis_retry)
            for stream, eid, doc in decode_entries(resp):
                if stream.decode() == self.keys.wave:
                    self.wave_last = eid
                    if doc.get("reform") and doc.get("r") != self.rank and int(doc["reform"]) >= self.member.gen:
                        self._reform_requested = True
                    elif int(doc.get("w", -1)) >= self.wave:
                        notified = True
                else:
                    arrived.append((eid, doc))
        if not arrived:
            if self.stopping.is_set() and not notified and not self._reform_requested:
                # Stopping or leaving while the group sleeps: the others must meet this
                # rank's last step (where they learn it goes), not sleep on.
                await self._execute(self._wake_notice())
            return   # woken by a notice, or stopping: the next step's round trip reads the inbox
        if trace.ENABLED:
            trace.mark(f"rank_wake:{self.rank}")
        for eid, doc in arrived:
            owner = request_owner(doc)
            self.prefetched[eid] = owner[1] if owner is not None else None
            self._fetch(eid, doc)
        if notified:
            return
        await self._execute(self._wake_notice())

    def _wake_notice(self) -> Recorder:
        pipe = Recorder()
        pipe.xadd(self.keys.wave, {FIELD: dumps({"w": self.wave, "r": self.rank})},
                  maxlen=K.WAVE_STREAM_MAXLEN, approximate=True)
        pipe.delete(self.keys.paused)   # woken: a later dispatch must not send a notice too
        return pipe

    # ------------------------------------------------------------------ leaving alone
    async def _hand_over(self) -> None:
        """Leaving alone (SIGTERM): what this rank still holds resumes on the others.

        Handed over, not finished here: a leave is then bounded by one step, whatever the
        requests' lengths (an orchestrator's grace period is seconds), and it is the path
        a crashed rank's requests already take, so it is exact in the same way: every
        delta this rank wrote precedes the resume notice in its api-server's stream, and
        the api-server resubmits the request with exactly the tokens the client has, so
        no token is lost or sent twice. The notices and the acks of each page go in one
        MULTI (ack after durable); everything pending under this consumer is paged
        through, including entries read but not yet admitted. Entries never read stay in
        the inbox for the slot's next owner."""
        try:
            await self._flush_outputs()
            n = await self._hand_over_pending()
        except Exception as exc:  # noqa: BLE001 - what is left stays pending: recovery resumes it
            self.log.error("hand_over_failed", error=str(exc)[:200])
            return
        self.log.warning("engine_left_group", handed_over=n, wave=self.wave, step=self.step)

    async def _hand_over_pending(self) -> int:
        inbox, start, n = self.keys.inbox(self.rank), "0", 0
        while True:
            resp = await retrying(lambda: self.r.xreadgroup(K.ENGINE_GROUP, self.consumer, {inbox: start},
                                                            count=HAND_OVER_PAGE),
                                  log=self.log, what="hand_over", give_up_s=HAND_OVER_GIVE_UP_S)
            raw = _raw_entries(resp)
            if not raw:
                return n
            start = raw[-1][0]
            by_api: dict[str, list[str]] = defaultdict(list)
            for _, _, doc in decode_entries([(inbox.encode(), [e for e in raw if e[1] is not None])]):
                owner = request_owner(doc)
                if owner is not None:
                    by_api[owner[0]].append(owner[1])

            async def send() -> None:
                pipe = atomic(self.r, inbox)   # Redis Cluster: the notices, then the ack (shared/bus.py)
                for api, ids in by_api.items():
                    pipe.xadd(self.keys.out(api), {FIELD: dumps({"k": "resume", "ids": ids})},
                              maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
                pipe.xack(inbox, K.ENGINE_GROUP, *[eid for eid, _ in raw])
                await pipe.execute()
            await retrying(send, log=self.log, what="hand_over", give_up_s=HAND_OVER_GIVE_UP_S)
            n += sum(len(v) for v in by_api.values())


HAND_OVER_PAGE = 500
HAND_OVER_GIVE_UP_S = 20.0   # Redis down longer: leave anyway; the scheduler resumes what stays pending


def _raw_entries(resp: Any) -> list[tuple[bytes, Any]]:
    """(id, fields) of an XREADGROUP reply for one stream (RESP2 list or RESP3 dict)."""
    if not resp:
        return []
    items = resp.items() if isinstance(resp, dict) else resp
    out: list[tuple[bytes, Any]] = []
    for _, entries in items:
        if entries and isinstance(entries[0], list) and not isinstance(entries[0][0], bytes):
            entries = entries[0]
        out.extend((eid, fields) for eid, fields in entries)
    return out


def main(settings: EngineSettings) -> int:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    worker = EngineWorker(settings)
    return asyncio.run(worker.run())
