"""deploy/k8s/ holds valid Kubernetes manifests that fit together and run real commands.

Validated offline: every document against the Kubernetes JSON schemas of its kind
(strict: an unknown field is an error) shipped by the kubernetes-validate package, for
the oldest and the newest Kubernetes version we claim; then the cross-references a
schema cannot see (selectors, the Secret and ConfigMap the pods read, replicas that must
equal settings, commands that exist)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.30.0", "1.34.0")
NAME = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"


def _docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _one(kind: str, name: str) -> dict:
    found = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def test_every_manifest_matches_the_kubernetes_schema():
    docs = _docs()
    assert len(docs) >= 10
    for version in VERSIONS:
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): {exc.message}") from None


def test_the_validator_rejects_what_kubernetes_would():
    bad = copy.deepcopy(_one("StatefulSet", "lockstep-engine"))
    bad["spec"]["replicas"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = copy.deepcopy(_one("Deployment", "lockstep-api"))
    _containers(bad)[0]["envfrom"] = []          # a typo: strict schemas refuse unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_the_pieces_fit_together():
    config = _one("ConfigMap", "lockstep-config")["data"]
    secret = _one("Secret", "lockstep-redis")["stringData"]
    assert secret["LOCKSTEP_REDIS_URL"].startswith("redis://lockstep-redis:")
    _one("Service", "lockstep-redis")
    engine = _one("StatefulSet", "lockstep-engine")
    api = _one("Deployment", "lockstep-api")
    scheduler = _one("Deployment", "lockstep-scheduler")
    args = _containers(engine)[0]["args"]
    per_host = int(args[args.index("--ranks-per-host") + 1])
    assert engine["spec"]["replicas"] * per_host == int(config["LOCKSTEP_RANKS"]), "hosts x ranks per host"
    assert api["spec"]["replicas"] == int(config["LOCKSTEP_NUM_API_SERVERS"])
    assert scheduler["spec"]["replicas"] >= 2, "a standby scheduler"
    assert _one("StatefulSet", "lockstep-engine-spare")["spec"]["replicas"] >= 1
    service = _one("Service", "lockstep-api")
    assert service["spec"]["selector"] == api["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in _containers(api)[0]["ports"]}
    for doc in _docs():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            if doc["kind"] != "Job":
                assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), doc["metadata"]["name"]
            for c in _containers(doc):
                if c["image"].startswith("lockstep"):
                    refs = {next(iter(ref.values()))["name"] for ref in c["envFrom"]}
                    assert refs == {"lockstep-config", "lockstep-redis"}, doc["metadata"]["name"]
        if doc["kind"] == "PodDisruptionBudget":
            assert doc["spec"]["selector"]["matchLabels"] == scheduler["spec"]["selector"]["matchLabels"]
    env = {e["name"]: e for e in _containers(engine)[0]["env"]}
    assert args[:1] == ["engine"] and args[args.index("--host-index") + 1] == "$(POD_INDEX)"
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    for sts in (engine, _one("StatefulSet", "lockstep-engine-spare")):   # ranks listen on the IP they advertise
        env = {e["name"]: e for e in _containers(sts)[0]["env"]}
        assert env["LOCKSTEP_GROUP_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_variables_are_real_settings_and_commands_run():
    """Every LOCKSTEP_* a manifest sets is a setting some service reads, and each lockstep
    container's args (after the image's `lockstep` entrypoint) parse with --help."""
    from shared.settings import ALL_SETTINGS, ENV_PREFIX

    known = {ENV_PREFIX + f.upper() for cls in ALL_SETTINGS for f in cls.model_fields}
    names = set(_one("ConfigMap", "lockstep-config")["data"]) | set(_one("Secret", "lockstep-redis")["stringData"])
    commands = set()
    for doc in _docs():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in _containers(doc):
                names |= {e["name"] for e in c.get("env", [])}
                if c["image"].startswith("lockstep"):
                    assert "command" not in c, "keep the image's entrypoint (it runs `lockstep`)"
                    commands.add(tuple(c["args"]))
                    probe = c.get("livenessProbe", {}).get("exec", {}).get("command", [])
                    if probe:
                        assert probe[:3] == ["python", "-m", "services.admin.healthcheck"]
                        assert probe[3] in ("scheduler", "engine"), probe
    unknown = {n for n in names if n.startswith(ENV_PREFIX)} - known
    assert not unknown, f"manifests set {unknown}, which no service reads"
    assert {a[0] for a in commands} == {"init", "scheduler", "engine", "api-server"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    for args in commands:
        args = [a.replace("$(POD_INDEX)", "0") for a in args]   # what Kubernetes substitutes
        res = subprocess.run([sys.executable, "-m", "services.admin.cli", *args, "--help"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert res.returncode == 0 and "Usage:" in res.stdout, (args, res.stderr[-1000:])
