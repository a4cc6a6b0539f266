#!/usr/bin/env bash
# The benchmarks on a GPU machine, one flag each, run in the order given; results (CSVs,
# markdown, logs) in the output folder. Build first (bash scripts/build.sh).
usage() {
  cat <<'EOF'
usage: bash scripts/bench.sh [benchmarks...] [options]

benchmarks (any number, run in the order given; none: --chain core):
  --chain [core|full]     benchmarks/bench_rejection_sample.py --sweep (default core): the chain op
                          against the torch baseline; --chain-args "ARGS" for more of its flags,
                          e.g. "--methods token --backends triton,torch"
  --tree NODES            benchmarks/bench_tree_rejection_sample.py --nodes NODES (e.g. 64 or 8,16);
                          --tree-batches LIST (default 1,32)
  --filters               benchmarks/bench_filters.py --breakdown (issue #6's bar, per kernel);
                          --filter-args "ARGS"; --filter-knobs "K=V;K=V|K=V" also times k50 p0.9
                          under those knob sets
  --verify-share          benchmarks/bench_verify_share.py: the op's share of a verify step on
                          random-weight LLMs
  --probe                 benchmarks/bench_stream_probe.py: pure-read kernels of the floor's bytes
                          next to the op; --probe-args "ARGS" (e.g. "--batches 32 --no-ours")
  --ab-base DIR           A/B of the CUDA kernels: DIR holds another commit's tree
                          (git archive REV | tar -x -C DIR); it is built in /tmp/ab_base
                          (scripts/build.sh --in), then benchmarks/tune_cuda_plan.py times
                          --ab-shapes on both trees, same card; --ab-commit REV names the base
                          in the CSVs; --ab-units N: a units-per-slot override instead of the plan
  --ab-rev REV            the same with commit REV of this repository (needs .git)
  --env-ab "A=0|A=1 B=2"  tune_cuda_plan.py on --ab-shapes once per '|'-separated set of
                          environment assignments ('default' = none), same build, same card
  --pdl-ab                --env-ab "SPECDEC_CUDA_PDL=0|SPECDEC_CUDA_PDL=1": programmatic dependent
                          launch off / on
  --distributed           benchmarks/bench_distributed.py with torchrun per (TP, V), correctness
                          checks included, CSVs merged into bench_distributed_all.csv / .md;
                          --tps "2 4" (those above the GPU count are skipped), --vocabs
                          "151936 128256", --batches 8,32,128, --torch-path (also the unfused torch
                          path at the first (TP, V)). Build with --skip-cuda unless the CUDA
                          baseline is wanted: the vocab-parallel kernels are Triton.

options:
  --ab-shapes "S;S"       op,B,dtype,probs[,backend] (default the five bar shapes)
  --out DIR               output folder (default $OUT, else gpu_out)
  --commit REV            the CSVs' commit column (SPECDEC_COMMIT; a copy without .git, or with a
                          stale one, needs it; unset while $OUT is set it reads "unknown")
  --time-limit S          a limit for each benchmark (default none)
  -h, --help              this text
EOF
}
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/lib.sh

