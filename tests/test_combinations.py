"""Every combination `lockstep up` accepts is served, the others are refused at start with
a message that says what to use instead (issue #14.3: `--dispatch client --policy
staggered` used to start and then answer every request with 500).

Each combination goes through the same path as `up`: the environment its children get,
the settings they read from it, then the decision maker of that mode builds its policy
and places two requests against the real Redis (the scheduler's ``intake.handle``, or the
api-server's ``Gateway.submit`` in client dispatch)."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time

import pytest

from services.admin.up import UpOptions, check_options
from services.api_server.gateway import Gateway, client_policy
from services.scheduler.service import SchedulerService
from shared import keys as K
from shared.bus import connect, decode_entries, ensure_group
from shared.messages import FIELD, Request, SamplingParams, dumps
from shared.policy.registry import policy_names
from tests.conftest import ROOT
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

DISPATCH = ("scheduler", "client")
ALIGN = (False, True)
SCHEDULERS = (1, 2)
BACKENDS = ("sim", "torch")


def _req(rid: str, api: str) -> Request:
    return Request(rid, api, list(b"hi there"), SamplingParams(max_tokens=4), time.time())


async def _inbox_ids(r, keys: K.Keys, ranks: int) -> set[str]:
    ids = set()
    for rank in range(ranks):
        for _, _, doc in decode_entries([(b"x", await r.xrange(keys.inbox(rank)))]):
            if doc.get("k") == "req":
                assert doc.get("r") == rank and doc.get("dp"), doc
                ids.add(doc["id"])
    return ids


async def test_every_up_combination_is_served_or_refused(redis_url, namespace):
    refused, served = [], []
    r = connect(redis_url)
    try:
        for i, (policy, dispatch, align, schedulers, backend) in enumerate(
                itertools.product(policy_names(), DISPATCH, ALIGN, SCHEDULERS, BACKENDS)):
            combo = (policy, dispatch, align, schedulers, backend)
            opts = UpOptions(ranks=2, api_servers=2, policy=policy, dispatch=dispatch, schedulers=schedulers,
                             backend=backend, extra_env={"LOCKSTEP_ALIGN_TOKENS": "1" if align else "0"})
            try:
                sched, api, engine = check_options(opts)
            except ValueError as exc:
                msg = str(exc)
                assert "--dispatch scheduler" in msg and "least_score" in msg, (combo, msg)
                refused.append(combo)
                continue
            assert (engine.align_tokens, engine.backend, sched.policy, api.dispatch) == (align, backend, policy,
                                                                                         dispatch)
            ns = f"{namespace}c{i}"
            keys = K.Keys(ns)
            sched.redis_url, sched.namespace = redis_url, ns
            if dispatch == "scheduler":
                svc = SchedulerService(sched)
                svc.attach(r)
                await ensure_group(r, keys.requests, K.SCHEDULER_GROUP, "0")
                for rid in ("a", "b"):
                    await r.xadd(keys.requests, {FIELD: dumps(_req(rid, "api0").to_dict())})
                resp = await r.xreadgroup(K.SCHEDULER_GROUP, svc.id, {keys.requests: ">"}, count=10)
                await svc.intake.handle(decode_entries(resp))
                # a policy that holds requests (waterfill collects arrivals for collect_ms)
                # releases them from its batcher job, as run() does
                while svc.state.batching and svc.policy.next_deadline() is not None:
                    await asyncio.wait_for(svc.batches.iteration(), 5)
            else:
                gw = Gateway(r, keys, "api0-x", dispatch="client", policy=client_policy(api, "api0-x"))
                gw.policy.set_ranks([0, 1])
                for rid in ("a", "b"):
                    gw.submit(_req(rid, "api0-x"))
            assert await wait_until(lambda: _has(r, keys, {"a", "b"}), timeout=5), combo
            served.append(combo)
    finally:
        await r.aclose()
    # Only staggered batches with client dispatch are refused; everything else is served.
    assert sorted(refused) == sorted(c for c in itertools.product(policy_names(), DISPATCH, ALIGN, SCHEDULERS,
                                                                  BACKENDS) if c[:2] == ("staggered", "client"))
    assert len(served) == len(policy_names()) * 2 * 2 * 2 * 2 - len(refused)


async def _has(r, keys: K.Keys, ids: set[str]) -> bool:
    return ids <= await _inbox_ids(r, keys, 2)


def test_up_refuses_client_dispatch_with_staggered_before_starting_anything(tmp_path):
    env = {**os.environ, "LOCKSTEP_STATE_DIR": str(tmp_path / "state")}
    env.pop("LOCKSTEP_REDIS_URL", None)
    p = subprocess.run([sys.executable, "-m", "services.admin.cli", "up", "--dispatch", "client", "--policy",
                        "staggered", "--namespace", "combo"], capture_output=True, text=True, timeout=60, env=env,
                       cwd=ROOT)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs dispatch 'scheduler'" in p.stderr and "--dispatch scheduler --policy staggered" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_second_up_on_a_live_namespace_of_the_same_redis_is_refused(tmp_path, redis_url, namespace):
    # Another host's (or user's, or state directory's) `up` cannot see the first one's local
    # record: it started, took the first one's lead and dist keys, and its ranks crash-looped
    # for want of a free slot while its api-server served the first cluster.
    import openai

    from shared.redis_server import free_port
    from tests.conftest import start_cluster

    (tmp_path / "a").mkdir()
    first = start_cluster(tmp_path / "a", "--ranks", "1", "--spares", "0", "--api-servers", "1", "--backend", "sim",
                          "--redis-url", redis_url, namespace=namespace)
    try:
        c = openai.OpenAI(base_url=first.api_url, api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model="lockstep-moe", prompt="hi", max_tokens=2).choices[0].text is not None
        env = {**os.environ, "LOCKSTEP_STATE_DIR": str(tmp_path / "b")}
        env.pop("LOCKSTEP_REDIS_URL", None)
        p = subprocess.run([sys.executable, "-m", "services.admin.cli", "up", "--backend", "sim", "--ranks", "1",
                            "--redis-url", redis_url, "--namespace", namespace, "--port", str(free_port())],
                           capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        assert p.returncode == 2, p.stdout + p.stderr
        assert "already runs in namespace" in p.stderr and "rank 0 with a heartbeat" in p.stderr, p.stderr
        # the first is undisturbed (its lead was not taken from it)
        assert c.completions.create(model="lockstep-moe", prompt="hi", max_tokens=2).choices[0].text is not None
        c.close()
    finally:
        first.stop()
