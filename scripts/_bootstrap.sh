# Sourced by scripts/run and scripts/test: make .venv current, then activate it.
# Idempotent: it reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "lockstep needs Python 3.11 or newer (found: $("$PY" --version 2>&1)). Set PYTHON=/path/to/python3.11." >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# A venv left without pip (made with --without-pip, or an interrupted first run): give it one.
"$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip --upgrade >/dev/null || {
  echo "lockstep: $VENV has no pip and ensurepip failed; remove $VENV and run this again." >&2; exit 1; }
STAMP="$VENV/.lockstep-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)-${LOCKSTEP_EXTRAS:-test,plot}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "lockstep: installing into $VENV (first run or dependencies changed)..." >&2
  # (grep drops pip's notes about index locations this machine's pip.conf names but lacks)
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[${LOCKSTEP_EXTRAS:-test,plot}]" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