steps=(); out=${OUT:-gpu_out}; limit=""
chain_sweep=core; chain_args=""; tree_nodes=""; tree_batches="1,32"; filter_args=""; filter_knobs=""
probe_args=""; ab_dir=""; ab_rev=""; ab_commit=${AB_BASE_COMMIT:-}; ab_units=default; env_ab=""
ab_shapes="chain,1,bf16,none;chain,32,bf16,none;chain,128,bf16,none;chain,128,fp32,fp32;tree,32,bf16,none"
tps="2 4"; vocabs="151936 128256"; batches="8,32,128"; torch_path=0
while [ $# -gt 0 ]; do
  case $1 in
    --chain) steps+=(chain); case ${2:-} in core|full) chain_sweep=$2; shift ;; esac ;;
    --chain-args) chain_args=$2; shift ;;
    --tree) steps+=(tree); tree_nodes=$2; shift ;;
    --tree-batches) tree_batches=$2; shift ;;
    --filters) steps+=(filters) ;;
    --filter-args) filter_args=$2; shift ;;
    --filter-knobs) filter_knobs=$2; shift ;;
    --verify-share) steps+=(verify_share) ;;
    --probe) steps+=(probe) ;;
    --probe-args) probe_args=$2; shift ;;
    --ab-base) steps+=(ab); ab_dir=$2; shift ;;
    --ab-rev) steps+=(ab); ab_rev=$2; shift ;;
    --ab-commit) ab_commit=$2; shift ;;
    --ab-units) ab_units=$2; shift ;;
    --ab-shapes) ab_shapes=$2; shift ;;
    --env-ab) steps+=(env_ab); env_ab=${env_ab:+$env_ab|}$2; shift ;;
    --pdl-ab) steps+=(env_ab); env_ab="SPECDEC_CUDA_PDL=0|SPECDEC_CUDA_PDL=1${env_ab:+|$env_ab}" ;;
    --distributed) steps+=(distributed) ;;
    --tps) tps=$2; shift ;;
    --vocabs) vocabs=$2; shift ;;
    --batches) batches=$2; shift ;;
    --torch-path) torch_path=1 ;;
    --out) out=$2; shift ;;
    --commit) export SPECDEC_COMMIT=$2; shift ;;
    --time-limit) limit=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done
