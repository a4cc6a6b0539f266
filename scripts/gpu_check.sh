#!/usr/bin/env bash
# The GPU machine's check, one command: build for this card, run the benchmark (and the
# timings asked for below), then the test suite on the GPU in the time the call has left.
# Results go to $OUT (the device tool's folder) or ./gpu_out.
#   bash scripts/gpu_check.sh [core|full]      (benchmark sweep, default core)
#   TESTS=python_tests/test_backends.py ...    (a subset of the tests)
#   PYTEST_K='cuda and not agree'             (pytest -k expression; PYTEST_ARGS: other flags, split on spaces)
#   SPECDEC_CXX=... SPECDEC_CC=...             (the host compilers; default the system's /usr/bin ones)
#   SANITIZE=1 ...                             (also compute-sanitizer memcheck on a subset)
#   TESTS=none / BENCH=0                       (skip the tests / the kernel benchmark)
#   BENCH_ARGS="--methods token"               (more arguments of bench_rejection_sample.py)
#   VERIFY_SHARE=1                             (also benchmarks/bench_verify_share.py: the op's
#                                               share of a verify step on random-weight LLMs)
#   TEST_TIMEOUT=420                           (seconds for the whole test run; capped so that the
#                                               run ends 20 s before CALL_LIMIT=590 seconds after
#                                               this script started -- the device tool kills a call
#                                               at 600 s, pytest's summary with it, and the build
#                                               alone takes 110-150 s, on a warm machine too)
#   The filter tests compile many variants of the filtered kernels (tens of seconds each on
#   the GPU machine): give them their own call, e.g.
#   TESTS=python_tests/test_filters.py PYTEST_K=... BENCH=0 bash scripts/gpu_check.sh (a few at a
#   time: its GPU agreement tests at V = 128256 took ~45 s each on an H200, 7 in 330 s;
#   tests.log lists every test's result as it runs; CALL_LIMIT=100000 off the device tool)
#   DIAGNOSE=1                                 (scripts/diagnose_block_agreement.py: block-mode
#                                               disagreements with the reference, issue #9)
#   FILTER_BENCH=1                             (benchmarks/bench_filters.py: issue #6's bar, with the
#                                               per-kernel breakdown; FILTER_KNOBS="FILTER_STATS_PROGRAMS_PER_SM=8;..."
#                                               also times k50 p0.9 under those knob sets)
#   TREE_BENCH="64"                            (benchmarks/bench_tree_rejection_sample.py --nodes ...)
#   PROFILE=1                                  (benchmarks/tune_cuda_plan.py: the CUDA plans' units
#                                               per CTA swept on the bar shapes; then ncu sections
#                                               of the chain / tree kernels, PROFILE_SHAPES)
#   AB_BASE=.ab_base                           (an A/B of the CUDA kernels: a copy of another commit
#                                               in that folder -- here: git archive REV | tar -x -C
#                                               .ab_base, the folder in .git/info/exclude and in the
#                                               device call's carry -- is built in /tmp next to this
#                                               tree's build, then tune_cuda_plan.py times AB_SHAPES
#                                               on both, same call, same card;
#                                               AB_UNITS=2: a units-per-slot override instead of
#                                               the shipped plan)
#   PDL_AB=1                                   (ENV_AB below with SPECDEC_CUDA_PDL=0 and =1 first:
#                                               programmatic dependent launch off / on, same
#                                               build, same card; into $OUT/env_ab_1 and _2)
#   ENV_AB="A=0|A=1 B=2"                       (tune_cuda_plan.py on AB_SHAPES once per '|'-separated
#                                               set of environment assignments, same build, same
#                                               card: e.g. SPECDEC_CUDA_PREFETCH_AHEAD=0 or
#                                               SPECDEC_TRITON_PDL=0 against the default; 'default'
#                                               = none; into $OUT/env_ab_<i>)
#   AB_TIMEOUT=150                             (seconds per side / set of the A/B timings above)
#   TRACE=1                                    (benchmarks/trace_chain_timeline.py: a copy of this
#                                               tree built with -DSPECDEC_TRACE in /tmp/trace, next
#                                               to the main build; per-CTA timelines of the CUDA
#                                               chain kernel on TRACE_SHAPES, TRACE_ARGS)
#   PROBE=1                                    (benchmarks/bench_stream_probe.py: pure-read kernels of
#                                               the floor's bytes, graph-timed like the op, next to the
#                                               op: the practical floor of one launch; into
#                                               $OUT/stream_probe, PROBE_ARGS e.g. "--batches 32 --no-ours")
#   SPECDEC_COMMIT=abc1234                     (the commit the copied tree is, for the CSVs' commit
#                                               column; pass it expanded on the local side, e.g.
#                                               SPECDEC_COMMIT=$(git rev-parse --short HEAD) written
#                                               into the command. The GPU machine's own .git can be
#                                               an older session's, so there (OUT set) unset reads
#                                               "unknown"; AB_BASE_COMMIT names the A/B's base)
# The machine has torch, triton, nvcc and ninja but no network: build without isolation.
set -uo pipefail
cd "$(dirname "$0")/.."
# The GPU machine sets CXX=/opt/gcc/bin/g++, whose links leave libstdc++ out of the extension's
# needed libraries and put a copy of its stream code inside: every C++ error message that
# formats a number then segfaults (docs/ROBUSTNESS.md). Build with the system compiler.
export CXX=${SPECDEC_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || echo "${CXX:-g++}" )}
export CC=${SPECDEC_CC:-$( [ -x /usr/bin/gcc ] && echo /usr/bin/gcc || echo "${CC:-gcc}" )}
# On the GPU machine (the device tool sets OUT) the copy's .git may be stale: no commit unless passed.
if [ -z "${SPECDEC_COMMIT:-}" ] && [ -n "${OUT:-}" ]; then export SPECDEC_COMMIT=unknown; fi
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
SWEEP=${1:-core}
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2
  echo "host compilers: CC=$CC CXX=$CXX"
} 2>&1 | tee "$OUT/env.txt"

