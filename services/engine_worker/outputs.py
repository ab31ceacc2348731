"""What a step sends: token deltas (one output-stream entry per api-server), the records of
finished requests, the acks, and the step's stats (``<ns>:stats``, ``<ns>:step:<w>:<s>``,
``<ns>:rank:<r>:info``), in ONE pipelined round trip that also reads the next inbox entries."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from services.engine_worker.inbox_reader import InboxReader
from services.engine_worker.lockstep import Action
from services.engine_worker.rank_state import RankState
from services.engine_worker.ttl_refresh import TtlRefresh
from shared import keys as K
from shared import trace
from shared.bus import Recorder
from shared.messages import FIELD, Delta, encode, encode_deltas
from shared.settings import EngineSettings
from shared.stats import RankStats


class Outputs:
    """Empties ``state.early``, ``state.aborted`` and ``state.acks``; forgets finished requests."""

    def __init__(self, keys: K.Keys, settings: EngineSettings, state: RankState, reader: InboxReader,
                 member: Any, log: Any) -> None:
        self.keys, self.s, self.state, self.reader, self.member, self.log = keys, settings, state, reader, member, log
        self.out_ttl = TtlRefresh()

    async def publish(self, plan: Any, outputs: list[Any], action: Action, dur_ms: float) -> None:
        """One pipelined round trip: deltas, request state, step stats, acks, next inbox read."""
        st = self.state
        now = time.time()
        pipe = Recorder()
        finished = self.write(pipe, outputs, now)
        ran = action is Action.RUN
        stats = self._stats(now, finished, dur_ms, scheduled=plan.num_tokens if ran else 0,
                            prefill=plan.prefill_tokens if ran else 0, decode=plan.decode_tokens if ran else 0,
                            idle=action is Action.IDLE, held=plan.held)
        if st.metrics is not None:
            st.metrics.on_step(stats)
        self._report(pipe, stats)
        self.reader.pop_cancels(pipe)
        room = max(0, self.s.max_num_seqs * 2 - st.core.num_waiting, len(self.reader.prefetched))
        if room:
            pipe.xreadgroup(K.ENGINE_GROUP, self.reader.consumer,
                            {self.keys.inbox(st.rank): self.reader.read_from()}, count=room)
        if trace.ENABLED:
            trace.mark(f"publish_sent:{st.rank}")
        results = await self.reader.execute(pipe)
        self.reader.take_cancels(results[-2 if room else -1])
        if room:
            self.reader.take(results[-1])

    async def flush(self, pausing: bool = False) -> None:
        """Without a step: send what is pending (rejections, aborts, acks). ``pausing``: the
        group pauses at this (wave, step), and every rank reports its load for it (a step's
        stats with nothing computed, ``extra.pause``), so that the load view and ``lockstep
        status`` do not show work that went while no step ran (an abort, a rejection) for
        the whole pause; and rank 0 records the wave the next wake starts, so that the
        dispatch that ends the pause wakes every rank at once (shared/wake.py)."""
        st = self.state
        if st.early or st.aborted or st.acks or pausing:
            now = time.time()
            pipe = Recorder()
            self.write(pipe, [], now)
            # What the last pause read and no step claimed (each ended at once: an abort,
            # a request cancelled before it was read): claimed now, or it would stay
            # undelivered in the group through this pause, counted as a backlog
            claim = len(self.reader.prefetched) if pausing else 0
            if pausing:
                self._report(pipe, self._stats(now, 0, 0.0, extra={"pause": True}), step=False)
                if st.rank == 0:
                    pipe.set(self.keys.paused, st.wave + 1)
            if claim:
                pipe.xreadgroup(K.ENGINE_GROUP, self.reader.consumer,
                                {self.keys.inbox(st.rank): self.reader.read_from()}, count=claim)
            results = await self.reader.execute(pipe)
            if claim:
                self.reader.take(results[-1])
                if st.acks:       # (the claimed entries that ended: acked before the pause)
                    pipe = Recorder()
                    self.write(pipe, [], now)
                    await self.reader.execute(pipe)

    def _stats(self, now: float, finished: int, dur_ms: float, scheduled: int = 0, prefill: int = 0,
               decode: int = 0, idle: bool = False, held: int = 0, extra: dict[str, Any] | None = None) -> RankStats:
        st = self.state
        outstanding, pending = st.core.load()
        return RankStats(
            rank=st.rank, wave=st.wave, step=st.step, waiting=st.core.num_waiting,
            running=st.core.num_running, scheduled=scheduled, prefill=prefill, decode=decode,
            kv_used=st.core.kv_used, kv_total=st.core.kv_total,
            outstanding=outstanding, idle=idle,
            dur_ms=round(dur_ms, 3), t=now, finished=finished, held=held, recv=st.recv.as_dict(time.monotonic()),
            extra={"gate_full": st.gate.released_full, "gate_timeout": st.gate.released_timeout,
                   "preemptions": st.core.num_preemptions, "reforms": self.member.reforms, "gen": self.member.gen,
                   "round_trips": st.round_trips, "exchange_s": round(st.exchange_s, 6),
                   "comm_s": round(getattr(st.backend, "comm_seconds", 0.0), 6), **_budget_state(st.rs, st.turnover),
                   **(extra or {})},
            prefill_pending=pending, kv_blocked=st.core.kv_blocked())

    def _report(self, pipe: Any, stats: RankStats, step: bool = True) -> None:
        """The stats of (stats.wave, stats.step): the step's hash, the stats stream, the
        rank's info (``step=False``, a pause's: the load only; the info's wave and step
        count the steps run)."""
        blob = encode(stats)
        step_key = self.keys.step_reports(stats.wave, stats.step)
        pipe.hset(step_key, str(stats.rank), blob)
        pipe.expire(step_key, K.STEP_HASH_TTL_S)
        pipe.xadd(self.keys.stats, {FIELD: blob}, maxlen=K.STATS_STREAM_MAXLEN, approximate=True)
        if not step:
            pipe.hset(self.keys.rank_info(stats.rank), "stats", blob)
        else:
            pipe.hset(self.keys.rank_info(stats.rank), mapping={"stats": blob, "idle_forwards": self.state.idle_forwards,
                                                               "wave": stats.wave, "step": stats.step})

    def write(self, pipe: Any, outputs: list[Any], now: float) -> int:
        """Queue deltas (one stream entry per api-server), request records and acks."""
        st = self.state
        by_api: dict[str, list[Delta]] = defaultdict(list)
        acks = st.acks[:]
        st.acks.clear()
        if st.early:
            outputs = [*st.early, *outputs]
            st.early.clear()
        finished = 0
        lp = st.lp if st.lp.ids else None
        for out in outputs:
            seq = out.seq
            delta = Delta(seq.id, out.pos, out.new_tokens, out.finish_reason,
                          prompt_tokens=len(seq.prompt) if out.finish_reason else 0,   # read with finish only
                          rank=st.rank, error=seq.error, epoch=seq.epoch)
            if lp is not None:
                lp.fill(delta)
            by_api[seq.api].append(delta)
            if out.finish_reason is not None:
                finished += 1
                if st.turnover is not None and seq.generated:   # (a rejection never held a slot)
                    st.turnover.finished(len(seq.prompt), len(seq.generated))
                acks.append(st.forget(seq.id))
                self.log.debug("request_finished", request_id=seq.id, wave=st.wave, step=st.step,
                               finish=out.finish_reason, tokens=len(seq.generated))
                pipe.hset(self.keys.req(seq.id), mapping={
                    "state": "finished", "finish": out.finish_reason, "rank": st.rank,
                    "tokens": len(seq.generated), "t_finished": now})
                pipe.expire(self.keys.req(seq.id), self.s.request_record_ttl_s)
        aborted = st.aborted[:]
        st.aborted.clear()
        for seq in aborted:
            by_api[seq.api].append(Delta(seq.id, len(seq.generated), [], "abort", prompt_tokens=len(seq.prompt),
                                         rank=st.rank, error=seq.error, epoch=seq.epoch))
            acks.append(st.forget(seq.id))
            pipe.hset(self.keys.req(seq.id), mapping={"state": "finished", "finish": "abort", "rank": st.rank,
                                                       "tokens": len(seq.generated), "t_finished": now})
            pipe.expire(self.keys.req(seq.id), self.s.request_record_ttl_s)
        mono = time.monotonic()
        for api, deltas in by_api.items():
            key = self.keys.out(api)
            pipe.xadd(key, {FIELD: encode_deltas(deltas)}, maxlen=K.OUT_STREAM_MAXLEN, approximate=True)
            if self.out_ttl.due(key, mono):
                pipe.expire(key, K.OUT_STREAM_TTL_S)   # gone an hour after its replica
        acks = [a for a in acks if a]
        if acks:
            pipe.xack(self.keys.inbox(st.rank), K.ENGINE_GROUP, *acks)
            # and gone: the scheduler's trim stops at the oldest entry still pending, so one
            # long request kept every entry placed behind it, prompts and all
            pipe.xdel(self.keys.inbox(st.rank), *acks)
        return finished


def _budget_state(rs: Any, turnover: Any = None) -> dict[str, float | None]:
    """What coordinated prefill judges by (each rank's report on the stats stream): the
    measured full step, its busiest-rank and shared ms per token, the share of the
    group's time its prefill would take alone, and how long its long prompts are (what a
    shorter one may wait for); null until the steps or prompts allow one (never a made-up 0).
    ``prefill_tps``, the tokens/s of its full steps (step_clock.py ``full_rate_tps``), is the
    most a backlog drains at here, and ``seq_rps`` the most requests/s its slots let it finish
    (slot_turnover.py): the scheduler's least queue wait (scheduler/queue_eta.py)."""
    if rs is None or rs.clock is None:
        return {}
    c = rs.clock
    long_prompt = {"long_prompt_tokens": rs.long_prompt_tokens()}
    full_ms = c.max_tokens * 1000.0 / c.full_rate_tps if c.full_rate_tps > 0 else 0.0
    seq_rps = turnover.per_s(full_ms, c.fixed_ms) if turnover is not None else 0.0
    rate = {"prefill_tps": round(c.full_rate_tps) if c.full_rate_tps > 0 else None,
            "seq_rps": round(seq_rps, 2) if seq_rps > 0 else None}
    if c.full_step_ms <= 0:
        return {"full_step_ms": None, "token_ms": None, "shared_token_ms": None, "lone_share": None,
                **rate, **long_prompt}
    return {"full_step_ms": round(c.full_step_ms, 2), **rate, "token_ms": round(c.token_ms, 4),
            "shared_token_ms": round(c.shared_ms, 4), "lone_share": round(rs.lone_share(time.monotonic()), 3),
            **long_prompt}
