#!/usr/bin/env bash
# Profiling of the kernels: the CUDA plans' sweep, Nsight Compute sections, per-CTA timelines,
# the Triton kernels' SASS. One flag each, run in the order given; output in the output folder.
# Build first (bash scripts/build.sh); --trace builds its own copy.
usage() {
  cat <<'EOF2'
usage: bash scripts/profile.sh [what...] [options]

what (any number, in the order given):
  --plan-sweep          benchmarks/tune_cuda_plan.py: the CUDA plans' units per CTA swept on the
                        bar shapes; --tune-args "ARGS" for more of its flags
  --ncu ["SHAPES"]      Nsight Compute (SpeedOfLight, Occupancy, LaunchStats, WarpStateStats,
                        MemoryWorkloadAnalysis, SchedulerStats) of one launch per shape
                        (tune_cuda_plan.py --profile-one op,B,dtype,probs[,backend]); default
                        "chain,1,bf16,none chain,32,bf16,none chain,128,bf16,none
                        tree,32,bf16,none chain,32,bf16,none,triton"
  --ncu-thresholds ["SHAPES"]
                        Nsight Compute of the CUDA threshold pass (row_threshold_kernel) with
                        source counters: one launch per shape SETTING/B[/V] (bench_filters.py
                        --profile-one with --backends cuda, T = 0.8, N(0, 3^2) bf16 logits; SETTING
                        with "_" for spaces, e.g. k50_p0.9); the report and its per-SASS-line
                        CSV (ncu --page source) in the output folder. Default "p0.9/1 p0.9/128
                        k50_p0.9/32"
  --trace               a copy of this tree built with -DSPECDEC_TRACE in /tmp/trace
                        (scripts/build.sh --in), then benchmarks/trace_chain_timeline.py: per-CTA
                        timelines of the CUDA chain kernel; --trace-shapes "S;S", --trace-args "ARGS"
  --sass                scripts/triton_sass.py (default: the chain kernel as at V = 128256):
                        registers, spills and the streaming loops' instructions of the Triton
                        kernel compiled for sm_90; runs without a GPU too; --sass-args "ARGS"
                        for its flags, e.g. "--tree 64" or "--logits fp32 --draft-probs"

options:
  --archs "90"          SASS targets of the --trace build (default: the GPU's)
  --out DIR             output folder (default $OUT, else gpu_out)
  --time-limit S        a limit for each step (each ncu shape: one step; default none)
  -h, --help            this text
EOF2
}
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

steps=(); out=${OUT:-gpu_out}; limit=""; tune_args=""; archs=""; trace_shapes=""; trace_args=""; sass_args=""
thr_shapes="p0.9/1 p0.9/128 k50_p0.9/32"
shapes="chain,1,bf16,none chain,32,bf16,none chain,128,bf16,none tree,32,bf16,none chain,32,bf16,none,triton"
while [ $# -gt 0 ]; do
  case $1 in
    --plan-sweep) steps+=(plan_sweep) ;;
    --tune-args) tune_args=$2; shift ;;
    --ncu) steps+=(ncu); case ${2:-} in ""|-*) ;; *) shapes=$2; shift ;; esac ;;
    --ncu-thresholds) steps+=(ncu_thresholds); case ${2:-} in ""|-*) ;; *) thr_shapes=$2; shift ;; esac ;;
    --trace) steps+=(trace) ;;
    --trace-shapes) trace_shapes=$2; shift ;;
    --trace-args) trace_args=$2; shift ;;
    --sass) steps+=(sass) ;;
    --sass-args) sass_args=$2; shift ;;
    --archs) archs=$2; shift ;;
    --out) out=$2; shift ;;
    --time-limit) limit=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done
[ ${#steps[@]} -eq 0 ] && { usage >&2; exit 2; }
py=$(python_cmd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
# torch JIT builds (the stream probe's load_inline, Triton's launchers) use these too.
use_cuda_home
use_system_compilers
env_report "$out/env.txt" "$py"
LOG=$out/run.log

run_plan_sweep() {
  require_built "$py"
  # shellcheck disable=SC2086
  limited "$limit" "$py" benchmarks/tune_cuda_plan.py --out "$out" $tune_args 2>&1 | tee -a "$LOG" | tail -60
}
run_ncu() {
  require_built "$py"
  command -v ncu >/dev/null 2>&1 || die "ncu (Nsight Compute) is not on PATH"
  local shape
  for shape in $shapes; do
    echo "=== ncu $shape" >>"$LOG"
    limited "$limit" ncu --clock-control none -k regex:rejection_sample --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats \
      "$py" benchmarks/tune_cuda_plan.py --profile-one "$shape" >>"$LOG" 2>&1 || echo "ncu $shape failed: $?" | tee -a "$LOG"
  done
}
run_ncu_thresholds() {
  require_built "$py"
  command -v ncu >/dev/null 2>&1 || die "ncu (Nsight Compute) is not on PATH"
  local shape setting batch vocab name
  for shape in $thr_shapes; do
    IFS=/ read -r setting batch vocab <<<"$shape"
    name=thr_${setting}_B${batch}_V${vocab:-128256}
    echo "=== ncu $name" >>"$LOG"
    limited "$limit" ncu --clock-control none -k regex:row_threshold --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SourceCounters --section SchedulerStats -f -o "$out/$name" \
      "$py" benchmarks/bench_filters.py --backends cuda --profile-one "${setting//_/ }" --batches "$batch" \
      --vocab "${vocab:-128256}" --temperature 0.8 --scale 3 --configs bf16 >>"$LOG" 2>&1 \
      || { echo "ncu $name failed: $?" | tee -a "$LOG"; continue; }
    ncu -i "$out/$name.ncu-rep" >"$out/$name.txt" 2>&1 || true
    ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass >"$out/$name.sass.csv" 2>>"$LOG" || true
  done
}
run_trace() {
  bash scripts/build.sh --python "$py" --in /tmp/trace --cuda --nvcc-flags "-DSPECDEC_TRACE ${SPECDEC_NVCC_FLAGS:-}" \
    ${archs:+--archs "$archs"} --log "$out/build_trace.log"
  # shellcheck disable=SC2086
  (cd /tmp/trace && PYTHONPATH=/tmp/trace limited "$limit" "$py" benchmarks/trace_chain_timeline.py \
    --out "$out/trace_chain_timeline" ${trace_shapes:+--shapes "$trace_shapes"} $trace_args 2>&1 | tee -a "$LOG" | tail -20)
}
run_sass() {
  # shellcheck disable=SC2086
  limited "$limit" "$py" scripts/triton_sass.py --out "$out/sass" $sass_args 2>&1 | tee -a "$LOG" | tail -40
}

status=0
for step in "${steps[@]}"; do
  say "$step"
  t0=$(date +%s); rc=0
  "run_$step" || rc=$?
  echo "$step: $(( $(date +%s) - t0 )) s$([ $rc -ne 0 ] && echo " (exit $rc)")" | tee -a "$out/env.txt"
  [ $rc -ne 0 ] && status=1
done
exit $status
