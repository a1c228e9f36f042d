#!/usr/bin/env bash
# Fill a folder with the wheels benchmarks/gpu_check.sh needs on the GPU machine, which
# has no network but has PyTorch, Triton, transformers, safetensors, tokenizers, PyYAML,
# numpy, jinja2, msgpack, xxhash, pytest and pytest-xdist (CPython 3.12, x86-64 Linux):
#
#   benchmarks/gpu_wheels.sh [DIR]          DIR defaults to .gpu_wheels (git ignores it)
#
#   structlog     Folio's logging (the kernels fall back to the standard library
#                 without it, the engine's services do not)          pure Python
#   gguf          GGUF reading (the model loaders import it)        pure Python
#
# About 200 KiB in all; `pip download` takes the binary wheels for CPython 3.12 on
# manylinux x86-64 (or pure Python ones), whatever this machine runs. No model travels:
# the check writes random-weight checkpoints on the machine. The folder is git-ignored,
# so it travels only when named in the device tool's `carry` (see the README), and
# benchmarks/wheel_folder.py checks that it and the tree stay under the 64 MiB limit.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-$ROOT/.gpu_wheels}
case "$DIR" in -h|--help) sed -n '2,17p' "$0"; exit 0 ;; esac
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && PY=$ROOT/.venv/bin/python
PACKAGES=(structlog==26.1.0 gguf==0.19.0)
mkdir -p "$DIR"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done
# -c constraints.txt: the torch pin, so no resolver step can ever pull a CUDA build here
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -c "$ROOT/constraints.txt" -d "$DIR" "${PACKAGES[@]}"
ls -l "$DIR"
