#!/usr/bin/env bash
# Quantized-KV work on the GPU (issue 38), in parts that fit one 10-minute device call; each
# command has its own timeout and prints "== rc N":
#
#   bash tools/gpu_quantized.sh bench OUT     # fp8 quick table (token scales, page scales too)
#                                             # beside the bf16 kernel; head dim 256 variants
#                                             # (bf16 with cuDNN, and fp8); fp8 ring depths
#   bash tools/gpu_quantized.sh int8 OUT      # the int8 quick table
#   bash tools/gpu_quantized.sh tests OUT     # -m gpu: tests/kernels/test_quantized_gpu.py
#                                             # (Mosaic GPU) and test_quantized_triton.py
#                                             # (Pallas-Triton, forced on any NVIDIA GPU)
#   bash tools/gpu_quantized.sh capacity OUT  # engine capacity (128 ShareGPT-like requests at
#                                             # once, llama-8b shapes): bf16 then fp8 in the
#                                             # same KV memory (benchmarks/serving.py; more
#                                             # arguments in CAPACITY_ARGS, e.g. a smaller
#                                             # --kv-tokens so that the bf16 pool is the limit)
#
# Benchmarks before tests in one call (tools/gpu_kernels.sh says why). OUT: where JSON goes
# (default benchmarks/results); at most 8 files come back from a device call.
set -u
PART=${1:?part: bench, int8, tests or capacity}
OUT=${2:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jpaged_jax_cache}
PY=${PYTHON:-python3}
. "$(dirname "$0")/gpu_tag.sh"  # TAG: the GPU in result file names
B=benchmarks/decode_attention.py
COMMON="--skip-triton --calls 30 --rounds 3"
H256="32,4096,8,16,256,16"  # B=32, ctx 4k, K=8, C=16, H=256, N=16 (Gemma 2-like)

run() {  # run SECONDS command...
  local limit=$1
  shift
  echo "== $* ($(date +%T))"
  timeout "$limit" "$@" 2>&1 | grep -v -E "^[WI][0-9]{4} "
  echo "== rc ${PIPESTATUS[0]} ($(date +%T))"
}

case "$PART" in
  bench)
    run 130 "$PY" $B --quick --kv-dtype fp8 --also-scales page --skip-cudnn $COMMON \
      --out "$OUT/decode_quantized_${TAG}.json"
    # head dim 256: the default (K Q^T over 8 query columns) beside 64-row tiles and split counts
    run 70 "$PY" $B --cases $H256 --skip-xla $COMMON --variants swap_ab=false num_splits=1 \
      num_splits=2 num_splits=4 num_stages=1 --out "$OUT/decode_h256_${TAG}.json"
    run 45 "$PY" $B --cases $H256 --kv-dtype fp8 --skip-cudnn $COMMON \
      --variants swap_ab=false num_stages=2 --out "$OUT/decode_h256_fp8_${TAG}.json"
    run 45 "$PY" $B --quick --only 3 6 --kv-dtype fp8 --skip-cudnn $COMMON \
      --variants num_stages=2 num_stages=4 --out "$OUT/decode_quantized_stages_${TAG}.json"
    ;;
  int8)
    run 130 "$PY" $B --quick --kv-dtype int8 --skip-cudnn $COMMON \
      --out "$OUT/decode_quantized_int8_${TAG}.json"
    ;;
  tests)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.19 run "${TEST_TIMEOUT:-420}" "$PY" -m pytest -m gpu -q -rf \
      -p no:cacheprovider -p no:benchmark -n 4 --durations=5 tests/kernels/test_quantized_gpu.py \
      tests/kernels/test_quantized_triton.py
    ;;
  capacity)
    for dtype in bf16 fp8; do
      run "${CAPACITY_TIMEOUT:-270}" "$PY" benchmarks/serving.py --model llama-8b --quick \
        --no-progress --rates inf --num-requests 128 --systems jpaged --cache-dtype "$dtype" \
        ${CAPACITY_ARGS:-} --out "$OUT/serving_llama-8b_capacity_${dtype}_${TAG}.json"
    done
    ;;
  *)
    echo "unknown part $PART: bench, int8, tests or capacity" >&2
    exit 2
    ;;
esac
