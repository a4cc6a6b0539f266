#!/usr/bin/env bash
# The test suite on a GPU machine, with its log in the output folder. Build first
# (bash scripts/build.sh); this script does not install or build anything.
usage() {
  cat <<'EOF'
usage: bash scripts/gpu_tests.sh [options] [-- PYTEST ARGS...]

Runs pytest -v -rfE on the tests (default: all of python_tests) with the python that has torch
(the active venv's, else .venv's, else python3); tests.log in the output folder names every test
and its result as it runs (a killed run keeps what ran).

options:
  --tests "FILES"     test files or node ids, space-separated (default python_tests)
  -k EXPR             pytest -k expression, e.g. 'cuda and not agree'
  -m EXPR             marker expression, e.g. gpu, 'gpu and not slow', 'not compile'
                      (markers: gpu slow compile model distributed; python_tests/conftest.py)
  --timeout S         pytest-timeout per test (default 180)
  --time-limit S      a limit for the whole run (default none); pytest's summary is lost when
                      it is hit, so leave a margin under any limit of the caller's
  --sanitize          instead: compute-sanitizer memcheck on a representative subset
                      (test_semantics.py and test_tree.py, -k 'cuda and not follow'; small shapes)
  --diagnose          instead: scripts/diagnose_block_agreement.py (block-mode disagreements with
                      the reference, issue #9)
  --out DIR           output folder (default $OUT, else gpu_out)
  -h, --help          this text

The filter tests compile many variants of the filtered kernels (tens of seconds each on an
H200): run them on their own, a few at a time, e.g.
  bash scripts/gpu_tests.sh --tests python_tests/test_filters.py -k 'agree and 128256'
EOF
}
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

tests="python_tests"; kexpr=""; mexpr=""; per_test=180; limit=""; mode=tests; out=${OUT:-gpu_out}; extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --tests) tests=$2; shift ;;
    -k) kexpr=$2; shift ;;
    -m) mexpr=$2; shift ;;
    --timeout) per_test=$2; shift ;;
    --time-limit) limit=$2; shift ;;
    --sanitize) mode=sanitize ;;
    --diagnose) mode=diagnose ;;
    --out) out=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done
py=$(python_cmd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# torch JIT builds (the stream probe's load_inline, Triton's launchers) use these too.
use_cuda_home
use_system_compilers
env_report "$out/env.txt" "$py"
require_built "$py" | tee -a "$out/env.txt"
have_gpu || say "no GPU here: the GPU tests skip (Triton runs in its interpreter only with TRITON_INTERPRET=1)"

start=$(date +%s)
rc=0
case $mode in
  sanitize)
    limited "$limit" compute-sanitizer --tool memcheck --error-exitcode 1 "$py" -m pytest -q -x \
      python_tests/test_semantics.py python_tests/test_tree.py -k "cuda and not follow" "${extra[@]}" 2>&1 \
      | tee "$out/sanitize.log" | tail -20 || rc=$?
    ;;
  diagnose)
    limited "$limit" "$py" scripts/diagnose_block_agreement.py "${extra[@]}" 2>&1 | tee "$out/diagnose.log" | tail -40 || rc=$?
    ;;
  tests)
    read -ra files <<<"$tests"
    args=(-v -rfE --timeout="$per_test" "${files[@]}")
    [ -n "$kexpr" ] && args+=(-k "$kexpr")
    [ -n "$mexpr" ] && args+=(-m "$mexpr")
    limited "$limit" "$py" -m pytest "${args[@]}" "${extra[@]}" 2>&1 | tee "$out/tests.log" | tail -40 || rc=$?
    ;;
esac
echo "$mode: $(( $(date +%s) - start )) s (exit $rc)" | tee -a "$out/env.txt"
exit "$rc"
