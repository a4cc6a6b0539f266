#!/usr/bin/env bash
# Build specdec_kernels' extension (specdec_kernels._C) in place, unless it is already built
# from the same sources and settings. Run by scripts/install.sh; on the GPU machine (torch
# preinstalled, no network) run it directly.
usage() {
  cat <<'EOF'
usage: bash scripts/build.sh [options]

Builds specdec_kernels._C in place (python setup.py build_ext --inplace; objects kept in
build/, so a changed source recompiles alone). A stamp (build/specdec-ext.stamp: a hash of
csrc/**, setup.py, the Python and torch versions and the options below) skips the build when
nothing changed: a second run takes a second.

The CUDA kernel is compiled when a GPU is present (nvidia-smi lists one), else only the C++
op schemas (the Triton and reference backends): ~20 s against minutes.

options:
  --cuda             compile the CUDA kernel even without a GPU (needs a CUDA build of torch and
                     the CUDA toolkit; fails otherwise). Env: SPECDEC_BUILD_CUDA=1
  --skip-cuda        never compile it. Env: SPECDEC_SKIP_CUDA=1
  --archs "80;90"    SASS targets (PTX of the last one is embedded too). Default: the visible
                     GPUs' compute capabilities; without a GPU, setup.py's "80;90".
                     Env: SPECDEC_CUDA_ARCHS
  --nvcc-flags F     extra nvcc flags, e.g. "-DSPECDEC_TRACE". Env: SPECDEC_NVCC_FLAGS
  --in DIR           build a copy in DIR instead of in place (its build/ is kept between runs):
  --from SRC         ... a copy of the folder SRC (default: this tree), e.g. another commit's
                     tree (git archive REV | tar -x -C SRC) for an A/B
  --rev REV          ... a copy of commit REV of this repository (git archive)
  --force            build even when the stamp matches
  --python PY        the interpreter (default: the active venv's, else .venv's, else python3)
  --log FILE         the build's output (default DIR/build/specdec-build.log)
  -h, --help         this text

The host compilers are the system's /usr/bin/g++ and /usr/bin/gcc when present (SPECDEC_CXX /
SPECDEC_CC override): a compiler that links libstdc++ statically (the GPU machine's
CXX=/opt/gcc/bin/g++) makes every C++ error message with a number in it crash
(docs/ROBUSTNESS.md). CUDA_HOME defaults to /usr/local/cuda when nvcc on PATH is a wrapper.
EOF
}
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/lib.sh

cuda=""; archs=${SPECDEC_CUDA_ARCHS:-}; nvcc_flags=${SPECDEC_NVCC_FLAGS:-}; dest=""; src=""; rev=""; force=0
py=""; log=""
[ -n "${SPECDEC_BUILD_CUDA:-}" ] && [ "${SPECDEC_BUILD_CUDA}" != 0 ] && cuda=1
if [ "${SPECDEC_SKIP_CUDA:-0}" = 1 ]; then
  [ "$cuda" = 1 ] && die "SPECDEC_BUILD_CUDA=1 and SPECDEC_SKIP_CUDA=1 contradict each other"
  cuda=0
fi
while [ $# -gt 0 ]; do
  case $1 in
    --cuda) cuda=1 ;;
    --skip-cuda) cuda=0 ;;
    --archs) archs=$2; shift ;;
    --nvcc-flags) nvcc_flags=$2; shift ;;
    --in) dest=$2; shift ;;
    --from) src=$2; shift ;;
    --rev) rev=$2; shift ;;
    --force) force=1 ;;
    --python) py=$2; shift ;;
    --log) log=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done
py=${py:-$(python_cmd)}
[ -n "$py" ] || die "no python3 found"

# A copy: replace its sources, keep its build/ (ninja then recompiles only what changed).
if [ -n "$dest" ]; then
  mkdir -p "$dest"
  dest=$(cd "$dest" && pwd)
  [ "$dest" = "$ROOT" ] && die "--in is this tree"
  tmp=""
  if [ -n "$rev" ]; then
    tmp=$(mktemp -d)
    git archive "$rev" | tar -x -C "$tmp" || die "git archive $rev failed (no .git here? pass --from a copy)"
    src=$tmp
  fi
  src=${src:-$ROOT}
  [ -f "$src/setup.py" ] || die "$src has no setup.py"
  find "$dest" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
  (cd "$src" && tar --exclude=./build --exclude=./.git --exclude=./.venv --exclude='./gpu_out' \
     --exclude='_C*.so' -cf - .) | tar -C "$dest" -xf -
  [ -n "$tmp" ] && rm -rf "$tmp"
  cd "$dest"
elif [ -n "$src$rev" ]; then
  die "--from / --rev need --in DIR"
fi

use_cuda_home
use_system_compilers

# torch's version and whether it is a CUDA build, without importing it (seconds).
read -r torch_version torch_cuda < <("$py" - <<'PY'
import importlib.metadata as md, importlib.util, os
spec = importlib.util.find_spec("torch")
if spec is None:
    print("none no")
else:
    lib = os.path.join(os.path.dirname(spec.origin), "lib")
    print(md.version("torch"), "yes" if os.path.exists(os.path.join(lib, "libtorch_cuda.so")) else "no")
PY
)
[ "$torch_version" = none ] && die "torch is not installed for $py (bash scripts/install.sh sets up .venv)"

toolkit=""
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
  [ -n "$d" ] && [ -x "$d/bin/nvcc" ] && { toolkit=$d; break; }
done
if [ -z "$cuda" ]; then
  if have_gpu && [ "$torch_cuda" = yes ] && [ -n "$toolkit" ]; then cuda=1; else cuda=0; fi
  if have_gpu && [ "$cuda" = 0 ]; then
    say "a GPU is present but torch $torch_version is a CPU build or no CUDA toolkit was found: C++ only"
  fi
fi
if [ "$cuda" = 1 ]; then
  [ "$torch_cuda" = yes ] || die "--cuda: torch $torch_version is a CPU build (install a CUDA build: SPECDEC_TORCH=torch==2.14.1)"
  [ -n "$toolkit" ] || die "--cuda: no CUDA toolkit (set CUDA_HOME)"
  [ -z "$archs" ] && archs=$(gpu_archs)
  archs=${archs:-80;90}
fi

# The stamp: everything the build depends on.
stamp=build/specdec-ext.stamp
so=$(find specdec_kernels -name '_C*.so' 2>/dev/null | head -1)
digest=$(
  {
    find csrc -type f | LC_ALL=C sort | xargs sha256sum
    sha256sum setup.py
    "$py" -c 'import sys; print(sys.version)'
    echo "torch=$torch_version cuda_torch=$torch_cuda build_cuda=$cuda archs=$archs nvcc_flags=$nvcc_flags"
    echo "CC=$CC CXX=$CXX CUDA_HOME=${CUDA_HOME:-} python=$py"
  } | sha256sum | cut -d' ' -f1
)
if [ "$force" = 0 ] && [ -n "$so" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ]; then
  say "specdec_kernels._C is up to date in $(pwd) (same sources, torch $torch_version, CUDA kernel: $([ "$cuda" = 1 ] && echo "sm ${archs}" || echo no))"
  exit 0
fi

if [ "$cuda" = 1 ]; then
  what="compiling the CUDA kernel for sm ${archs//;/, } and the C++ op schemas (torch $torch_version; ~2-4 min per arch on 2 cores, ~2 min on a 16-core GPU machine)"
  skip=0
else
  what="compiling the C++ op schemas, without the CUDA kernel (torch $torch_version; ~20-40 s)"
  skip=1
fi
log=${log:-build/specdec-build.log}
mkdir -p build "$(dirname "$log")"
rm -f "$stamp"
# --force: setuptools would skip the extension when its .so is newer than the listed sources
# (headers are not listed); ninja underneath recompiles only the objects that are out of date.
SPECDEC_SKIP_CUDA=$skip SPECDEC_CUDA_ARCHS=$archs SPECDEC_NVCC_FLAGS=$nvcc_flags \
  run_step "$what" "$log" "$py" setup.py build_ext --inplace --force
echo "$digest" >"$stamp"
