"""What a rank does with the inbox entries it read (services/engine_worker/ingest.py), on
the real engine core: a second dispatch of a request it runs is dropped, a resumed (newer
epoch) copy replaces the stale one instead."""

from __future__ import annotations

import orjson

from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.ingest import ingest
from services.engine_worker.rank_state import RankState
from services.engine_worker.rank_step import RankStep
from shared.messages import Request, Retire, SamplingParams, encode


class _Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level: str):
        return lambda event, **kw: self.events.append(event)


def _state() -> RankState:
    core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512)
    gate = BatchGate(rank=0, timeout_s=0.5)
    return RankState(0, core, gate, RankStep(0, core, gate, None))


def _entry(epoch: int = 0, generated: list[int] | None = None) -> dict:
    req = Request("r1", "api-a", [1, 2, 3, 4], SamplingParams(max_tokens=20), 1.0,
                  generated=generated or [], epoch=epoch)
    return orjson.loads(encode(req))


def _run_steps(st: RankState, n: int) -> None:
    for _ in range(n):
        plan = st.core.schedule()
        st.core.postprocess(plan, {c.seq_id: 7 for c in plan.chunks if c.sample}, 0.0)


def test_a_second_dispatch_of_the_same_epoch_is_dropped_and_acked():
    st, log = _state(), _Log()
    ingest(st, [(b"1-0", _entry())], log)
    _run_steps(st, 3)
    ingest(st, [(b"2-0", _entry())], log)
    assert st.entry_of["r1"] == b"1-0" and st.acks == [b"2-0"]
    assert len(st.core.get("r1").generated) == 3


def test_a_resumed_copy_replaces_the_stale_one_here():
    """The api-server resumed r1 (this rank's heartbeat lapsed and a scan took it for
    dead) and the scheduler placed it back here. Dropping the new copy, as a duplicate,
    left the old one streaming deltas of an epoch the api-server ignores: the stream
    stalled for good."""
    st, log = _state(), _Log()
    ingest(st, [(b"1-0", _entry())], log)
    _run_steps(st, 5)
    blocks_before = st.core.kv_used
    ingest(st, [(b"2-0", _entry(epoch=1, generated=[7, 7]))], log)
    seq = st.core.get("r1")
    assert seq.epoch == 1 and seq.generated == [7, 7]          # continues from what the client has
    assert st.entry_of["r1"] == b"2-0" and st.acks == [b"1-0"]  # the stale entry acked, the new one kept
    assert st.core.num_running + st.core.num_waiting == 1
    assert st.core.kv_used <= blocks_before                     # the stale copy's blocks were freed
    assert "request_superseded" in log.events
    # And an older copy arriving after the new one (a re-read) is still dropped.
    ingest(st, [(b"1-0", _entry())], log)
    assert st.core.get("r1").epoch == 1 and st.acks[-1] == b"1-0"


def _retire(epoch: int) -> dict:
    return orjson.loads(encode(Retire("r1", 0, epoch)))


def test_a_retire_drops_the_stale_copy_and_spares_a_newer_one():
    """A rank back from a lapsed heartbeat still runs the copies its api-servers resumed
    elsewhere; each api-server retires its copy (epoch 0 here) so that it stops taking
    this rank's steps. The copy of a newer epoch is the live one: a retire never drops it."""
    st, log = _state(), _Log()
    ingest(st, [(b"1-0", _entry())], log)
    _run_steps(st, 2)
    ingest(st, [(b"2-0", _retire(0))], log)
    assert st.core.get("r1") is None and "r1" not in st.entry_of
    assert st.acks == [b"2-0", b"1-0"] and st.aborted == []     # acked, and no delta answers it
    assert st.core.num_running == 0 and st.core.kv_used == 0
    ingest(st, [(b"3-0", _entry(epoch=1, generated=[7]))], log)
    ingest(st, [(b"4-0", _retire(0))], log)
    assert st.core.get("r1").epoch == 1 and st.acks[-1] == b"4-0"


