"""compose.yaml is a valid Compose file with the services the docs promise.

Validated without a daemon or a compose CLI: against the compose-spec JSON schema
(vendored in deploy/schemas/compose/, see the README there), as written and after
interpolating .env.example the way Compose does; each service's command line is run with
`--help` (the Redis one is started with its options). `docker compose config` validates it
too where the docker CLI with the compose plugin exists."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from shared.redis_server import find_server_binary, free_port
from tests.conftest import ROOT

COMPOSE = ROOT / "compose.yaml"
SCHEMA = ROOT / "deploy" / "schemas" / "compose" / "compose-spec.json"
LOCKSTEP_IMAGE = "lockstep:latest"


def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        try:
            ok = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_validates(tmp_path):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker CLI with the compose plugin (nor docker-compose) on this machine")
    env_file = tmp_path / "example.env"
    env_file.write_text((ROOT / ".env.example").read_text())
    res = subprocess.run([*cli, "-f", str(COMPOSE), "--env-file", str(env_file), "config", "--quiet"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_compose_structure():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(COMPOSE.read_text())
    svc = doc["services"]
    assert {"redis", "init", "scheduler", "engine-worker", "api-server", "api"} <= set(svc)
    assert str(svc["engine-worker"]["deploy"]["replicas"]).endswith(":-4}")
    assert str(svc["api-server"]["deploy"]["replicas"]).endswith(":-2}")
    assert svc["engine-worker"]["environment"]["LOCKSTEP_RANK"] == "-1"
    assert svc["engine-spare"]["environment"]["LOCKSTEP_SPARE"] == "1"
    assert str(svc["engine-spare"]["deploy"]["replicas"]).endswith(":-1}")
    assert [p for p in svc["api"]["ports"] if p.endswith(":8000")], "one published API port"
    for name in ("redis", "scheduler", "engine-worker", "engine-spare", "api-server", "api"):
        assert "healthcheck" in svc[name], name
        assert svc[name]["restart"] == "unless-stopped", name
    assert svc["init"]["restart"] == "no" and svc["init"]["command"] == ["init"]
    assert svc["scheduler"]["depends_on"]["init"]["condition"] == "service_completed_successfully"
    for name in ("scheduler", "engine-worker", "engine-spare", "api-server"):
        env = svc[name]["environment"]
        assert all(k.startswith("LOCKSTEP_") for k in env), name
        assert env["LOCKSTEP_REDIS_URL"].startswith("${LOCKSTEP_REDIS_URL")
    assert (ROOT / "deploy" / "nginx.conf").exists() and (ROOT / "Dockerfile").exists()


def test_env_example_names_real_settings():
    from shared.settings import ALL_SETTINGS, ENV_PREFIX

    known = {ENV_PREFIX + f.upper() for cls in ALL_SETTINGS for f in cls.model_fields}
    compose_only = {"LOCKSTEP_PUBLISHED_PORT"}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.startswith("LOCKSTEP_"):
            name = line.split("=", 1)[0]
            assert name in known | compose_only, f".env.example sets {name}, which no service reads"


def test_healthcheck_module_reports_unreachable_redis(monkeypatch, capsys):
    from services.admin import healthcheck

    monkeypatch.setenv("LOCKSTEP_REDIS_URL", "redis://127.0.0.1:1/0")
    assert healthcheck.main(["healthcheck", "scheduler"]) == 1
    assert "unhealthy" in capsys.readouterr().err


def _interpolate(value, env: dict[str, str]):
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, $$."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")
    return re.sub(r"\$\$|\$\{(\w+)(?:(:?-)([^}]*))?\}", sub, value)


def _env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))


def test_compose_file_matches_the_compose_spec_schema():
    yaml = pytest.importorskip("yaml")
    validator = _validator()
    raw = yaml.safe_load(COMPOSE.read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(raw)]
    assert not errors, errors
    for env in ({}, _env_example()):
        doc = _interpolate(raw, env)
        errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, (env, errors)
    # The schema is in force: what Compose refuses, it refuses too.
    bad = _interpolate(raw, {})
    bad["services"]["scheduler"]["restart_policy"] = "always"       # not a service key
    bad["services"]["api"]["depends_on"]["api-server"]["condition"] = "service_ready"   # not a condition
    assert len(list(validator.iter_errors(bad))) >= 2


def test_each_lockstep_service_command_runs_with_help():
    """Each container of the lockstep image runs `lockstep <command>` (Dockerfile
    ENTRYPOINT): the same command line with --help must parse and print its usage."""
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ours = {name: svc for name, svc in services.items() if svc.get("image") == LOCKSTEP_IMAGE}
    assert {"init", "scheduler", "engine-worker", "engine-spare", "api-server"} <= set(ours)
    assert 'exec lockstep' in (ROOT / "Dockerfile").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    for name, svc in ours.items():
        res = subprocess.run([sys.executable, "-m", "services.admin.cli", *svc["command"], "--help"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert res.returncode == 0, (name, res.stderr[-2000:])
        assert "Usage:" in res.stdout and svc["command"][-1] in res.stdout, (name, res.stdout[:500])
        test = svc.get("healthcheck", {}).get("test", [])
        if test[1:4] == ["python", "-m", "services.admin.healthcheck"]:
            assert test[4] in ("scheduler", "engine", "api"), (name, test)


def test_redis_service_command_starts_a_server(tmp_path):
    """The redis container's command line, run by the server binary found here, starts and
    answers (its options parse), on a private port and directory."""
    yaml = pytest.importorskip("yaml")
    cmd = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]["command"]
    assert cmd[0] == "redis-server"
    port = free_port()
    proc = subprocess.Popen([find_server_binary(), *cmd[1:], "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import redis
        client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                assert client.config_get("appendonly") == {"appendonly": "yes"}
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.05)
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)
