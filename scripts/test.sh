#!/usr/bin/env bash
# Set up (scripts/install.sh; a second run skips what is done) and run the test suite: the
# default tier, or everything with --all. Without a GPU the Triton kernels run in Triton's
# interpreter and GPU-only tests skip.
usage() {
  cat <<'USAGE'
usage: bash scripts/test.sh [--all] [PYTEST ARGS...]

  (default)  the default tier: pytest -m "not slow and not model and not distributed and not compile"
             (~7 min on a 2-core CPU): the op's contract (opcheck, fake kernels, errors), the
             exactness tests (chi-square fits and their negative controls, theory of tokens per
             step) at sizes that can fail, backend agreement with Triton in its interpreter,
             tree utilities, filters, the vLLM adapter; the GPU tests where there is a GPU.
             Installs without the model (scripts/install.sh --no-model).
  --all      every test (~30 min on a 2-core CPU; .ci/run runs this): also the slow
             statistical sizes, the Hugging Face / real-model tests (model), the multi-process
             tests (distributed) and the sm_90 compile tests of the Triton kernels (compile).

The tiers are markers applied in python_tests/conftest.py (one table there). Other pytest
arguments pass through, e.g. -x, -k EXPR, a file or node id (then only those run); "-m EXPR"
replaces the tier's expression.
Environment: OMP_NUM_THREADS (default 2) and what scripts/install.sh reads (SPECDEC_TORCH, ...).
USAGE
}
set -euo pipefail
cd "$(dirname "$0")/.."
all=0; args=()
for a in "$@"; do
  case $a in
    --all) all=1 ;;
    -h|--help) usage; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
DEFAULT_TIER="not slow and not model and not distributed and not compile"
if [ "$all" = 1 ]; then
  bash scripts/install.sh
  tier=()
else
  bash scripts/install.sh --no-model
  tier=(-m "$DEFAULT_TIER")
fi
. "${SPECDEC_VENV:-.venv}/bin/activate"
if [ "$all" = 1 ]; then what="every tier"; else what="the default tier: -m \"$DEFAULT_TIER\""; fi
echo "==> pytest, $what ${args[*]:-}" >&2
# The whole suite unless the arguments name tests (a file, a folder, a node id).
where=(python_tests)
for a in "${args[@]}"; do [ "${a#-}" = "$a" ] && [ -e "${a%%::*}" ] && where=(); done
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} python -m pytest -q --timeout=900 "${where[@]}" "${tier[@]}" "${args[@]}"
