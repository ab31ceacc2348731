"""lockstep behind Redis Sentinel: a real primary, replica and sentinel started by the test
(the binary shared/redis_server.py finds). `lockstep up --redis-url redis+sentinel://...`
serves the openai client, and a failover mid-run (SENTINEL FAILOVER: the replica is
promoted, the old primary follows it) loses no request acknowledged to a client."""

from __future__ import annotations


import openai
import pytest

from shared.redis_url import SENTINEL, BadRedisUrl, parse
from shared.tokenizer import encode
from tests.conftest import start_cluster
from tests.helpers import sim_expected_text
from tests.redis_topology import MODEL, LocalSentinel, check_streams, stream_many, stream_through

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    g = LocalSentinel(tmp_path_factory.mktemp("sentinel")).start()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def up(group, tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("up"), "--ranks", "2", "--api-servers", "2",
                            "--backend", "sim", "--redis-url", group.url, namespace="lss")
    yield cluster
    cluster.stop()


def test_sentinel_url_serves_openai_requests(up):
    client = openai.OpenAI(base_url=up.api_url, api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt="via sentinel", max_tokens=12, seed=2,
                                  extra_body={"ignore_eos": True})
    client.close()
    assert r.choices[0].text == sim_expected_text(encode("via sentinel"), 12, seed=2)


def test_failover_mid_run_loses_no_acknowledged_request(up, group):
    n, tokens = 24, 120

    def failover() -> None:
        old = group.primary_port()
        assert group.failover() != old

    results = stream_through(up.api_url, n, tokens, "sf", failover)
    # Every stream was under way (acknowledged) when the primary changed: all complete,
    # each token exactly once.
    assert all(r.acked for r in results)
    check_streams(results, n, tokens, "sf")
    check_streams(stream_many(up.api_url, 8, 16, "after"), 8, 16, "after")
    assert up.proc.poll() is None


def test_sentinel_urls_parse():
    t = parse("redis+sentinel://u:p%40ss@10.0.0.1:26379,10.0.0.2/lsprimary/2")
    assert (t.kind, t.nodes, t.service, t.db) == (SENTINEL, (("10.0.0.1", 26379), ("10.0.0.2", 26379)), "lsprimary", 2)
    assert (t.username, t.password) == ("u", "p@ss")
    with pytest.raises(BadRedisUrl, match="names the service"):
        parse("redis+sentinel://127.0.0.1:26379")
    with pytest.raises(BadRedisUrl, match="unknown Redis URL scheme"):
        parse("redis+sentinal://127.0.0.1:26379/x")
