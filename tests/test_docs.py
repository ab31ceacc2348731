"""The docs stay true to the code: every Redis key shape is documented, and
docs/configuration.md is what scripts/gen-config-docs generates from shared/settings.py."""

from __future__ import annotations

import re
import subprocess
import sys

from shared.keys import Keys
from tests.conftest import ROOT

DOCS = ROOT / "docs"


def test_redis_keys_doc_mentions_every_key_pattern():
    text = (DOCS / "redis-keys.md").read_text()
    documented = set(re.findall(r"`((?:\{ls\}|ls):[^`\s]+)`", text))
    missing = [p for p in Keys("ls").all_patterns() if p not in documented]
    assert not missing, f"docs/redis-keys.md does not document {missing}"


def test_redis_keys_doc_has_no_stale_keys():
    text = (DOCS / "redis-keys.md").read_text()
    rows = set(re.findall(r"^\| `((?:\{ls\}|ls):[^`\s]+)`", text, flags=re.M))
    stale = rows - set(Keys("ls").all_patterns())
    assert not stale, f"docs/redis-keys.md documents keys shared/keys.py no longer builds: {stale}"


def test_configuration_doc_is_generated_and_current():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-config-docs"), "--stdout"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert (DOCS / "configuration.md").read_text() == res.stdout, \
        "docs/configuration.md is out of date: run scripts/gen-config-docs"
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-config-docs"), "--check"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert check.returncode == 0, check.stderr


def test_configuration_doc_lists_every_setting():
    from shared.settings import ALL_SETTINGS, ENV_PREFIX

    text = (DOCS / "configuration.md").read_text()
    for cls in ALL_SETTINGS:
        for name in cls.model_fields:
            assert f"`{ENV_PREFIX}{name.upper()}`" in text, (cls.__name__, name)


def test_docs_link_targets_exist():
    for doc in ("architecture.md", "redis-keys.md", "operations.md", "configuration.md"):
        text = (DOCS / doc).read_text()
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", text):
            assert (DOCS / target).exists() or (ROOT / target).exists(), (doc, target)
    readme = (ROOT / "README.md").read_text()
    assert "docker compose up" in readme and "docs/operations.md" in readme
