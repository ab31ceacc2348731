"""Pure parts of running on several Redis servers: the URL forms, redaction, connection
names, and the rule that every multi-key transaction goes through ``bus.atomic``."""

from __future__ import annotations

import re

import pytest

from shared import bus
from shared.keys import Keys
from shared.redis_url import CLUSTER, SENTINEL, SINGLE, BadRedisUrl, parse
from tests.conftest import ROOT


def test_url_forms():
    assert parse("redis://127.0.0.1:6379/0").kind == SINGLE
    assert parse("rediss://u:p@h:6380/1").kind == SINGLE
    assert parse("redis://h:6379").kind == parse("redis://h:6379/").kind == parse("redis://h/2?protocol=3").kind
    t = parse("redis+cluster://a:7000,b:7001")
    assert (t.kind, t.nodes, t.tls) == (CLUSTER, (("a", 7000), ("b", 7001)), False)
    t = parse("rediss+cluster://user:pw@[::1]:7000")
    assert (t.nodes, t.username, t.password, t.tls) == ((("::1", 7000),), "user", "pw", True)
    t = parse("redis+sentinel://s1:26379,s2:26380/mymaster")
    assert (t.kind, t.service, t.db, len(t.nodes)) == (SENTINEL, "mymaster", 0, 2)
    for bad, why in (("127.0.0.1:6379", "no scheme"), ("redis+cluster://h:notaport", "bad HOST:PORT"),
                     ("redis+sentinel://h:26379/svc/x", "bad database"), ("http://h:1", "unknown Redis URL scheme"),
                     # redis-py took these as database 0, silently
                     ("redis://127.0.0.1:6379/abc", "bad database number 'abc'"),
                     ("rediss://u:p@h:6380/1x?ssl_cert_reqs=none", "bad database number")):
        with pytest.raises(BadRedisUrl, match=why):
            parse(bad)


def test_redact_hides_the_password_of_every_form():
    assert bus.redact_url("redis+cluster://u:secret@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert bus.redact_url("redis+sentinel://:secret@s:26379/m") == "redis+sentinel://:***@s:26379/m"
    assert bus.redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_connection_names_say_which_service():
    assert bus.client_name(["engine-worker"], 42) == "lockstep-engine-worker-42"
    assert bus.client_name(["--namespace", "x"], 1) == "lockstep-x-1"
    assert bus.client_name([], 7) == "lockstep-client-7"


def test_namespace_cannot_move_the_hash_tag():
    with pytest.raises(ValueError, match="braces"):
        Keys("a{b}")
    k = Keys("ns")
    assert {k.requests[:4], k.inbox(3)[:4], k.wave[:4], k.paused[:4]} == {"{ns}"}
    assert not any("{" in key for key in (k.out("api0"), k.stats, k.steps, k.req("cmpl-1"), k.rank_alive(1)))


def test_every_transaction_goes_through_atomic():
    """Redis Cluster refuses a MULTI whose keys span slots; bus.atomic splits one safely.
    A plain transaction is allowed only where all its keys are one key (listed here)."""
    single_key = {("services/admin/supervisor.py", "k.vacancies")}
    found = []
    for path in [*ROOT.glob("services/**/*.py"), *ROOT.glob("shared/*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel == "shared/bus.py":
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"pipeline\(\s*transaction\s*=\s*True", line):
                following = "\n".join(lines[i + 1:i + 4])
                if not any(rel == p and key in following for p, key in single_key):
                    found.append(f"{rel}:{i + 1}")
    assert not found, f"use bus.atomic(r, slot_key) for these transactions: {found}"


def test_redis_load_model_follows_the_step_protocol():
    """scripts/redis-load's model: each rank sends 5 commands a step plus an XADD per
    api-server it serves and that stream's EXPIRE once a second (and a little for finishes
    and heartbeats); the
    scheduler's bytes grow with the ranks (the snapshot); the script prints every service."""
    import importlib.util
    import subprocess
    import sys
    from importlib.machinery import SourceFileLoader

    path = str(ROOT / "scripts" / "redis-load")
    spec = importlib.util.spec_from_loader("redis_load", SourceFileLoader("redis_load", path))
    load = importlib.util.module_from_spec(spec)
    sys.modules["redis_load"] = load          # its dataclasses look their module up
    spec.loader.exec_module(load)
    w = load.Workload(ranks=256, api_servers=16, step_s=0.04, running=32, output_tokens=256)
    m = load.model(w)
    per_rank = m["engine-worker"]["cmds_per_step"] / 256
    base = 5 + 16 * (1 + 0.04)   # an XADD a step per api-server, its EXPIRE once a second (40 ms steps)
    assert base <= per_rank < base + 1.5, per_rank
    small = load.model(load.Workload(ranks=16, api_servers=16, step_s=0.04, running=32, output_tokens=256))
    assert m["scheduler"]["bytes_in_per_step"] > 10 * small["scheduler"]["bytes_in_per_step"]
    assert m["engine-worker"]["cmds_per_s"] == m["engine-worker"]["cmds_per_step"] / 0.04
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "redis-load"), "--ranks", "32", "--api-servers", "4"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert all(svc in out.stdout for svc in ("engine-worker", "scheduler", "api-server", "total"))
