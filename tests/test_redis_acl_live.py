"""A cluster on a Redis whose user may touch only its namespace's keys and channels and no
@dangerous command (CONFIG, KEYS, FLUSHALL, DEBUG, INFO...: what managed Redis services and
careful operators withhold) serves requests and replaces a dead rank: the ACL that
docs/operations.md documents is enough. Real Redis, real processes."""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest
import redis

from shared.redis_server import EmbeddedRedis
from tests.conftest import start_cluster
from tests.helpers import poll_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NS = "acl"


def test_a_namespace_scoped_acl_without_dangerous_commands_is_enough(tmp_path):
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "lockstep", "on", ">s3cret", f"~{NS}:*", "~{" + NS + "}:*",
                              f"&{NS}:*", "+@all", "-@dangerous")
        url = server.url.replace("redis://", "redis://lockstep:s3cret@")
        cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "sim",
                                "--spares", "1", "--redis-url", url, namespace=NS)
        try:
            client = openai.OpenAI(base_url=cluster.api_url, api_key="x", max_retries=0, timeout=60)
            assert client.completions.create(model="lockstep-moe", prompt="hi", max_tokens=5).usage.completion_tokens == 5

            def status() -> dict:
                out = cluster.cli("status", "--json", "--redis-url", url)
                assert out.returncode == 0, out.stderr
                return json.loads(out.stdout)

            victim = status()["ranks"][0]["pid"]
            os.kill(victim, signal.SIGKILL)      # the spare's take-over scans and claims under the ACL too
            poll_until(lambda: status()["ranks"][0]["pid"] not in (victim, None), 60, "a spare takes rank 0")
            for i in range(4):
                out = client.completions.create(model="lockstep-moe", prompt=f"after {i}", max_tokens=5)
                assert out.usage.completion_tokens == 5
            assert admin.acl_log() == [], admin.acl_log()   # nothing was refused on the way
        finally:
            cluster.stop()
            admin.close()