script_start=$(date +%s)
start=$script_start
if [ -n "${AB_BASE:-}" ]; then  # the base tree builds in the background, next to this one
  rm -rf /tmp/ab_base && cp -r "$AB_BASE" /tmp/ab_base &&
    (cd /tmp/ab_base && SPECDEC_CUDA_ARCHS=${SPECDEC_CUDA_ARCHS:-90} python3 setup.py build_ext --inplace >"$OUT/build_ab_base.log" 2>&1) &
fi
if [ "${TRACE:-0}" = "1" ]; then  # the profiling build, in the background too
  rm -rf /tmp/trace && mkdir -p /tmp/trace && cp -r setup.py pyproject.toml csrc specdec_kernels benchmarks /tmp/trace/ &&
    rm -f /tmp/trace/specdec_kernels/_C*.so &&
    (cd /tmp/trace && SPECDEC_NVCC_FLAGS="-DSPECDEC_TRACE ${SPECDEC_NVCC_FLAGS:-}" SPECDEC_CUDA_ARCHS=${SPECDEC_CUDA_ARCHS:-90} \
      python3 setup.py build_ext --inplace >"$OUT/build_trace.log" 2>&1) &
fi
if ! SPECDEC_CUDA_ARCHS=${SPECDEC_CUDA_ARCHS:-90} python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  echo "pip install failed; trying setup.py build_ext --inplace" | tee -a "$OUT/build.log"
  SPECDEC_CUDA_ARCHS=${SPECDEC_CUDA_ARCHS:-90} python3 setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
fi
wait
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
python3 -c "import specdec_kernels; print('backends:', specdec_kernels.available_backends())" 2>&1 | tee -a "$OUT/env.txt"

if [ "${SANITIZE:-0}" = "1" ]; then
  # compute-sanitizer memcheck on a representative subset (slow: small shapes only).
  start=$(date +%s)
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -x \
    python_tests/test_semantics.py python_tests/test_tree.py -k "cuda and not follow" 2>&1 | tail -20 | tee -a "$OUT/run.log"
  echo "sanitizer: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ "${VERIFY_SHARE:-0}" = "1" ]; then
  start=$(date +%s)
  timeout 300 python3 benchmarks/bench_verify_share.py --out "$OUT" 2>&1 | grep -v Warning | tail -20 | tee -a "$OUT/run.log"
  echo "verify share: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ "${DIAGNOSE:-0}" = "1" ]; then
  timeout 240 python3 scripts/diagnose_block_agreement.py 2>&1 | tee -a "$OUT/run.log" | tail -40
fi