[ ${#steps[@]} -eq 0 ] && steps=(chain)
py=$(python_cmd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
# torch JIT builds (the stream probe's load_inline, Triton's launchers) use these too.
use_cuda_home
use_system_compilers
export_commit
env_report "$out/env.txt" "$py"
require_built "$py" | tee -a "$out/env.txt"
LOG=$out/run.log

timed() {  # timed NAME COMMAND...: runs it; its time (and a failure) into env.txt
  local name=$1 t0; shift; t0=$(date +%s)
  local rc=0; "$@" || rc=$?
  echo "$name: $(( $(date +%s) - t0 )) s$([ $rc -ne 0 ] && echo " (exit $rc)")" | tee -a "$out/env.txt"
  return $rc
}

tune_on() {  # tune_on DIR COMMIT OUTDIR [ENV...]: tune_cuda_plan.py on the --ab-shapes with DIR's build
  local dir=$1 commit=$2 dest=$3; shift 3
  (
    cd "$dir"
    for assignment in "$@"; do export "${assignment?}"; done
    export SPECDEC_COMMIT="$commit" PYTHONPATH="$dir"
    limited "$limit" "$py" "$ROOT/benchmarks/tune_cuda_plan.py" --out "$dest" --units-per-slot "$ab_units" --shapes "$ab_shapes"
  )
}

run_chain() {
  # shellcheck disable=SC2086
  limited "$limit" "$py" benchmarks/bench_rejection_sample.py --sweep "$chain_sweep" --out "$out" $chain_args 2>&1 \
    | tee -a "$LOG" | grep -v "^B="
}
run_tree() {
  limited "$limit" "$py" benchmarks/bench_tree_rejection_sample.py --nodes "$tree_nodes" --batches "$tree_batches" \
    --out "$out" 2>&1 | tee -a "$LOG" | tail -30
}
run_filters() {
  # shellcheck disable=SC2086
  limited "$limit" "$py" benchmarks/bench_filters.py --out "$out" --breakdown $filter_args 2>&1 | tee -a "$LOG" | tail -40
  if [ -n "$filter_knobs" ]; then
    limited "$limit" "$py" benchmarks/bench_filters.py --out "$out" --tag knobs --batches 32 --configs bf16 --no-sort \
      --settings "k50 p0.9" --knob-runs "$filter_knobs" 2>&1 | tee -a "$LOG" | grep graph
  fi
}
run_verify_share() {
  limited "$limit" "$py" benchmarks/bench_verify_share.py --out "$out" 2>&1 | grep -v Warning | tee -a "$LOG" | tail -20
}
run_probe() {
  # shellcheck disable=SC2086
  limited "$limit" "$py" benchmarks/bench_stream_probe.py --out "$out/stream_probe" $probe_args 2>&1 | tee -a "$LOG" | tail -30
}
run_ab() {
  local base=/tmp/ab_base src_args=()
  if [ -n "$ab_rev" ]; then src_args=(--rev "$ab_rev"); ab_commit=${ab_commit:-$ab_rev}; else src_args=(--from "$ab_dir"); fi
  bash scripts/build.sh --python "$py" --in "$base" "${src_args[@]}" --log "$out/build_ab_base.log"
  for side in base this; do
    local dir=$ROOT commit=${SPECDEC_COMMIT:-}
    [ $side = base ] && { dir=$base; commit=${ab_commit:-unknown}; }
    tune_on "$dir" "$commit" "$out/ab_$side" 2>&1 | sed "s/^/$side: /" | tee -a "$LOG" | tail -8
  done
}
run_env_ab() {
  local i=0 set sets
  IFS='|' read -ra sets <<<"$env_ab"
  for set in "${sets[@]}"; do
    i=$((i + 1))
    [ "$set" = default ] && set=""
    # shellcheck disable=SC2086
    tune_on "$ROOT" "${SPECDEC_COMMIT:-}" "$out/env_ab_$i" $set 2>&1 | sed "s/^/[${set:-default}] /" | tee -a "$LOG" | tail -16
  done
}
run_distributed() {
  export NCCL_NVLS_ENABLE=0
  local gpus first=1 tp v t0
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  "$py" -c "import torch; print('nccl', torch.cuda.nccl.version())" 2>&1 | tee -a "$out/env.txt"
  for tp in $tps; do
    [ "$tp" -gt "$gpus" ] && { echo "skip TP=$tp: $gpus GPUs" | tee -a "$LOG"; continue; }
    for v in $vocabs; do
      t0=$(date +%s)
      limited "$limit" "$py" -m torch.distributed.run --nproc-per-node "$tp" benchmarks/bench_distributed.py --graph \
        --vocab "$v" --batches "$batches" --check-seeds 2 --out "$out/tp${tp}_v${v}" 2>&1 \
        | grep -v "Warning\|warn(" | tail -25 | tee -a "$LOG"
      echo "TP=$tp V=$v: $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
      if [ "$first" = 1 ] && [ "$torch_path" = 1 ]; then
        SPECDEC_VP_TRITON=0 limited "$limit" "$py" -m torch.distributed.run --nproc-per-node "$tp" benchmarks/bench_distributed.py \
          --graph --ops chain --vocab "$v" --batches "$batches" --check-seeds 1 --out "$out/tp${tp}_v${v}_torch" 2>&1 \
          | grep -v "Warning\|warn(" | tail -12 | tee -a "$LOG"
      fi
      first=0
    done
  done
  # One CSV (header once) and one markdown of all runs.
  "$py" - "$out" <<'PY'
import glob, os, sys
out = sys.argv[1]
csvs = sorted(glob.glob(os.path.join(out, "tp*", "bench_distributed.csv")))
with open(os.path.join(out, "bench_distributed_all.csv"), "w") as f:
    for i, path in enumerate(csvs):
        lines = open(path).read().splitlines()
        f.write("\n".join(lines if i == 0 else lines[1:]) + "\n")
with open(os.path.join(out, "bench_distributed_all.md"), "w") as f:
    for path in sorted(glob.glob(os.path.join(out, "tp*", "bench_distributed.md"))):
        f.write(f"## {os.path.basename(os.path.dirname(path))}\n\n" + open(path).read() + "\n")
PY
  rm -rf "$out"/tp*
}

status=0
for step in "${steps[@]}"; do
  say "$step"
  timed "$step" "run_$step" || status=1
done
exit $status
