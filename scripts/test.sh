#!/usr/bin/env bash
# The test command (README, .ci/run): installs the package and test tools into .venv, builds
# every factor with nvcc (if nvcc is installed), and runs pytest. GPU tests are skipped where
# CuPy or a GPU is missing. Extra arguments go to pytest.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "usage: bash scripts/test.sh [PYTEST_ARG ...]"
  sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'
  echo "PYTHON: the interpreter that creates .venv (default python3). pytest's own help: .venv/bin/python -m pytest --help"
  exit 0
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[test] creating .venv"
  "$PY" -m venv .venv
fi
echo "[test] installing ex_engine, test and build dependencies (CUTLASS headers) into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,build]'
if command -v nvcc >/dev/null 2>&1; then
  echo "[test] building factors (make -j2)"
  make -j2 PYTHON=.venv/bin/python
else
  echo "[test] nvcc not found: factor build tests will be skipped"
fi
echo "[test] running pytest"
exec .venv/bin/python -m pytest -q "$@"
