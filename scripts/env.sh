# Creates or reuses ./.venv with the pinned stack and this package installed.
# Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LOCALMAP_FX_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.localmap_fx-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ] || [ "$ROOT/requirements-dev.txt" -nt "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
