#!/usr/bin/env bash
# The multi-GPU check of the vocab-parallel ops (issue #8), one command on a 2- or 4-GPU machine:
# install (Triton path only unless BUILD_CUDA=1: the vocab-parallel kernels are Triton, the
# baseline's single-device op is then Triton too), then benchmarks/bench_distributed.py per
# (TP, V) with correctness checks, CSVs merged into one file. Results in $OUT (or ./gpu_out).
#   bash scripts/gpu_distributed.sh                  TP in "2 4" (as many as the GPUs allow)
#   TPS="2" VOCABS="128256" BATCHES=8,32 bash ...    a subset
#   TORCH_PATH=1 ...                                  also the torch (unfused) path at the first (TP, V)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LOG="$OUT/distributed.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__)"
} 2>&1 | tee "$LOG"
start=$(date +%s)
if [ "${BUILD_CUDA:-0}" = "1" ]; then skip=0; else skip=1; fi
SPECDEC_SKIP_CUDA=$skip SPECDEC_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "install: $(( $(date +%s) - start )) s (CUDA extension built: $BUILD_CUDA)" | tee -a "$LOG"
gpus=$(nvidia-smi -L | wc -l)
first=1
for tp in ${TPS:-2 4}; do
  [ "$tp" -gt "$gpus" ] && { echo "skip TP=$tp: $gpus GPUs" | tee -a "$LOG"; continue; }
  for v in ${VOCABS:-151936 128256}; do
    start=$(date +%s)
    timeout ${STEP_TIMEOUT:-150} torchrun --nproc-per-node "$tp" benchmarks/bench_distributed.py --graph \
      --vocab "$v" --batches "${BATCHES:-8,32,128}" --check-seeds 2 --out "$OUT/tp${tp}_v${v}" 2>&1 \
      | grep -v "Warning\|warn(" | tail -25 | tee -a "$LOG"
    echo "TP=$tp V=$v: $(( $(date +%s) - start )) s" | tee -a "$LOG"
    if [ "$first" = "1" ] && [ "${TORCH_PATH:-0}" = "1" ]; then
      SPECDEC_VP_TRITON=0 timeout ${STEP_TIMEOUT:-150} torchrun --nproc-per-node "$tp" benchmarks/bench_distributed.py \
        --graph --ops chain --vocab "$v" --batches "${BATCHES:-8,32,128}" --check-seeds 1 --out "$OUT/tp${tp}_v${v}_torch" 2>&1 \
        | grep -v "Warning\|warn(" | tail -12 | tee -a "$LOG"
    fi
    first=0
  done
done
# The device returns a few files: one CSV (header once) and one markdown of all runs.
python3 - "$OUT" <<'PY'
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
rm -rf "$OUT"/tp*
