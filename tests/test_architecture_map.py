"""docs/architecture.md "Where things are" stays true to the tree: every file it names
(in the map and in the table of who writes and reads each message) exists."""

from __future__ import annotations

import re

from tests.conftest import ROOT

PY = re.compile(r"[\w*]+\.py\b")


def _section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## Where things are")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_every_file_in_the_map_exists():
    block = _section().split("```")[1]
    missing, top = [], None
    for line in block.splitlines():
        if not line.strip():
            continue
        first = line.split()[0]
        if not line.startswith(" "):
            top = ROOT / first
            base = top
        else:
            assert top is not None, line
            base = top / first if first.endswith("/") else top
        for name in PY.findall(line):
            if not list(base.glob(name)):
                missing.append(str(base.relative_to(ROOT) / name))
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_file_in_the_message_table_exists():
    table = _section().split("### Who writes and who reads each message")[1]
    paths = set(re.findall(r"(?:shared|\w+)/\w+\.py", table))
    assert paths
    missing = [p for p in sorted(paths)
               if not (ROOT / p).exists() and not (ROOT / "services" / p).exists()]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
