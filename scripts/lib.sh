# Helpers shared by the scripts in this folder (sourced, not run): progress lines for long
# steps, GPU detection, the host compilers. Needs bash.

# say MESSAGE: one progress line on stderr, prefixed so that it stands out of tool output.
say() { printf '==> %s\n' "$*" >&2; }

die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# have_gpu: a working NVIDIA driver with at least one GPU (nvidia-smi lists it). A machine with
# the CUDA toolkit but no GPU (or nvidia-smi without a loaded driver) has none.
have_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

# gpu_archs: the compute capabilities of the visible GPUs as SPECDEC_CUDA_ARCHS wants them
# ("90", "80;90"), empty when unknown.
gpu_archs() {
  have_gpu || return 0
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | sort -u | paste -sd ';' -
}

# run_step "WHAT (size, expected time)" LOG COMMAND...: runs COMMAND with its output in LOG,
# prints WHAT first, a line every 30 s while it runs and its time at the end; on failure the
# end of LOG and the exit status.
run_step() {
  local what=$1 log=$2; shift 2
  local t0; t0=$(date +%s)
  say "$what"
  mkdir -p "$(dirname "$log")"
  ( while sleep 30; do printf '    ... %s s\n' "$(( $(date +%s) - t0 ))" >&2; done ) &
  local ticker=$! rc=0
  "$@" >"$log" 2>&1 || rc=$?
  kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    tail -40 "$log" >&2
    printf 'error: failed after %s s (exit %s); full log: %s\n' "$(( $(date +%s) - t0 ))" "$rc" "$log" >&2
    return "$rc"
  fi
  printf '    done in %s s\n' "$(( $(date +%s) - t0 ))" >&2
}

# use_system_compilers: the extension must be built with the system compiler. The GPU machine
# sets CXX=/opt/gcc/bin/g++, whose links leave libstdc++ out of the extension's needed libraries
# and put a copy of its stream code inside: every C++ error message that formats a number then
# segfaults (docs/ROBUSTNESS.md, python_tests/test_build.py). SPECDEC_CXX / SPECDEC_CC override.
use_system_compilers() {
  export CXX=${SPECDEC_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || echo "${CXX:-g++}" )}
  export CC=${SPECDEC_CC:-$( [ -x /usr/bin/gcc ] && echo /usr/bin/gcc || echo "${CC:-gcc}" )}
}

# use_cuda_home: nvcc on PATH may be a wrapper script (/usr/local/bin/nvcc); torch must see the
# real toolkit to link the extension.
use_cuda_home() {
  if [ -z "${CUDA_HOME:-}" ] && [ -z "${CUDA_PATH:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
  fi
}

# python_cmd: the interpreter the scripts use: the active virtual environment's, else the
# project's .venv (SPECDEC_VENV) when it exists, else python3 (the GPU machine's preinstalled one).
python_cmd() {
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then echo "$VIRTUAL_ENV/bin/python"
  elif [ -x "${SPECDEC_VENV:-.venv}/bin/python" ]; then echo "${SPECDEC_VENV:-.venv}/bin/python"
  else command -v python3
  fi
}

# export_commit: SPECDEC_COMMIT, the commit column of the benchmarks' CSVs. Passed: kept (a
# copy without .git, or with a stale one: pass it expanded on the side that has the repository,
# e.g. SPECDEC_COMMIT=$(git rev-parse --short HEAD) written into the command). Unset where the
# device tool runs the copy ($OUT set: that machine's .git can be an older session's): "unknown".
# Otherwise unset, and the benchmarks ask git.
export_commit() {
  if [ -z "${SPECDEC_COMMIT:-}" ] && [ -n "${OUT:-}" ]; then export SPECDEC_COMMIT=unknown; fi
  if [ -n "${SPECDEC_COMMIT:-}" ]; then export SPECDEC_COMMIT; fi
}

# env_report FILE PYTHON: the card, the versions and the compilers, printed and saved.
env_report() {
  local file=$1 py=$2
  mkdir -p "$(dirname "$file")"
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || echo "no GPU (nvidia-smi lists none)"
    "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -2
    echo "host compilers: CC=${CC:-} CXX=${CXX:-}"
  } 2>&1 | tee -a "$file"
}

# require_built PYTHON: specdec_kernels imports (built by scripts/build.sh); prints its backends.
require_built() {
  "$1" -c "import specdec_kernels; print('backends:', specdec_kernels.available_backends())" \
    || die "specdec_kernels does not import: build it first (bash scripts/build.sh)"
}

# limited SECONDS COMMAND...: COMMAND under timeout(1) when SECONDS is set, else as is.
limited() {
  local s=$1; shift
  if [ -n "$s" ]; then timeout "$s" "$@"; else "$@"; fi
}
