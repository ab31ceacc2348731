"""The api-server's admission bounds (services/api_server/admission.py), pure parts: the
live 429 is tests/test_faults.py::test_queue_wait_bound_answers_429_with_retry_after_and_loses_nothing."""

import time
from types import SimpleNamespace

import pytest

from services.api_server.admission import admit, retry_after_s
from services.api_server.errors import ApiError
from services.api_server.gateway import QUEUE_VIEW_FRESH_S, queue_wait_s, rate_or_zero
from services.api_server.recent_admissions import RecentAdmissions, bucket_of
from services.scheduler.queue_eta import (QueueEta, RanksQueueEta, full_step_prefill_tps, full_step_seq_rps, queue_eta_ms,
                                         queue_wait_ms)
from shared.policy.base import RequestInfo
from shared.policy.registry import make_policy
from shared.stats import RankStats, Snapshot


def _gw(wait, inflight=0, down_s=0.0, live=0, tps=0.0):
    return SimpleNamespace(queue_wait_s=wait, channels=dict.fromkeys(range(inflight)), keys=SimpleNamespace(ns="ls"),
                           down_for=lambda now: down_s, ranks_live=live, num_ranks=4, prefill_tps=tps, seq_rps=0.0,
                           admitted=RecentAdmissions(QUEUE_VIEW_FRESH_S))


def _settings(bound=10.0, inflight=100, down=30.0):
    return SimpleNamespace(max_queue_wait_s=bound, max_inflight=inflight, engine_down_timeout_s=down)


def test_a_queue_older_than_the_bound_is_refused_with_the_excess_as_retry_after():
    admit(_gw(9.5), _settings())                       # under the bound: admitted
    with pytest.raises(ApiError) as e:
        admit(_gw(13.2), _settings())
    assert e.value.status == 429 and e.value.code == "overloaded"
    assert "max_queue_wait_s" in e.value.message and e.value.headers == {"Retry-After": "4"}
    admit(_gw(500.0), _settings(bound=0))             # 0: the bound is off
    admit(_gw(None), _settings())                      # no fresh figure: only the in-flight bound


def test_the_in_flight_bound_counts_every_choice_of_a_request():
    admit(_gw(0.0, inflight=98), _settings(), need=2)
    with pytest.raises(ApiError) as e:
        admit(_gw(0.0, inflight=98), _settings(), need=3)
    assert "needs 3 of 100" in e.value.message and e.value.headers == {"Retry-After": "1"}
    # more slots than the bound: no retry could ever be admitted, so a 400, not a 429
    with pytest.raises(ApiError) as e:
        admit(_gw(0.0), _settings(), need=101)
    assert e.value.status == 400 and e.value.param == "n" and "max_inflight (100)" in e.value.message


def test_a_timeout_has_a_code():
    from services.api_server.admission import ran_out
    reason, err = ran_out(SimpleNamespace(closing=False), 15.0)
    assert reason == "timeout" and err.status == 504 and err.code == "request_timeout"


def test_a_group_short_of_a_rank_for_longer_than_the_timeout_is_a_503_that_says_so():
    admit(_gw(0.0, down_s=29.0), _settings())          # a rank may be restarting: wait for it
    with pytest.raises(ApiError) as e:
        admit(_gw(0.0, down_s=31.0), _settings())
    assert e.value.status == 503 and e.value.code == "engine_unavailable"
    assert "no engine rank of cluster 'ls' has been live for 31 s" in e.value.message
    assert "lockstep status" in e.value.message and e.value.headers == {"Retry-After": "5"}
    with pytest.raises(ApiError) as e:
        admit(_gw(0.0, down_s=31.0, live=3), _settings())
    assert "only 3 of the 4 engine ranks" in e.value.message and "steps only with all of them" in e.value.message
    admit(_gw(0.0, down_s=1e6), _settings(down=0))    # 0: wait however long


def test_retry_after_is_whole_seconds_between_one_and_a_minute():
    assert [retry_after_s(w, 10.0) for w in (10.01, 10.5, 12.0, 12.1, 1000.0)] == [1, 1, 2, 3, 60]


