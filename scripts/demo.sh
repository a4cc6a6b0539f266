#!/usr/bin/env bash
# Set up from scratch (scripts/install.sh) and run the main job: speculative generation on
# SmolLM2-135M-Instruct (docs/MAIN_JOB.md). Arguments go to python -m specdec_kernels.generate
# (--sample, --tree, --help, ...). The synthetic theory demo: python -m specdec_kernels.demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. "${SPECDEC_VENV:-.venv}/bin/activate"
python -m specdec_kernels.generate "$@"
