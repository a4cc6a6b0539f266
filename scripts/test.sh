#!/usr/bin/env bash
# Set up from scratch (scripts/install.sh) and run the test suite. Without a GPU the Triton
# kernel runs in Triton's interpreter and GPU-only tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. "${SPECDEC_VENV:-.venv}/bin/activate"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} python -m pytest -q --timeout=900 python_tests "$@"