def test_a_stale_or_missing_queue_figure_is_no_figure():
    assert queue_wait_s(b"2500", b"100.0", 100.0 + QUEUE_VIEW_FRESH_S) == 2.5
    assert queue_wait_s(b"2500", b"100.0", 100.1 + QUEUE_VIEW_FRESH_S) is None
    assert queue_wait_s(None, None, 100.0) is None and queue_wait_s(b"x", b"1", 1.0) is None


def test_the_scheduler_publishes_how_long_its_oldest_unplaced_request_has_waited():
    p = make_policy("waterfill", ranks=[0], level_tokens=100, max_hold_s=60.0)
    ranks = {0: RankStats(0, 0, 1, prefill_pending=5000)}
    p.on_snapshot(Snapshot(0, 1, 0.0, ranks, seq=1))   # above the level: requests stay unplaced
    assert queue_wait_ms(p, 10.0) == 0
    assert p.submit(RequestInfo("a", 100, 16, 3.0), 3.0) == [] and p.submit(RequestInfo("b", 100, 16, 4.0), 4.0) == []
    assert queue_wait_ms(p, 10.0) == 7000              # the oldest, not the newest
    assert queue_wait_ms(make_policy("least_score", ranks=[0]), 10.0) == 0   # places at once: no queue


def test_the_bound_reads_a_new_requests_expected_wait_not_the_heads_past_one():
    # 30 ahead, the ranks taking 2 a second: a new request waits ~15 s, though the oldest has
    # waited only 1 s (admission used that, so it refused too late, then until the queue was empty)
    assert queue_eta_ms(30, 2.0, 1000) == 15000
    assert queue_eta_ms(2, 20.0, 9000) == 100        # the head waited long, but the queue is nearly gone
    assert queue_eta_ms(0, 0.0, 0) == 0
    assert queue_eta_ms(5, 0.0, 4000) == 4000        # nothing placed lately: the head's wait
    assert queue_eta_ms(5, 1e-6, 300) == 300          # a rate decayed from long ago is no rate (it read 5e6 s)
    with pytest.raises(ApiError):
        admit(_gw(queue_wait_s(str(queue_eta_ms(30, 2.0, 1000)).encode(), b"100.0", 100.0)), _settings())


def test_a_burst_after_a_quiet_spell_is_not_measured_by_the_quiet_spells_rate():
    # with headroom the ranks take requests as they arrive (2/s here), however fast they could;
    # a burst of 300 then read an ETA of 300 / 2 = 150 s and new requests were refused with a
    # 429 while the ranks drained it in seconds (live, 8 sim ranks at 1.2x: 41-57 s published
    # while the oldest had waited 1-4 s; the old meter reads 173 s here)
    eta, placed, t = QueueEta(window_s=5.0), 0, 0.0
    while t < 10.0:                                   # 10 s of headroom: each request placed as it comes
        placed += 1
        eta.observe(placed, 0, t)
        t += 0.5
    eta.observe(placed, 300, 10.0)                   # the burst: 300 wait
    assert eta.eta_ms(300, 400, 10.4) == 400         # a backlog younger than the window: the head's wait
    for i in range(1, 51):                           # the ranks take 20 a second while it lasts
        placed += 2
        eta.observe(placed, 300 - 2 * i, 10.0 + 0.1 * i)
    assert eta.eta_ms(200, 5000, 15.0) == pytest.approx(200 / 20 * 1000, rel=0.05)   # backlogged: the ranks' rate
    eta.observe(placed, 0, 15.1)                     # drained: the next backlog measures afresh
    eta.observe(placed + 5, 40, 15.2)
    assert eta.eta_ms(40, 100, 16.0) == 100


def test_a_burst_placed_longest_first_is_measured_in_prompt_tokens():
    # a burst of 20 prompts of 8,000 tokens and 200 of 200, placed longest first, on ranks
    # that take 20,000 prompt tokens a second: all gone in 10 s. Its first 5 s place only
    # the 12 long ones, 2.4 requests/s, so in requests the 208 left read 87 s
    tokens, requests = QueueEta(window_s=5.0), QueueEta(window_s=5.0)
    placed_tokens, placed_requests, left = 0, 0, [8000] * 20 + [200] * 200
    tokens.observe(0, sum(left), 0.0)
    requests.observe(0, len(left), 0.0)
    budget = 0.0
    for k in range(1, 51):                              # 5 s: the backlog has lasted the window
        t = k / 10
        budget += 2000.0                                # 0.1 s of the ranks' 20,000 tokens/s
        while left and left[0] <= budget:
            budget -= left[0]
            placed_tokens += left.pop(0)
            placed_requests += 1
        tokens.observe(placed_tokens, sum(left), t)
        requests.observe(placed_requests, len(left), t)
    true_s = sum(left) / 20_000
    assert tokens.eta_ms(sum(left), 1, t) == pytest.approx(true_s * 1000, rel=0.3)   # 1: not the head's wait
    assert requests.eta_ms(len(left), 1, t) > 60_000     # counted in requests: refused at 60 s


