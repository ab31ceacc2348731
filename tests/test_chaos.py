"""`lockstep chaos` (issue #14): the seeded fault schedule and the outcome rules (pure), and
a short run against a real local cluster that must lose and duplicate nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.admin.chaos import KINDS, classify, expected_text, fault_schedule
from tests.conftest import ROOT
from tests.helpers import sim_expected_text
from shared.tokenizer import encode


def test_schedule_is_a_function_of_its_seed():
    a = fault_schedule(7, 300, ranks=2, api_servers=2)
    assert a == fault_schedule(7, 300, ranks=2, api_servers=2)
    assert a != fault_schedule(8, 300, ranks=2, api_servers=2)


@pytest.mark.parametrize("duration,ranks", [(30, 2), (60, 4), (300, 2), (300, 8)])
def test_schedule_covers_every_kind_and_rank_zero_within_bounds(duration, ranks):
    faults = fault_schedule(3, duration, ranks=ranks, api_servers=2, warmup_s=3.0, cooldown_s=8.0)
    assert {f.kind for f in faults} == set(KINDS)
    times = [f.t for f in faults]
    assert times == sorted(times) and times[0] >= 3.0 and times[-1] <= duration - 8.0
    rank_faults = [f for f in faults if f.kind in ("rank_kill", "rank_leave")]
    assert all(0 <= f.target < ranks for f in rank_faults)
    if len(rank_faults) >= ranks:
        assert 0 in {f.target for f in rank_faults}
    assert all(0 <= f.target < 2 for f in faults if f.kind == "api")
    # every kind once in each round of len(KINDS) faults
    for i in range(0, len(faults) - len(KINDS) + 1, len(KINDS)):
        assert {f.kind for f in faults[i:i + len(KINDS)]} == set(KINDS)


def test_schedule_is_empty_when_no_time_is_left_for_recovery():
    assert fault_schedule(1, 10, ranks=2, api_servers=1, warmup_s=3.0, cooldown_s=8.0) == []


def test_classify():
    exp = "abcdef"
    assert classify(exp, 6, "abcdef", 6, None) == "completed"
    assert classify(exp, 6, "abc", 3, "connection:ReadError") == "failed"   # a clear error wins
    assert classify(exp, 6, None, None, None) == "lost"                    # no answer in the bound
    assert classify(exp, 6, "abc", 3, None) == "lost"                      # tokens missing, no error
    assert classify(exp, 6, "abcabcdef", 9, None) == "duplicated"          # tokens sent twice
    assert classify(exp, 6, "abcdef", 7, None) == "duplicated"             # counted twice
    assert classify(exp, 6, "abcxef", 6, None) == "corrupt"


def test_expected_text_is_the_sim_backends():
    assert expected_text("chaos 1 2", 40, 2) == sim_expected_text(encode("chaos 1 2"), 40, seed=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("options", [(), ("--dispatch", "client", "--policy", "least_tokens", "--spares", "0",
                                          "--schedulers", "1")], ids=["default", "client-dispatch-no-standby"])
def test_short_chaos_run_loses_and_duplicates_nothing(tmp_path, options):
    """30 s of load on a 2-rank sim cluster with one fault of each kind (rank 0 or 1 killed,
    a rank leaving, the leader, an api-server, Redis restarted); also with the api-servers
    placing requests, no hot spare and no standby scheduler (a dead rank's or leader's
    process is started again)."""
    res = subprocess.run([sys.executable, "-m", "services.admin.cli", "chaos", "--duration", "30", "--seed", "1",
                          "--json", "--work-dir", str(tmp_path / "chaos"), *options],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert res.stdout, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["corrupt"] == 0, out["not_exact"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert out["completed"] > 0 and out["sent"] == out["completed"] + out["failed"]
    assert out["faults"] == {k: 1 for k in KINDS}, out   # each injected (none skipped)
    # a failure is a clear one: an OpenAI error body or a dropped connection, never an unclear body
    assert not [k for k in out["failed_by_kind"] if k.endswith(":unclear")], out["failed_examples"]
    # Faults make errors, never crashes: no service logged a traceback, the end of the run
    # included (Redis and the respawned children used to die with the thread that started
    # them, before the cluster's orderly stop).
    logs = {p.name: p.read_text() for p in (tmp_path / "chaos" / "logs").glob("*.log")}
    assert logs and not [n for n, t in logs.items() if "Traceback" in t], \
        {n: t[t.index("Traceback") - 500:][:3000] for n, t in logs.items() if "Traceback" in t}


def _sleeper() -> subprocess.Popen:
    from shared.redis_server import die_with_parent
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent)


@pytest.mark.timeout(60)
def test_children_the_owner_thread_starts_live_until_the_cluster_stops():
    """The hazard: a child gets its parent-death signal when the *thread* that started it
    exits. Started from a thread that ends, it dies with it; started by the owner thread,
    it is alive when the owner stops the cluster, and only then goes."""
    import threading

    from services.admin.chaos import ClusterOwner

    box: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: box.append(_sleeper()))
    t.start()
    t.join()
    assert box[0].wait(20) != 0          # gone with its thread (SIGTERM)

    class Cluster:
        seen: list = []

        def supervise(self) -> bool:
            return True

        def stop(self) -> None:
            self.seen.extend(p.poll() for p in box[1:])
            for p in box[1:]:
                p.kill()
                p.wait(10)

    cluster = Cluster()
    owner = ClusterOwner(cluster, poll_s=0.05)
    owner.start()
    box.append(owner.submit(_sleeper).result(10))
    owner.finish.set()
    owner.join(30)
    assert cluster.seen == [None]        # alive when the cluster stopped


@pytest.mark.parametrize("args, says", [
    (("--policy", "nope"), "unknown --policy 'nope'"),
    (("--dispatch", "both"), "--dispatch must be 'scheduler' or 'client'"),
    (("--dispatch", "client", "--policy", "staggered"), "needs dispatch 'scheduler'"),
])
def test_chaos_refuses_a_cluster_the_services_would_refuse(args, says):
    from typer.testing import CliRunner

    from services.admin.cli import app
    res = CliRunner().invoke(app, ["chaos", "--duration", "30", *args])
    assert res.exit_code == 2 and says in res.stderr, res.output
