"""Admitting what the inbox brought at a step boundary: requests into the engine core
(a second copy of one already here is dropped, a newer epoch of it replaces it), aborts
of requests here, retirements of stale copies, and the same two popped from the rank's
cancels list ahead of the inbox's backlog (shared/cancels.py); malformed entries acked
and logged, never stopping the step loop."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from services.engine_worker.rank_state import RankState
from services.engine_worker.sequence import Sequence
from services.engine_worker.sim_backend import eos_from
from shared.messages import Abort, MessageError, Request, Retire


CANCELLED_MAX = 65_536    # notes of cancels for requests not read yet (each outlives its request only
                          # when the inbox copy of the message was read before the list's)


def ingest(state: RankState, fetched: list[tuple[bytes, dict[str, Any]]], log: Any,
           cancels: Iterable[dict[str, Any]] = ()) -> None:
    """Writes the per-request tables, ``acks``, ``early`` (rejections), ``aborted`` and
    ``cancelled``. ``cancels``: aborts and retirements popped from the rank's cancels list
    (shared/cancels.py), applied first: those of requests read in ``fetched`` apply as the
    requests are admitted."""
    st = state
    for doc in cancels:
        _cancel_early(st, doc, log)
    for eid, doc in fetched:
        kind = doc.get("k")
        if kind == "req":
            req = _parse(st, Request, eid, doc, log)
            if req is None:
                continue
            if req.id in st.entry_of:          # already here
                if not supersede(st, req, eid, log):
                    if st.entry_of[req.id] != eid:  # a second dispatch of it: drop that copy
                        st.acks.append(eid)
                    continue
            if req.dispatcher:
                st.recv.note(req.dispatcher, req.dispatch_seq, time.monotonic())
            seq = Sequence.from_request(req, req.dispatcher or "", req.dispatch_seq)
            st.entry_of[req.id] = eid
            st.prompts[req.id] = req.prompt
            st.eos_from[req.id] = eos_from(req.params)
            st.lp.track(req.id, req.params, req.prompt)
            st.guides.track(req.id, req.params)
            log.debug("request_admitted", request_id=req.id, wave=st.wave, step=st.step,
                      prompt_tokens=len(req.prompt), resumed_at=len(req.generated))
            rejected = st.core.add(seq, time.time())
            if rejected is not None:      # can never run here, or nothing left to generate
                st.early.append(rejected)
            else:
                st.rs.arrived(seq, time.monotonic())
                note = st.cancelled.pop(req.id, None)
                if note is not None:      # cancelled before this rank read it: now
                    _apply(st, note, log)
        elif kind == "retire":
            rt = _parse(st, Retire, eid, doc, log)
            if rt is None:
                continue
            st.acks.append(eid)
            st.cancelled.pop(rt.id, None)  # (its request came before it: admitted, or gone)
            retire(st, rt, log)
        elif kind == "abort":
            ab = _parse(st, Abort, eid, doc, log)
            if ab is None:
                continue
            st.acks.append(eid)
            st.cancelled.pop(ab.id, None)
            abort(st, ab)
        else:
            st.acks.append(eid)
            log.warning("inbox_entry_ignored", kind=kind)


def abort(state: RankState, ab: Abort) -> None:
    seq = state.core.abort(ab.id)
    if seq is not None:
        state.aborted.append(seq)


def _apply(state: RankState, msg: Abort | Retire, log: Any) -> None:
    if isinstance(msg, Abort):
        abort(state, msg)
    else:
        retire(state, msg, log)


def _cancel_early(state: RankState, doc: dict[str, Any], log: Any) -> None:
    """An abort or retirement from the cancels list: applied now to a request here, kept
    as a note for one not read yet (its inbox entry waits behind the backlog). The inbox
    copy of the message comes later and finds the work done."""
    try:
        msg = (Abort if doc.get("k") == "abort" else Retire).from_dict(doc)
    except MessageError as exc:
        log.warning("bad_cancel", error=str(exc))   # (the inbox copy is read, and logged, there)
        return
    if state.core.get(msg.id) is not None:
        _apply(state, msg, log)
        return
    prev = state.cancelled.pop(msg.id, None)
    if isinstance(prev, Abort) or (isinstance(prev, Retire) and isinstance(msg, Retire) and prev.epoch > msg.epoch):
        msg = prev     # an abort wins; of two retirements, the newer epoch
    state.cancelled[msg.id] = msg
    while len(state.cancelled) > CANCELLED_MAX:
        state.cancelled.popitem(last=False)


def _parse(state: RankState, cls: Any, eid: bytes, doc: dict[str, Any], log: Any) -> Any:
    """The entry as message ``cls``; None (acked and logged) when malformed for good: it is
    dropped and the step loop goes on."""
    try:
        return cls.from_dict(doc)
    except MessageError as exc:
        state.acks.append(eid)
        log.error("bad_inbox_entry", entry=eid.decode(), error=str(exc))
        return None


def supersede(state: RankState, req: Request, eid: bytes, log: Any) -> bool:
    """A newer epoch of a request this rank still runs: its api-server resumed it (a scan
    took this rank for dead while its heartbeat lapsed: a stall, a Redis failover) and
    ignores the deltas of the copy here. Drop that copy, so the new one is admitted and
    continues from the tokens the client has; dropping the new one would stall the stream
    for good. True when the old copy was dropped."""
    here = state.core.get(req.id)
    if here is None:
        # The copy here already ended (an abort: its api-server looked dead while Redis
        # refused writes) and its final delta waits for the next write: the newer epoch
        # must still run, and that delta, of an epoch its api-server ignores, goes unsent
        # (sent later, its forget() would drop the new copy's tables).
        here = _take_pending_end(state, req.id, req.epoch)
        if here is None:
            return False
    elif req.epoch <= here.epoch:
        return False
    else:
        state.core.abort(req.id)
    old = state.forget(req.id)
    if old is not None and old != eid:
        state.acks.append(old)   # (already acked by the scan that resumed it: a no-op then)
    log.warning("request_superseded", request_id=req.id, epoch=req.epoch, old_epoch=here.epoch,
                streamed=len(req.generated), had=len(here.generated))
    return True


def _take_pending_end(state: RankState, seq_id: str, epoch: int) -> Any:
    """The ended copy of ``seq_id`` older than ``epoch`` whose final delta is not written
    yet, taken out of the pending list; None where there is none."""
    for pending in (state.aborted, state.early):
        for i, item in enumerate(pending):
            seq = getattr(item, "seq", item)    # early: outputs (seq + finish); aborted: sequences
            if seq.id == seq_id:
                if seq.epoch >= epoch:
                    return None
                del pending[i]
                return seq
    return None


def retire(state: RankState, rt: Retire, log: Any) -> None:
    """Drop a stale copy (epoch ``rt.epoch`` or older) of a request resumed elsewhere, so it
    stops taking this rank's steps; silently: its api-server ignores that epoch."""
    here = state.core.get(rt.id)
    if here is None or here.epoch > rt.epoch:
        return
    state.core.abort(rt.id)
    old = state.forget(rt.id)
    if old is not None:
        state.acks.append(old)   # (the scan that resumed it acked it already: a no-op then)
    log.info("stale_copy_retired", request_id=rt.id, epoch=here.epoch, tokens=len(here.generated))
