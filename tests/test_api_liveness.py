"""api_liveness: an api-server's requests are aborted only once its alive key stayed gone."""

from services.engine_worker.api_liveness import ApiLiveness


def test_a_key_that_lapses_during_a_redis_failover_and_comes_back_aborts_nothing():
    lv = ApiLiveness(grace_s=5.0)
    assert lv.observe(0.0, {"a": True}) == set()
    assert lv.observe(1.0, {"a": False}) == set()     # the failover outlived the 3 s TTL
    assert lv.observe(3.0, {"a": False}) == set()
    assert lv.observe(4.0, {"a": True}) == set()      # it beat again: forgiven
    assert lv.observe(8.0, {"a": False}) == set()     # a new absence starts a new grace
    assert lv.observe(12.0, {"a": False}) == set()


def test_a_key_gone_for_the_whole_grace_is_dead():
    lv = ApiLiveness(grace_s=5.0)
    assert lv.observe(0.0, {"a": False, "b": True}) == set()
    assert lv.observe(5.0, {"a": False, "b": True}) == {"a"}


def test_an_api_server_with_no_requests_left_is_forgotten():
    lv = ApiLiveness(grace_s=5.0)
    lv.observe(0.0, {"a": False})
    lv.observe(1.0, {})                               # its requests finished here
    assert lv.observe(6.0, {"a": False}) == set()     # a new request of it: a new grace


def test_lapses_while_this_ranks_writes_are_refused_say_nothing():
    # (Redis at maxmemory refused every write for 10 s but answered reads: the api-servers'
    # alive keys lapsed, and every rank aborted the requests of api-servers that were alive)
    lv = ApiLiveness(grace_s=5.0)
    for t in range(0, 12):                                    # writes refused from t=0 to t=10
        assert lv.observe(float(t), {"a": False}, writes_failed_at=float(min(t, 10))) == set()
    assert lv.observe(15.0, {"a": False}, writes_failed_at=10.0) == set()     # the grace counts from here
    assert lv.observe(19.0, {"a": False}, writes_failed_at=10.0) == set()
    assert lv.observe(20.5, {"a": False}, writes_failed_at=10.0) == {"a"}     # a real absence still ends it


def test_requests_aborted_for_a_silent_api_server_say_why():
    # (a client of an api-server stalled past the grace, a long GC pause, read only
    # "the request could not be completed: abort; retry it")
    from services.engine_worker.api_watch import _abort_owned_by
    from services.engine_worker.block_manager import BlockManager
    from services.engine_worker.engine_scheduler import EngineScheduler
    from services.engine_worker.sequence import Sequence
    from shared.messages import Request, SamplingParams

    core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512)
    for rid, api in (("x", "gone"), ("y", "here")):
        core.add(Sequence.from_request(Request(rid, api, [1, 2, 3], SamplingParams(max_tokens=5), 0.0), "", 0), 0.0)
    aborted: list = []

    class _Log:
        def warning(self, *a, **k) -> None:
            pass

    _abort_owned_by(core, {"gone"}, aborted.append, _Log(), 5.0)
    assert [s.id for s in aborted] == ["x"] and core.get("y") is not None
    assert aborted[0].error == "aborted on its rank: the api-server serving it stopped answering for over 5 s"


def test_a_rank_waiting_in_the_collective_counts_its_refused_beats_as_redis_trouble():
    # (CI, a full Redis for 10 s: one rank's step loop had written its step just before
    # the fault and waited in the collective for its peer, stuck replaying its own writes;
    # with no round trip of its own it saw no trouble, took the api-server's lapsed alive
    # key for a dead api-server, and aborted its streams)
    from services.engine_worker.batch_gate import BatchGate
    from services.engine_worker.block_manager import BlockManager
    from services.engine_worker.engine_scheduler import EngineScheduler
    from services.engine_worker.rank_state import RankState
    from services.engine_worker.rank_step import RankStep

    core = EngineScheduler(BlockManager(64, 16), max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512)
    gate = BatchGate(rank=0, timeout_s=0.5)
    st = RankState(0, core, gate, RankStep(0, core, gate, None))
    assert st.redis_trouble_at(100.0) == float("-inf")
    st.note_beat_failed(104.0)                       # the liveness thread's heartbeat was refused
    assert st.redis_trouble_at(105.0) == 104.0
    lv = ApiLiveness(grace_s=5.0)
    for t in (101.0, 103.0, 105.0, 107.0, 108.5):    # the key lapsed at 100; refused beats until 104
        assert lv.observe(t, {"a": False}, st.redis_trouble_at(t)) == set(), t