def test_a_resumed_copy_runs_where_the_old_one_ended_but_its_end_is_not_written_yet():
    """Redis refused writes (maxmemory): the api-servers' alive keys lapsed, so this rank
    aborted their requests, and the aborts waited in ``aborted`` for a write that Redis
    refused too. Meanwhile the api-server resumed r1 (a newer epoch) here: it was dropped as
    a second copy, and its stream hung with half its text."""
    st, log = _state(), _Log()
    ingest(st, [(b"1-0", _entry())], log)
    _run_steps(st, 3)
    st.aborted.append(st.core.abort("r1"))               # the abort whose delta is not written yet
    ingest(st, [(b"2-0", _entry(epoch=1, generated=[7, 7]))], log)
    seq = st.core.get("r1")
    assert seq is not None and seq.epoch == 1 and seq.generated == [7, 7]
    assert st.entry_of["r1"] == b"2-0" and st.acks == [b"1-0"] and st.aborted == []
    # a copy of the same epoch as the ended one is still a duplicate: dropped, the end kept
    st2, log = _state(), _Log()
    ingest(st2, [(b"1-0", _entry())], log)
    st2.aborted.append(st2.core.abort("r1"))
    ingest(st2, [(b"2-0", _entry())], log)
    assert st2.core.get("r1") is None and len(st2.aborted) == 1 and st2.acks == [b"2-0"]


def _abort() -> dict:
    from shared.messages import Abort
    return orjson.loads(encode(Abort("r1", 0, "client_disconnected")))


def test_an_abort_from_the_cancels_list_ends_a_request_here_at_once():
    st, log = _state(), _Log()
    ingest(st, [(b"1-0", _entry())], log)
    _run_steps(st, 2)
    ingest(st, [], log, [_abort()])          # the inbox's copy is still behind the backlog
    assert st.core.get("r1") is None and [s.id for s in st.aborted] == ["r1"]
    ingest(st, [(b"9-0", _abort())], log)    # then the inbox's copy: acked, nothing more
    assert st.acks == [b"9-0"] and len(st.aborted) == 1 and not st.cancelled


def test_an_abort_of_a_request_not_read_yet_applies_when_it_is_read():
    """A rank whose waiting queue is full reads no inbox entry: an abort behind thousands
    of unread requests waited there while its request ran for nobody (a 6,000-request
    burst abandoned by its clients ran to completion; the traffic after it queued behind)."""
    st, log = _state(), _Log()
    ingest(st, [], log, [_abort()])
    assert "r1" in st.cancelled and not st.aborted
    ingest(st, [(b"1-0", _entry()), (b"2-0", _abort())], log)
    assert st.core.get("r1") is None and [s.id for s in st.aborted] == ["r1"]
    assert st.acks == [b"2-0"] and not st.cancelled     # (the request's entry is acked with its abort delta)


def test_a_retirement_not_read_yet_spares_a_newer_copy():
    st, log = _state(), _Log()
    ingest(st, [], log, [_retire(0)])
    ingest(st, [(b"1-0", _entry(epoch=1, generated=[7]))], log)
    assert st.core.get("r1").epoch == 1 and not st.cancelled
    st2, log2 = _state(), _Log()
    ingest(st2, [], log2, [_retire(0)])
    ingest(st2, [(b"1-0", _entry())], log2)
    assert st2.core.get("r1") is None and "stale_copy_retired" in log2.events


def test_notes_of_cancels_are_bounded():
    from services.engine_worker import ingest as ingest_mod
    from shared.messages import Abort
    st, log = _state(), _Log()
    cap = ingest_mod.CANCELLED_MAX
    ingest(st, [], log, [orjson.loads(encode(Abort(f"x{i}", 0, "gone"))) for i in range(cap + 5)])
    assert len(st.cancelled) == cap and "x0" not in st.cancelled and f"x{cap + 4}" in st.cancelled
