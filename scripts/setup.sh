#!/usr/bin/env bash
# Set up mosos in ./.venv. Plain: the planner, CLI and service (no torch).
# --dev: also torch (CPU build, pinned), the executor's and the tests' dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
if [ "${1:-}" = "--dev" ]; then
  # Pin torch: an open range would pull the newest CUDA build (several GB) instead of the CPU one.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints-dev.txt -e ".[api,test,torch,ray]"
else
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[api]"
fi