def test_a_backlog_the_ranks_do_not_drain_is_refused_once_it_has_lasted_the_window():
    eta = QueueEta(window_s=5.0)
    for i in range(61):                              # 0.5 placements/s against 30 waiting, for 6 s
        eta.observe(i // 20, 30, 0.1 * i)
    assert eta.eta_ms(30, 6000, 6.0) > 40_000          # ~60 s: 30 ahead at 0.5 a second
    with pytest.raises(ApiError):
        admit(_gw(queue_wait_s(str(eta.eta_ms(30, 6000, 6.0)).encode(), b"6.0", 6.0)), _settings())


def test_hints_name_the_clusters_namespace():
    # (a cluster in -n prod answered "`lockstep status` shows them": that shows the default cluster)
    from services.api_server.gateway import engine_down_message
    from shared.keys import admin_command
    assert admin_command("status", "ls") == "lockstep status"
    assert admin_command("resume", "prod") == "lockstep resume -n prod"
    assert admin_command("resume", "prod", "redis://:s3cret@db:6379/2") == \
        "lockstep resume -n prod --redis-url 'redis://:***@db:6379/2'"
    # a URL's query pasted unquoted would run in the background (&) or glob (?)
    assert admin_command("status", "p", "rediss://h:6380/0?a=1&b=2").endswith("--redis-url 'rediss://h:6380/0?a=1&b=2'")
    assert "`lockstep status -n prod` shows them" in engine_down_message(0, 4, 31.0, "prod")


def test_the_ranks_own_queues_count_where_requests_are_placed_at_once():
    # client dispatch (or least_score): 2 ranks each computing 1,000 prompt tokens a step of
    # 0.1 s while requests queue there; the scheduler's own queue is empty, so the bound
    # never refused and TTFT grew with the ranks' queues
    eta, t, pending = RanksQueueEta(window_s=5.0), 0.0, 60_000
    for step in range(1, 61):
        t = step * 0.1
        pending += 1_500                              # arrivals outrun the ranks
        ranks = {r: RankStats(r, 0, step, waiting=40, prefill=1_000, prefill_pending=pending // 2) for r in (0, 1)}
        ms = eta.update([Snapshot(0, step, t, ranks, seq=step)], t)
    assert ms == pytest.approx(pending / 20_000 * 1000, rel=0.05)   # the ranks take 20,000 tokens/s
    idle = {r: RankStats(r, 0, 61, waiting=0, prefill=500, prefill_pending=500) for r in (0, 1)}
    assert eta.update([Snapshot(0, 61, t + 0.1, idle, seq=61)], t + 0.1) == 0   # nothing queued: no wait


def test_a_carried_rank_row_is_not_counted_twice():
    eta = RanksQueueEta(window_s=1.0)
    for step in range(1, 21):                         # rank 1's report is carried: an old row again
        ranks = {0: RankStats(0, 0, step, waiting=5, prefill=1_000, prefill_pending=10_000),
                 1: RankStats(1, 0, 1, waiting=5, prefill=1_000, prefill_pending=10_000)}
        ms = eta.update([Snapshot(0, step, step * 0.1, ranks, carried=(1,) if step > 1 else (), seq=step)],
                        step * 0.1)
    assert ms == pytest.approx(20_000 / 10_000 * 1000, rel=0.1)    # 10,000 tokens/s, not 20,000


def test_a_young_backlog_waits_at_least_its_tokens_over_the_ranks_full_step_rate():
    # a burst of 8,000 requests of 430 prompt tokens on ranks that prefill 6,800 tokens/s at
    # most: about 500 s of work. A backlog younger than the window read the head's wait (a
    # second or two), so the whole burst was admitted behind a 60 s bound (live, 4 torch
    # ranks on CPU: 8,192 admitted, the rest refused only by max_inflight)
    eta = QueueEta(window_s=5.0)
    eta.observe(0, 8_000 * 430, 0.0)
    assert eta.eta_ms(8_000 * 430, 1_500, 1.5) == 1_500                      # no rate known: the head's wait
    assert eta.eta_ms(8_000 * 430, 1_500, 1.5, 6_800.0) == pytest.approx(8_000 * 430 / 6.8, rel=1e-3)
    assert eta.eta_ms(6_800, 1_500, 1.5, 6_800.0) == 1_500                   # 1 s of work: the head's wait is more
    ranks = RanksQueueEta(window_s=5.0)                                      # the ranks' own queues alike
    snap = Snapshot(0, 1, 0.1, {r: RankStats(r, 0, 1, waiting=500, prefill_pending=170_000) for r in (0, 1)})
    assert ranks.update([snap], 0.1) == 0
    assert ranks.update([snap], 0.2, 6_800.0) == pytest.approx(340_000 / 6.8, rel=1e-3)


def test_the_full_step_rate_is_the_ranks_reports_summed():
    def snap(*tps):
        return Snapshot(0, 1, 0.0, {r: RankStats(r, 0, 1, extra={} if v is None else {"prefill_tps": v})
                                    for r, v in enumerate(tps)})
    assert full_step_prefill_tps(snap(1_000, 3_000)) == 4_000
    assert full_step_prefill_tps(snap(1_000, 3_000, None, None)) == 8_000   # not measured yet: the others' mean
    assert full_step_prefill_tps(snap(None, None)) is None                 # none measured: no figure, not 0
    assert full_step_prefill_tps(snap(0, "x")) is None and full_step_prefill_tps(None) is None


def test_what_a_replica_admitted_since_the_last_figure_counts_toward_the_bound():
    # the figure is read once a second; a burst inside that second was admitted whole
    gw = _gw(1.0, tps=1_000.0)
    for _ in range(9):                       # 1 s + 9 x 1,000 tokens at 1,000 tokens/s = 10 s
        admit(gw, _settings(bound=10.0), tokens=1_000)
    admit(gw, _settings(bound=10.0), tokens=1_000)   # 10 s: still at the bound
    with pytest.raises(ApiError) as e:
        admit(gw, _settings(bound=10.0), tokens=1_000)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    gw.admitted.measured(time.time())        # a figure measured after them: they are in it now
    assert gw.admitted.tokens == 0
    admit(gw, _settings(bound=10.0), tokens=1_000)
    admit(_gw(1.0), _settings(bound=10.0), tokens=10**9)   # no rate known: the figure alone
    idle = _gw(None, tps=1_000.0)            # an idle group publishes no figure: what came since is the wait
    admit(idle, _settings(bound=10.0), tokens=10_500)
    with pytest.raises(ApiError):
        admit(idle, _settings(bound=10.0), tokens=1)
    admit(_gw(None), _settings(bound=10.0), tokens=10**9)  # neither known: the in-flight bound alone


def test_recent_admissions_keep_only_what_a_fresh_figure_could_miss():
    recent = RecentAdmissions(horizon_s=5.0)
    recent.add(100, 10.0)
    recent.add(200, 11.0)
    recent.measured(10.5)
    assert recent.tokens == 200
    recent.add(50, 20.0)                     # 11.0 is older than the horizon: no figure misses it
    assert recent.tokens == 50


def test_a_malformed_rate_is_no_rate():
    assert rate_or_zero(b"2012") == 2012.0
    assert rate_or_zero(None) == rate_or_zero(b"x") == rate_or_zero(b"nan") == rate_or_zero(b"-5") == 0.0


def test_every_replicas_admissions_count_toward_the_bound():
    # two replicas, each counting only its own, admitted a burst split between them twice
    # over; the Redis counter's reply says what all of them admitted
    recent = RecentAdmissions(horizon_s=5.0)
    recent.measured(100.0)
    recent.add(1_000, 100.1)
    sending = recent.take_unsent()
    assert sending == (1_000, 1) and recent.tokens == 1_000 and recent.requests == 1   # in flight: still counted
    recent.sent(sending, bucket_of(100.1), (5_000, 4))            # the others admitted 4,000 in that bucket
    assert recent.tokens == 5_000 and recent.requests == 4
    recent.group_read({bucket_of(100.6): (3_000, 3), bucket_of(100.1): (4_500, 3)}, 100.7)   # never lowers one
    assert recent.tokens == 8_000 and recent.requests == 7
    recent.add(500, 100.8, requests=2)                             # not yet sent: on top of the group's
    assert recent.tokens == 8_500 and recent.requests == 9
    recent.measured(100.6)                                         # a figure from 100.6 holds the older bucket
    assert recent.tokens == 3_500 and recent.requests == 5
    recent.sent(recent.take_unsent())                              # a failed add: nothing learnt, nothing lost
    assert recent.tokens == 3_000 and recent.requests == 3
    recent.group_read({bucket_of(99.0): (10**6, 10)}, 100.9)       # older than the last figure: in it already
    assert recent.tokens == 3_000
    recent.add(1, 200.0)                                           # long after: no figure misses any of it
    assert recent.tokens == 1 and recent.requests == 1


def test_requests_admitted_since_count_at_the_rate_the_slots_free():
    # short prompts wait for a sequence slot, not for prompt tokens: 10,000 chat requests at
    # once on 4 sim ranks, 2,848 admitted behind a 10 s bound (10 s of prompt tokens) waited
    # 17 / 28 s (p50 / p90) for their first token
    gw = _gw(0.0, tps=60_000.0)
    gw.seq_rps = 100.0                                             # 100 requests/s free a slot
    for _ in range(1_001):                                         # 200 tokens each: 3.3 s of prompt tokens,
        admit(gw, _settings(bound=10.0, inflight=5_000), tokens=200)   # 10 s of slots (the last at the bound)
    with pytest.raises(ApiError) as e:
        admit(gw, _settings(bound=10.0, inflight=5_000), tokens=200)
    assert e.value.status == 429
    gw = _gw(0.0, tps=0.0)
    gw.seq_rps = 100.0                                             # the slots' rate alone is a rate too
    for _ in range(1_001):
        admit(gw, _settings(bound=10.0, inflight=5_000), tokens=10**6)
    with pytest.raises(ApiError):
        admit(gw, _settings(bound=10.0, inflight=5_000))


def test_a_queue_of_short_prompts_waits_at_least_its_requests_over_the_slots_rate():
    # 2,000 requests of 200 tokens: 6.7 s of prompt tokens at 60,000 tokens/s, but 20 s of
    # slots at 100 requests/s
    eta = QueueEta(window_s=5.0)
    eta.observe(0, 400_000, 0.0)
    assert eta.eta_ms(400_000, 0, 0.5, 60_000.0) == pytest.approx(6_667, abs=1)
    assert eta.eta_ms(400_000, 0, 0.5, 60_000.0, 2_000, 100.0) == 20_000
    ranks = RanksQueueEta(window_s=5.0)                      # the ranks' own queues alike
    snap = Snapshot(0, 1, 0.1, {r: RankStats(r, 0, 1, waiting=1_000, prefill_pending=200_000) for r in (0, 1)})
    assert ranks.update([snap], 0.1) == 0
    assert ranks.update([snap], 0.2, 60_000.0, 100.0) == 20_000


def test_the_slots_rate_is_the_ranks_reports_summed():
    snap = Snapshot(0, 1, 0.0, {r: RankStats(r, 0, 1, extra={"seq_rps": v} if v else {})
                                for r, v in enumerate((30.0, None))})
    assert full_step_seq_rps(snap) == 60.0


def test_the_other_replicas_are_taken_to_admit_as_much_until_their_count_is_read():
    # a burst reaches every replica at once, before any reply: 3,000 requests on 2 replicas,
    # each admitted 1,500, twice the bound's worth, with its own count alone
    recent = RecentAdmissions(horizon_s=5.0, replicas=2)
    recent.measured(100.0)
    for _ in range(10):
        recent.add(100, 100.1)
    assert recent.tokens == 2_000 and recent.requests == 20
    sending = recent.take_unsent()
    recent.sent(sending, bucket_of(100.1), (1_000, 10))          # the reply: the other admitted none
    assert recent.tokens == 1_000 and recent.requests == 10
