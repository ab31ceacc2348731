"""Service settings (shared/settings.py): LOCKSTEP_* values are parsed strictly, a bad one
stops the service at start with a message naming the variable and what it may be."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import (ApiServerSettings, EngineSettings, SchedulerSettings, SettingsError)

ROOT = Path(__file__).resolve().parent.parent


def test_env_values_are_parsed_to_their_types():
    s = EngineSettings.from_env({"LOCKSTEP_RANKS": "8", "LOCKSTEP_TIME_SCALE": "0.5", "LOCKSTEP_SPARE": "yes",
                                 "LOCKSTEP_ALIGN_TOKENS": "false", "LOCKSTEP_NAMESPACE": "x"})
    assert (s.ranks, s.time_scale, s.spare, s.align_tokens, s.namespace) == (8, 0.5, True, False, "x")
    assert EngineSettings.from_env({"LOCKSTEP_SPARE": "1", "LOCKSTEP_ALIGN_TOKENS": "0"}).spare is True
    assert ApiServerSettings.from_env({"LOCKSTEP_API_KEYS": "sk-a, sk-b,"}).api_keys == ["sk-a", "sk-b"]
    assert ApiServerSettings.from_env({"LOCKSTEP_API_KEYS": ""}).api_keys == []


@pytest.mark.parametrize("var,raw,allowed", [
    ("LOCKSTEP_RANKS", "abc", "whole number"),
    ("LOCKSTEP_SPARE", "2", "true/false"),      # the old parser read "2" as False
    ("LOCKSTEP_ALIGN_TOKENS", "maybe", "true/false"),
    ("LOCKSTEP_TIME_SCALE", "fast", "a number"),
])
def test_bad_env_value_names_the_variable_and_what_it_may_be(var, raw, allowed):
    with pytest.raises(SettingsError) as err:
        EngineSettings.from_env({var: raw})
    msg = str(err.value)
    assert f"{var}={raw!r}" in msg and allowed in msg, msg


def test_every_bad_variable_is_named_at_once():
    with pytest.raises(SettingsError) as err:
        EngineSettings.from_env({"LOCKSTEP_RANKS": "", "LOCKSTEP_SPARE": "2"})
    assert "LOCKSTEP_RANKS=''" in str(err.value) and "LOCKSTEP_SPARE='2'" in str(err.value)


def test_override_beats_env_and_unset_override_does_not():
    assert SchedulerSettings.from_env({"LOCKSTEP_RANKS": "abc"}, ranks=3).ranks == 3
    assert SchedulerSettings.from_env({"LOCKSTEP_RANKS": "5"}, ranks=None).ranks == 5


def test_construction_reads_only_its_arguments(monkeypatch):
    # Tests and the simulator build settings in-process: the process env must not leak in.
    monkeypatch.setenv("LOCKSTEP_RANKS", "7")
    assert EngineSettings().ranks == 4
    assert EngineSettings.from_env().ranks == 7


def test_unknown_field_and_unservable_combination_are_refused():
    with pytest.raises(SettingsError, match="rnaks"):
        EngineSettings(rnaks=2)
    with pytest.raises(SettingsError, match="needs dispatch 'scheduler'"):
        SchedulerSettings.from_env({"LOCKSTEP_POLICY": "staggered", "LOCKSTEP_DISPATCH": "client"})
    with pytest.raises(SettingsError, match="unknown policy 'nope'"):
        ApiServerSettings(dispatch="client", policy="nope")


def test_to_dict_redacts_secrets():
    d = ApiServerSettings(redis_url="redis://u:pw@h:1", api_keys=["sk-1"]).to_dict()
    assert "pw" not in d["redis_url"] and d["api_keys"] == ["***"]


def test_service_with_a_bad_variable_stops_at_start_with_the_message():
    env = {**os.environ, "LOCKSTEP_REDIS_URL": "redis://127.0.0.1:1", "LOCKSTEP_RANKS": "abc"}
    p = subprocess.run([sys.executable, "-m", "services.admin.cli", "scheduler"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=ROOT)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "LOCKSTEP_RANKS='abc'" in p.stderr and "whole number" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_renamed_setting_is_still_read_under_its_old_name(monkeypatch):
    # align_max_hold_steps became align_max_capped_steps (issue #17: "held" names the batch
    # gate only); a deployment that sets the old variable or flag keeps its value.
    from services.admin.cli import _settings
    from services.admin.config_cmd import effective_config

    assert EngineSettings.from_env({"LOCKSTEP_ALIGN_MAX_HOLD_STEPS": "8"}).align_max_capped_steps == 8
    assert EngineSettings.from_env({"LOCKSTEP_ALIGN_MAX_CAPPED_STEPS": "9",
                                    "LOCKSTEP_ALIGN_MAX_HOLD_STEPS": "8"}).align_max_capped_steps == 9
    assert EngineSettings(align_max_hold_steps=7).align_max_capped_steps == 7
    assert "align_max_hold_steps" not in EngineSettings().to_dict()
    monkeypatch.setenv("LOCKSTEP_REDIS_URL", "redis://127.0.0.1:1")
    assert _settings(EngineSettings, ["align_max_hold_steps=5"]).align_max_capped_steps == 5
    shown = effective_config({"LOCKSTEP_ALIGN_MAX_HOLD_STEPS": "6"}, {}, "ls", None)["engine-worker"]
    assert shown["align_max_capped_steps"] == {"value": 6, "source": "env"}


def test_the_waits_share_spans_must_be_ordered_and_every_accepted_one_builds_a_budget():
    from services.engine_worker.step_budget import from_settings
    with pytest.raises(SettingsError, match="align_grow_share_full"):
        EngineSettings(align_grow_share=2.0, align_grow_share_full=1.0)
    with pytest.raises(SettingsError, match="align_lone_share_full"):
        EngineSettings(align_lone_share=0.5, align_lone_share_full=0.3)
    for grow, full in ((1.0, 0.0), (0.0, 0.0), (1.5, 1.5), (1.0, 2.0)):   # 0: the whole growth, always
        cfg = from_settings(EngineSettings(align_grow_share=grow, align_grow_share_full=full))
        assert (cfg.grow_share, cfg.grow_share_full) == (grow, full)


def test_a_busy_level_set_in_full_steps_keeps_its_meaning_in_tokens():
    # align_busy_level (full steps) became align_busy_tokens; an old setting, as an argument
    # or a LOCKSTEP_* variable, is not dropped silently
    assert EngineSettings(align_busy_level=0.15, max_num_batched_tokens=4608).align_busy_tokens == pytest.approx(691.2)
    env = EngineSettings.from_env({"LOCKSTEP_ALIGN_BUSY_LEVEL": "0", "LOCKSTEP_MAX_NUM_BATCHED_TOKENS": "2048"})
    assert env.align_busy_tokens == 0.0            # "never busy" stays never busy
    assert EngineSettings(align_busy_level=0.5, align_busy_tokens=100.0).align_busy_tokens == 100.0
    assert EngineSettings().align_busy_tokens == 307.0


@pytest.mark.parametrize("cls,env,says", [
    # each started, then failed inside a child (a traceback), or served requests that could never run
    (EngineSettings, {"LOCKSTEP_BLOCK_SIZE": "0"}, "LOCKSTEP_BLOCK_SIZE='0'"),
    (EngineSettings, {"LOCKSTEP_MAX_NUM_BATCHED_TOKENS": "0"}, "LOCKSTEP_MAX_NUM_BATCHED_TOKENS"),
    (EngineSettings, {"LOCKSTEP_MAX_NUM_SEQS": "0"}, "LOCKSTEP_MAX_NUM_SEQS"),
    (EngineSettings, {"LOCKSTEP_HEARTBEAT_MS": "0"}, "LOCKSTEP_HEARTBEAT_MS"),
    (EngineSettings, {"LOCKSTEP_COLLECTIVE_TIMEOUT_S": "0"}, "LOCKSTEP_COLLECTIVE_TIMEOUT_S"),
    (ApiServerSettings, {"LOCKSTEP_MAX_INFLIGHT": "0"}, "LOCKSTEP_MAX_INFLIGHT"),
    (SchedulerSettings, {"LOCKSTEP_LEASE_MS": "0"}, "LOCKSTEP_LEASE_MS"),
    # a KV cache that cannot hold one whole request: every longer request failed, "retry it"
    (EngineSettings, {"LOCKSTEP_NUM_KV_BLOCKS": "4"}, "set LOCKSTEP_NUM_KV_BLOCKS to 256 or more"),
    # glob characters: `up` never saw its own spares (SCAN patterns) and waited for ever
    (EngineSettings, {"LOCKSTEP_NAMESPACE": "pf[1]"}, "must not contain [ ]"),
    (ApiServerSettings, {"LOCKSTEP_NAMESPACE": "a*"}, "must not contain *"),
    # braces: `up` said "starting..." and then failed on the key schema's refusal
    (SchedulerSettings, {"LOCKSTEP_NAMESPACE": "a{b}"}, "must not contain { }"),
])
def test_settings_no_service_can_run_with_are_refused_up_front(cls, env, says):
    with pytest.raises(SettingsError, match=re.escape(says)):
        cls.from_env(env)


def test_a_kv_cache_that_holds_one_whole_request_is_accepted():
    assert EngineSettings(num_kv_blocks=256, block_size=16, max_model_len=4096).num_kv_blocks == 256
    assert EngineSettings(namespace="team-a/prod:1").namespace == "team-a/prod:1"


def test_the_body_limit_follows_the_context_length():
    # A fixed 1 MiB refused a long-context checkpoint's whole prompt: 200k CJK characters
    # (about 130k tokens) are 1.2 MB as the openai client sends them (json.dumps: \\u-escaped).
    import json

    long_ctx = ApiServerSettings(max_model_len=131_072)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "漢" * 200_000}]}).encode()
    assert len(body) > 1 << 20 and len(body) <= long_ctx.body_limit
    ids = json.dumps({"model": "m", "prompt": [151_643] * 131_000}).encode()   # 8 bytes a token id
    assert len(ids) <= long_ctx.body_limit
    assert ApiServerSettings().body_limit == 1 << 20                     # a 4,096-token context: 1 MiB
    assert ApiServerSettings(max_body_bytes=5000, max_model_len=131_072).body_limit == 5000   # set: as set


def test_config_says_where_the_namespace_came_from():
    # (a namespace from LOCKSTEP_NAMESPACE was labelled "flag")
    from services.admin.config_cmd import effective_config

    def source(env, ns):
        return effective_config(env, {}, ns, None)["scheduler"]["namespace"]["source"]
    assert source({"LOCKSTEP_NAMESPACE": "mh"}, "mh") == "env"
    assert source({"LOCKSTEP_NAMESPACE": "mh"}, "other") == "flag"
    assert source({}, "other") == "flag"
    assert source({}, "ls") == "default"
