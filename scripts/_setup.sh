# Sourced by scripts/quickstart, scripts/test and scripts/bench: makes sure a Python
# environment with kvjax (and its dev extra) is active. Uses the active virtualenv if there
# is one, else creates ./.venv. Reinstalls only when pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "kvjax: creating .venv" >&2
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
STAMP="${VIRTUAL_ENV}/.kvjax-installed"
if [ ! -f "$STAMP" ] || ! cmp -s pyproject.toml "$STAMP" || ! python -c "import kvjax" 2>/dev/null; then
  echo "kvjax: installing kvjax[${KVJAX_EXTRAS:-dev,hf}] into ${VIRTUAL_ENV}" >&2
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e ".[${KVJAX_EXTRAS:-dev,hf}]"
  cp pyproject.toml "$STAMP"
fi
export PYTHONUNBUFFERED=1
