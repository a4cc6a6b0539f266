#!/usr/bin/env bash
# The GPU robustness runs of issue #38: the fuzz suite on the CUDA kernels (the tree kernel's
# first fuzz run), the 10,000-call soaks in block mode and for trees, and compute-sanitizer
# memcheck on the CUDA tree kernel and block mode over the bad-input cases. Build first
# (bash scripts/build.sh); this script does not install or build anything.
usage() {
  cat <<'EOF'
usage: bash scripts/gpu_robustness.sh [options]

Three steps, each with its log in the output folder; the script fails if any step fails.

  1. fuzz      python_tests/test_fuzz.py, the fused-vs-reference tests on the CUDA kernels
               (-k 'fuzz_fused and cuda-cuda': chains and trees, 40 derandomized examples
               each; NaN / +-inf rows, bad ids, malformed offsets and trees)      fuzz.log
  2. soak      10,000 random calls back to back: chains in block mode
               (test_gpu_stress.py::test_soak_10000_calls[block-*]) and trees
               (test_tree_gpu.py::test_tree_soak_10000_calls), on the CUDA kernels  soak.log
  3. sanitize  compute-sanitizer --tool memcheck on scripts/sanitize_cases.py: chains in
               token and block mode on the CUDA and Triton kernels, trees on the CUDA and
               Triton tree kernels, over the suite's bad-input cases (fuzz generators, the
               malformed-tree batches, V = 1 / 7 / 8193); passes only with
               "ERROR SUMMARY: 0 errors" and the driver's own checks             sanitize.log

Expected on an H200 (~3-5 min in all): "fuzz: ... passed", "soak: ... passed", the driver's
line "sanitize cases: N chain calls, M tree calls, 0 failures, ..." and
"========= ERROR SUMMARY: 0 errors", then "gpu_robustness: all steps passed".

options:
  --only STEPS        comma-separated subset of fuzz,soak,sanitize (default: all three)
  --all-backends      also the Triton kernels in steps 1 and 2 (fuzz and soaks on Triton:
                      several minutes more; the Triton soak alone took 123 s before)
  --examples N        fuzz examples per generator in the sanitizer driver (default 12)
  --seeds N           seeds of the driver's fixed cases per vocabulary (default 2)
  --time-limit S      a limit per step (default 600)
  --out DIR           output folder (default $OUT, else gpu_out)
  -h, --help          this text

compute-sanitizer: the one on PATH, else $CUDA_HOME/bin, else /usr/local/cuda/bin.
EOF
}
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

steps="fuzz,soak,sanitize"; all_backends=0; examples=12; seeds=2; limit=600; out=${OUT:-gpu_out}
while [ $# -gt 0 ]; do
  case $1 in
    --only) steps=$2; shift ;;
    --all-backends) all_backends=1 ;;
    --examples) examples=$2; shift ;;
    --seeds) seeds=$2; shift ;;
    --time-limit) limit=$2; shift ;;
    --out) out=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done
for step in ${steps//,/ }; do
  case $step in fuzz|soak|sanitize) ;; *) die "--only: unknown step '$step' (fuzz, soak, sanitize)" ;; esac
done
want() { case ",$steps," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

py=$(python_cmd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
use_cuda_home
use_system_compilers
have_gpu || die "no GPU here: these runs need the H200"
env_report "$out/env.txt" "$py"
require_built "$py" | tee -a "$out/env.txt"
"$py" -c "from specdec_kernels import _ops as o; import sys; sys.exit(0 if o.cuda_kernel_built(o.REJECTION_SAMPLE) and o.cuda_kernel_built(o.TREE_REJECTION_SAMPLE) else 1)" \
  || die "the CUDA kernels are not built: bash scripts/build.sh on the GPU machine"

failed=()
pytest_step() {  # NAME LOG PYTEST-ARGS...
  local name=$1 log=$2; shift 2
  local t0; t0=$(date +%s)
  say "$name"
  local rc=0
  limited "$limit" "$py" -m pytest -q -rfE --timeout="$limit" -p no:cacheprovider "$@" >"$log" 2>&1 || rc=$?
  tail -5 "$log"
  echo "$name: $(( $(date +%s) - t0 )) s (exit $rc)" | tee -a "$out/env.txt"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

if want fuzz; then
  kexpr="fuzz_fused and cuda-cuda"
  [ "$all_backends" = 1 ] && kexpr="fuzz_fused"
  pytest_step fuzz "$out/fuzz.log" python_tests/test_fuzz.py -k "$kexpr"
fi

if want soak; then
  soak_k="(soak_10000_calls and block and cuda) or (tree_soak_10000_calls and cuda)"
  [ "$all_backends" = 1 ] && soak_k="(soak_10000_calls and block) or tree_soak_10000_calls"
  pytest_step soak "$out/soak.log" python_tests/test_gpu_stress.py python_tests/test_tree_gpu.py -k "$soak_k"
fi

if want sanitize; then
  sanitizer=$(command -v compute-sanitizer || true)
  for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    [ -z "$sanitizer" ] && [ -n "$dir" ] && [ -x "$dir/bin/compute-sanitizer" ] && sanitizer="$dir/bin/compute-sanitizer"
  done
  [ -n "$sanitizer" ] || die "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
  t0=$(date +%s)
  say "sanitize ($sanitizer --tool memcheck, scripts/sanitize_cases.py --examples $examples --seeds $seeds)"
  rc=0
  limited "$limit" "$sanitizer" --tool memcheck --error-exitcode 1 --print-limit 50 \
    "$py" scripts/sanitize_cases.py --examples "$examples" --seeds "$seeds" >"$out/sanitize.log" 2>&1 || rc=$?
  grep -E '^(sanitize cases|FAILED)|ERROR SUMMARY' "$out/sanitize.log" || true
  if ! grep -q 'ERROR SUMMARY: 0 errors' "$out/sanitize.log"; then
    say "memcheck did not report 0 errors (see $out/sanitize.log)"
    [ "$rc" -ne 0 ] || rc=1
  fi
  echo "sanitize: $(( $(date +%s) - t0 )) s (exit $rc)" | tee -a "$out/env.txt"
  [ "$rc" -eq 0 ] || failed+=(sanitize)
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_robustness: FAILED: ${failed[*]} (logs in $out)"
  exit 1
fi
echo "gpu_robustness: all steps passed (logs in $out)"