if [ "${FILTER_BENCH:-0}" = "1" ]; then
  start=$(date +%s)
  timeout 300 python3 benchmarks/bench_filters.py --out "$OUT" --breakdown ${FILTER_BENCH_ARGS:-} 2>&1 | tee -a "$OUT/run.log" | tail -40
  if [ -n "${FILTER_KNOBS:-}" ]; then
    timeout 200 python3 benchmarks/bench_filters.py --out "$OUT" --tag knobs --batches 32 --configs bf16 --no-sort \
      --settings "k50 p0.9" --knob-runs "$FILTER_KNOBS" 2>&1 | tee -a "$OUT/run.log" | grep graph
  fi
  echo "filter bench: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ -n "${TREE_BENCH:-}" ]; then
  start=$(date +%s)
  timeout 300 python3 benchmarks/bench_tree_rejection_sample.py --nodes "$TREE_BENCH" --batches ${TREE_BATCHES:-1,32} \
    --out "$OUT" 2>&1 | tee -a "$OUT/run.log" | tail -30
  echo "tree bench: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ "${PROFILE:-0}" = "1" ]; then
  start=$(date +%s)
  timeout 240 python3 benchmarks/tune_cuda_plan.py --out "$OUT" ${TUNE_ARGS:-} 2>&1 | tee -a "$OUT/run.log" | tail -60
  echo "plan sweep: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
  start=$(date +%s)
  for shape in ${PROFILE_SHAPES:-chain,1,bf16,none chain,32,bf16,none chain,128,bf16,none tree,32,bf16,none chain,32,bf16,none,triton}; do
    echo "=== ncu $shape" >>"$OUT/run.log"
    timeout 120 ncu --clock-control none -k regex:rejection_sample --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats \
      python3 benchmarks/tune_cuda_plan.py --profile-one "$shape" >>"$OUT/run.log" 2>&1 || echo "ncu $shape failed: $?" >>"$OUT/run.log"
  done
  echo "ncu: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ -n "${AB_BASE:-}" ]; then
  start=$(date +%s)
  root=$(pwd)
  for side in base this; do
    dir=$root; [ $side = base ] && dir=/tmp/ab_base
    commit=${SPECDEC_COMMIT:-}; [ $side = base ] && commit=${AB_BASE_COMMIT:-unknown}
    (cd "$dir" && SPECDEC_COMMIT=$commit PYTHONPATH=$dir timeout ${AB_TIMEOUT:-150} python3 "$root/benchmarks/tune_cuda_plan.py" --out "$OUT/ab_$side" \
      --units-per-slot ${AB_UNITS:-default} --shapes "${AB_SHAPES:-chain,1,bf16,none;chain,32,bf16,none;chain,128,bf16,none;chain,128,fp32,fp32;tree,32,bf16,none}" \
      2>&1 | sed "s/^/$side: /" | tee -a "$OUT/run.log" | tail -8)
  done
  echo "a/b: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

# PDL_AB is ENV_AB with programmatic dependent launch off, then on.
[ "${PDL_AB:-0}" = "1" ] && ENV_AB="SPECDEC_CUDA_PDL=0|SPECDEC_CUDA_PDL=1${ENV_AB:+|$ENV_AB}"
if [ -n "${ENV_AB:-}" ]; then
  start=$(date +%s)
  i=0
  IFS='|' read -ra env_sets <<<"$ENV_AB"
  for set in "${env_sets[@]}"; do
    i=$((i + 1))
    [ "$set" = default ] && set=""
    env $set timeout ${AB_TIMEOUT:-150} python3 benchmarks/tune_cuda_plan.py --out "$OUT/env_ab_$i" --units-per-slot default \
      --shapes "${AB_SHAPES:-chain,1,bf16,none;chain,32,bf16,none;chain,128,bf16,none;chain,128,fp32,fp32;tree,32,bf16,none}" \
      2>&1 | sed "s/^/[${set:-default}] /" | tee -a "$OUT/run.log" | tail -16
  done
  echo "env a/b: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ "${TRACE:-0}" = "1" ]; then
  start=$(date +%s)
  (cd /tmp/trace && PYTHONPATH=/tmp/trace timeout 200 python3 benchmarks/trace_chain_timeline.py \
    --out "$OUT/trace_chain_timeline" ${TRACE_SHAPES:+--shapes "$TRACE_SHAPES"} ${TRACE_ARGS:-} 2>&1 | tee -a "$OUT/run.log" | tail -20)
  echo "trace: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ "${PROBE:-0}" = "1" ]; then
  start=$(date +%s)
  timeout 200 python3 benchmarks/bench_stream_probe.py --out "$OUT/stream_probe" ${PROBE_ARGS:-} 2>&1 | tee -a "$OUT/run.log" | tail -30
  echo "stream probe: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

if [ "${BENCH:-core}" != "0" ]; then
  start=$(date +%s)
  timeout 480 python3 benchmarks/bench_rejection_sample.py --sweep "$SWEEP" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/run.log" | grep -v "^B="
  echo "bench: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi

# The tests come last: the timings above are what a call is usually for, and the test run is
# capped to the time the call has left (a run over the device tool's limit loses its summary).
if [ "${TESTS:-}" != "none" ]; then
  start=$(date +%s)
  test_timeout=${TEST_TIMEOUT:-420}
  left=$(( ${CALL_LIMIT:-590} - 20 - (start - script_start) ))
  [ "$left" -lt "$test_timeout" ] && { test_timeout=$(( left > 30 ? left : 30 )); echo "tests capped at $test_timeout s"; }
  # -v: tests.log names each test and its result as it runs (a killed run keeps what ran).
  timeout $test_timeout python3 -m pytest -v -rfE --timeout=180 ${TESTS:-python_tests} ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
  echo "tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
fi
