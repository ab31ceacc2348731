"""compose.yaml is a valid Compose file with the services the docs promise.

`docker compose config` (it needs the docker CLI with the compose plugin, not a running
engine) validates it when available; the structural checks run wherever PyYAML is."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT

COMPOSE = ROOT / "compose.yaml"


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
    import dataclasses

    from shared.settings import ALL_SETTINGS, ENV_PREFIX

    known = {ENV_PREFIX + f.name.upper() for cls in ALL_SETTINGS for f in dataclasses.fields(cls)}
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
