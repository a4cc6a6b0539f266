#!/usr/bin/env bash
# Set up (scripts/install.sh; a second run skips what is done) and run the main job:
# speculative generation on SmolLM2-135M-Instruct (docs/MAIN_JOB.md). Arguments go to
# python -m specdec_kernels.generate (--sample, --tree, --help, ...). The synthetic theory demo:
# python -m specdec_kernels.demo.
set -euo pipefail
cd "$(dirname "$0")/.."
for a in "$@"; do
  case $a in -h|--help) . "${SPECDEC_VENV:-.venv}/bin/activate" 2>/dev/null || true
                        exec python -m specdec_kernels.generate --help ;; esac
done
bash scripts/install.sh
. "${SPECDEC_VENV:-.venv}/bin/activate"
echo "==> the main job: loading the model (imports and dequantizing the 93 MB GGUF file to float32: ~20-30 s)," \
     "then each of the 4 built-in prompts decoded by target.generate and by each drafter (progress bars;" \
     "~30-40 s a prompt on a 2-core CPU), then the summary tables" >&2
PYTHONUNBUFFERED=1 python -m specdec_kernels.generate "$@"
