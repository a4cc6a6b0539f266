#!/usr/bin/env bash
# Issue #40 on one GPU: the vocab-parallel ops with 2 and 4 ranks sharing the device (gloo on
# CUDA tensors), fused Triton path and torch path, against the single-device op. Build first
# (bash scripts/build.sh; --skip-cuda is enough: the single-device reference then runs on
# Triton); this script does not install or build anything.
usage() {
  cat <<'EOF'
usage: bash scripts/gpu_vocab_parallel.sh [options]

Runs python_tests/test_distributed_gpu.py (66 tests, one spawn of 4 processes on device 0)
through scripts/gpu_tests.sh: tests.log (every test and its result), env.txt and
junit_vocab_parallel.xml in the output folder.

Pass: the last line "gpu_vocab_parallel: 66 passed in ... s". The first test
(test_gpu_vocab_parallel_gloo_takes_cuda_tensors) carries the spawn: most of the run's time
(CUDA contexts, the Triton kernels' first compiles). A failure there with "gloo refused a
collective" names the collective; a traceback from the spawn names the rank and the case;
every later test then fails at once with "the ranks' spawn failed".

options:
  --time-limit S      a limit for the whole pytest run (default 200)
  --out DIR           output folder (default $OUT, else gpu_out)
  -h, --help          this text
EOF
}
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

limit=200; out=${OUT:-gpu_out}
while [ $# -gt 0 ]; do
  case $1 in
    --time-limit) limit=$2; shift ;;
    --out) out=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done
have_gpu || die "no GPU here: test_distributed_gpu.py would skip every test"

rc=0
bash scripts/gpu_tests.sh --tests python_tests/test_distributed_gpu.py --timeout "$limit" --time-limit "$limit" \
  --out "$out" -- --junitxml="$out/junit_vocab_parallel.xml" || rc=$?
summary=$(grep -E '^=+ .*(passed|failed|error).* =+$' "$out/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
echo "gpu_vocab_parallel: ${summary:-no pytest summary (time limit hit? see $out/tests.log)}" | tee -a "$out/env.txt"
exit "$rc"
