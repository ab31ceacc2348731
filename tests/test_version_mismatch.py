"""One version per group: the ranks exchange fixed-width step rows, so a rank whose rank 0
runs another step protocol refuses to join with a clear error (exit code 7) instead of
breaking the collective, and rank 0 names the ranks whose record shows another version
when a formation fails."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid

import pytest
import redis

from services.engine_worker.membership import GroupMembership, VersionMismatch
from services.engine_worker.step_view import FIELDS, STEP_PROTOCOL
from shared import keys as K
from shared.bus import connect
from shared.logging import configure
from shared.settings import EngineSettings
from tests.helpers import poll_until
from tests.test_spare_live import _engine

pytestmark = [pytest.mark.timeout(90)]


def test_protocol_names_the_row_layout():
    # A change to the step row's columns must bump STEP_PROTOCOL too (step_view.py).
    assert (STEP_PROTOCOL, FIELDS) == (2, 17)


def _member(redis_url: str, namespace: str, rank: int, r, **settings) -> GroupMembership:
    m = GroupMembership(EngineSettings(**{"redis_url": redis_url, "namespace": namespace, "ranks": 2, "rank": rank,
                                          "collective_timeout_s": 2, "reform_timeout_s": 5, **settings}),
                        r, K.Keys(namespace), configure("engine-worker", "error"), asyncio.Event(),
                        uuid.uuid4().hex, counters=lambda: (0, 0), adopt=lambda w, s: None)
    m.rank = rank
    return m


def test_a_rank_joins_only_a_rank_0_of_its_own_protocol(redis_url, namespace):
    async def main() -> None:
        r = connect(redis_url)
        keys = K.Keys(namespace)
        try:
            rank0, rank1 = _member(redis_url, namespace, 0, r), _member(redis_url, namespace, 1, r)
            await r.set(keys.rank_alive(0), rank0.token)
            _, port = await asyncio.wait_for(rank0._rendezvous(), 10)
            assert (await r.hget(keys.dist, "protocol")) == str(STEP_PROTOCOL).encode()
            assert (await asyncio.wait_for(rank1._rendezvous(), 10))[1] == port

            # Rank 0 replaced by another version (a newer protocol, then one from before it).
            for published, said in (("99", "rank 0 runs step protocol 99"),
                                     (None, "rank 0 runs a lockstep version without a step protocol")):
                mapping = {"gen": rank1.gen + 1, "formed": 0}
                await r.hset(keys.dist, mapping=mapping)
                await r.hdel(keys.dist, "open_ms")      # (that rank 0's own publish: no open key)
                if published is None:
                    await r.hdel(keys.dist, "protocol")
                else:
                    await r.hset(keys.dist, "protocol", published)
                with pytest.raises(VersionMismatch) as err:
                    await asyncio.wait_for(rank1._rendezvous(), 10)
                assert said in str(err.value) and "same lockstep version" in str(err.value)
                # A re-formation does not retry it (it cannot succeed): retried, it would end
                # in GroupLost after reform_timeout_s instead.
                with pytest.raises(VersionMismatch):
                    await asyncio.wait_for(rank1.reform("test"), 10)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_rank_0_names_the_live_ranks_of_another_version(redis_url, namespace):
    async def main() -> None:
        r = connect(redis_url)
        keys = K.Keys(namespace)
        try:
            rank0 = _member(redis_url, namespace, 0, r)
            assert await rank0._other_versions() == ""               # nobody there yet
            await r.set(keys.rank_alive(1), "someone")
            await r.hset(keys.rank_info(1), mapping={"pid": 1})      # a rank from before the protocol
            assert await rank0._other_versions() == f"rank 1 runs step protocol none (this rank {STEP_PROTOCOL})"
            await r.hset(keys.rank_info(1), "protocol", STEP_PROTOCOL)
            assert await rank0._other_versions() == ""
        finally:
            await r.aclose()

    asyncio.run(main())


def test_engine_of_another_version_exits_7_with_the_reason(redis_url, namespace, tmp_path):
    r, k = redis.Redis.from_url(redis_url), K.Keys(namespace)
    proc: subprocess.Popen | None = None
    try:
        # A live rank 0 of a version from before the step protocol published its rendezvous.
        r.set(k.rank_alive(0), "old-rank-0", px=60_000)
        r.hset(k.dist, mapping={"addr": "127.0.0.1", "port": 1, "world": 2, "token": "old-rank-0",
                                "gen": 1, "formed": 0, "t": time.time()})
        log = tmp_path / "rank1.log"
        proc = _engine(redis_url, namespace, log, LOCKSTEP_RANK="1", LOCKSTEP_REFORM_TIMEOUT_S="60")
        poll_until(lambda: proc.poll() is not None, 60, "rank 1 refused the group")
        text = log.read_text()
        assert proc.returncode == 7, text[-2000:]
        assert "engine_version_mismatch" in text and "same lockstep version" in text, text[-2000:]
        assert r.get(k.rank_alive(1)) is None          # the slot is given back
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        r.close()


def test_signature_names_what_a_group_must_share(tmp_path):
    from services.engine_worker import group_signature as gs

    def ckpt(name: str, config: str, weights: int) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(config)
        (d / "model.safetensors").write_bytes(b"x" * weights)
        return str(d)

    a, same, other = ckpt("a", '{"hidden_size": 8}', 10), ckpt("copy", '{"hidden_size": 8}', 10), \
        ckpt("b", '{"hidden_size": 16}', 10)

    def sig(**kw) -> dict:
        return gs.signature(EngineSettings(**{"backend": "torch", **kw}))
    # the same checkpoint kept elsewhere is the same model; auto is float32 on cpu
    assert sig(model=a) == sig(model=same, dtype="float32") == sig(model=same, dtype="fp32")
    assert gs.differences(sig(model=a), sig(model=other)) == [
        f"model {sig(model=a)['model']} here, {sig(model=other)['model']} on rank 0"]
    assert gs.differences(sig(model=a), sig(model=a, dtype="bfloat16")) == ["dtype float32 here, bfloat16 on rank 0"]
    assert sig(model="random", seed=1) != sig(model="random", seed=2) != sig(model="")
    assert gs.decode(gs.encode(sig(model=a))) == sig(model=a)
    assert gs.signature(EngineSettings(backend="sim")) == {"backend": "sim", "device": "cpu"}


def test_a_rank_of_another_model_refuses_rank_0s_group(redis_url, namespace):
    from services.engine_worker.membership import GroupMismatch

    def member(rank: int, r, **kw) -> GroupMembership:
        return _member(redis_url, namespace, rank, r, backend="torch", **kw)

    async def main() -> None:
        r = connect(redis_url)
        keys = K.Keys(namespace)
        try:
            rank0 = member(0, r, model="random", seed=1)
            await r.set(keys.rank_alive(0), rank0.token)
            _, port = await asyncio.wait_for(rank0._rendezvous(), 10)
            # the same settings join (the check costs a matching rank nothing)
            assert (await asyncio.wait_for(member(1, r, model="random", seed=1)._rendezvous(), 10))[1] == port
            # another model's rank was let in before: every collective failed, and the
            # group re-formed for ever
            with pytest.raises(GroupMismatch) as err:
                await asyncio.wait_for(member(1, r, model="random", seed=2)._rendezvous(), 10)
            assert "model random(seed=2) here, random(seed=1) on rank 0" in str(err.value)
            assert "LOCKSTEP_MODEL" in str(err.value)
            # a re-formation does not retry it, as for another version
            with pytest.raises(GroupMismatch):
                await asyncio.wait_for(member(1, r, model="random", seed=2).reform("test"), 10)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_replacement_rank_0_of_another_model_is_the_one_refused(redis_url, namespace):
    from services.engine_worker.membership import GroupMismatch

    async def main() -> None:
        r = connect(redis_url)
        keys = K.Keys(namespace)
        try:
            def member(rank: int, seed: int) -> GroupMembership:
                return _member(redis_url, namespace, rank, r, backend="torch", model="random", seed=seed)
            first, rank1 = member(0, 1), member(1, 1)
            await first._rendezvous()
            await r.set(keys.rank_alive(1), rank1.token)
            await r.hset(keys.rank_info(1), "signature", rank1.signature)
            # rank 0 died; its replacement was started with another model while rank 1 lives:
            # rank 1 would refuse it and exit, so the replacement refuses instead
            with pytest.raises(GroupMismatch) as err:
                await asyncio.wait_for(member(0, 2)._rendezvous(), 10)
            assert "live rank(s) 1" in str(err.value) and "random(seed=1) on them" in str(err.value)
            # once none of that group lives, the new signature starts a group of its own
            await r.delete(keys.rank_alive(1))
            await asyncio.wait_for(member(0, 2)._rendezvous(), 10)
            assert (await r.hget(keys.dist, "signature")).decode() == member(0, 2).signature
        finally:
            await r.aclose()

    asyncio.run(main())


def test_engine_of_another_model_exits_7_naming_the_difference(redis_url, namespace, tmp_path):
    r, k = redis.Redis.from_url(redis_url), K.Keys(namespace)
    procs: list[subprocess.Popen] = []
    torch_rank = {"LOCKSTEP_BACKEND": "torch", "LOCKSTEP_MODEL": "random", "LOCKSTEP_REFORM_TIMEOUT_S": "60"}
    try:
        procs.append(_engine(redis_url, namespace, tmp_path / "rank0.log", LOCKSTEP_RANK="0", LOCKSTEP_SEED="1",
                             **torch_rank))
        poll_until(lambda: r.hget(k.dist, "signature") is not None, 60, "rank 0 published its rendezvous")
        log = tmp_path / "rank1.log"
        procs.append(_engine(redis_url, namespace, log, LOCKSTEP_RANK="1", LOCKSTEP_SEED="2", **torch_rank))
        poll_until(lambda: procs[1].poll() is not None, 60, "rank 1 refused the group")
        text = log.read_text()
        assert procs[1].returncode == 7, text[-2000:]
        assert "engine_group_mismatch" in text and "random(seed=2) here, random(seed=1) on rank 0" in text, \
            text[-2000:]
        assert r.get(k.rank_alive(1)) is None          # the slot is given back for a rank of the right model
        assert procs[0].poll() is None                 # rank 0 waits for one
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        r.close()
