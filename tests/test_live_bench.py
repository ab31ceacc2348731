"""scripts/bench-live's report: the table and the run-by-run verdict (pure parts)."""

from services.admin.live_bench import failures, table, verdict


def _run(tok_s, ttft99):
    return {"throughput_tok_s": tok_s, "ttft_p50_ms": 10.0, "ttft_p99_ms": ttft99, "itl_p50_ms": 5.0,
            "itl_p99_ms": 9.0, "balance_ratio": 0.8, "idle_forward_fraction": 0.1, "completed": 4, "failed": 0}


def test_verdict_compares_run_i_with_run_i_on_both_measures():
    doc = {"runs": {"default": [_run(110, 900), _run(90, 800), _run(120, None)],
                    "least_score": [_run(100, 1000), _run(100, 1000), _run(100, 1000)]}}
    lines = verdict(doc)
    assert lines[0] == "run 1: throughput beats least_score, TTFT p99 beats least_score"
    assert lines[1] == "run 2: throughput does NOT beat least_score, TTFT p99 beats least_score"
    assert lines[2] == "run 3: throughput beats least_score, TTFT p99 does NOT beat least_score"   # no data: not a win


def test_table_shows_the_median_and_every_run():
    doc = {"runs": {"default": [_run(110, 900), _run(90, 800), _run(120, 700)]}}
    row = table(doc).splitlines()[2]
    assert row.startswith("| default | 110 | 10 | 800 |")
    assert row.endswith("| 110, 900 / 90, 800 / 120, 700 |")


def test_a_run_with_failed_requests_is_named_with_why():
    bad = {**_run(110, 900), "completed": 596, "failed": 4, "rejected": 3, "errors": ["HTTP 429", "timeout"]}
    doc = {"runs": {"default": [_run(110, 900), bad], "least_score": [_run(100, 1000)] * 2}}
    assert failures(doc) == ["default run 2: 4 of 600 requests failed (3 refused with a 429; errors: HTTP 429; timeout)"]
    old = {**_run(110, 900), "failed": 2}          # a file from before rejected/errors were kept
    assert failures({"runs": {"default": [old]}}) == [
        "default run 1: 2 of 6 requests failed (0 refused with a 429; errors: not recorded)"]
