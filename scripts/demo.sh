#!/usr/bin/env bash
# Set up from scratch (scripts/install.sh) and run the main job: the synthetic demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. "${SPECDEC_VENV:-.venv}/bin/activate"
python -m specdec_kernels.demo "$@"
