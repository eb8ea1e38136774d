#!/usr/bin/env bash
# Kernel work on the GPU (issues 3 and 4), in parts that fit one 10-minute device call; each
# command has its own timeout and prints "== rc N", so a hang cannot starve the rest:
#
#   bash tools/gpu_kernels.sh ragged-tests OUT [EXPR]             # ragged kernel GPU tests
#   bash tools/gpu_kernels.sh decode-tests OUT [EXPR]             # decode kernel GPU tests
#     (EXPR is pytest's -k expression, given without -k)
#   bash tools/gpu_kernels.sh prefill OUT [VARIANT...]            # prefill benchmark (+ variants)
#   bash tools/gpu_kernels.sh decode OUT [VARIANT...]             # decode benchmark, --quick
#     (RAGGED_VARIANTS="default paired=0": the same batches through the ragged kernel too;
#      DECODE_ARGS: extra flags, e.g. "--skip-xla --only 0 3")
#   bash tools/gpu_kernels.sh ncu OUT [ARGS...]                   # Nsight Compute, decode
#     (ARGS go to benchmarks/diagnostics/profile_decode_ncu.py, e.g. --only 6 5 --variants block_kv=128;
#      writes OUT/ncu_decode.ncu-rep and OUT/ncu_decode.txt, the details page as text)
#   bash tools/gpu_kernels.sh ncu-prefill OUT [ARGS...]           # Nsight Compute, ragged kernel
#     (ARGS go to benchmarks/diagnostics/profile_prefill_ncu.py, e.g. --length 16384 --variants
#      persistent=false persistent=true,block_kv=128,num_stages=2; also reports each kernel's
#      SM active cycles min / mean / max: how evenly the work spread over the SMs)
#   bash tools/gpu_kernels.sh gaps OUT [ARGS...]                  # launch gaps (JAX profiler)
#     (ARGS go to benchmarks/diagnostics/profile_launch_gaps.py, e.g. --only 0 2; writes OUT/gaps.txt)
#
# In one device call, run the benchmarks before the tests: right after a pytest run the wall
# columns ran 20-70 us over their usual on the H200, CUPTI unchanged.
# OUT: where JSON and logs go (default benchmarks/results). Timeouts: TEST_TIMEOUT (240 s),
# BENCH_TIMEOUT (300 s); prefill variants run at VARIANT_LENGTHS (4096 16384 8192 2048).
set -u
PART=${1:?part: ragged-tests, decode-tests, prefill, decode, ncu, ncu-prefill or gaps}
DEST=${2:-benchmarks/results}
mkdir -p "$DEST"
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jpaged_jax_cache}
PY=${PYTHON:-python3}
. "$(dirname "$0")/gpu_tag.sh"  # TAG: the GPU in result file names

run() {  # run SECONDS LOG command...
  local limit=$1 log=$2
  shift 2
  echo "== $*"
  timeout "$limit" "$@" 2>&1 | grep -v -E "^[WI][0-9]{4} " | tee -a "$log"
  echo "== rc ${PIPESTATUS[0]}"
}

tests() {  # tests FILE [-k EXPR]
  # TEST_WORKERS pytest-xdist processes share the GPU (each gets 1/(workers+1) of its memory):
  # a fresh machine's compiles are CPU-bound, and 4 workers ran 83 decode tests in 101 s where
  # one process timed out at 170 s. pytest-benchmark is disabled: it
  # raises an internal error under xdist. TEST_WORKERS=0 runs in one process.
  local file=$1
  shift
  local k=() n=()
  [ $# -gt 0 ] && k=(-k "$*")
  local workers=${TEST_WORKERS:-4} frac=${XLA_PYTHON_CLIENT_MEM_FRACTION:-}
  if [ "$workers" -gt 0 ]; then
    n=(-n "$workers")
    frac=${frac:-$(python3 -c "print(round(1 / ($workers + 1), 2))")}
  fi
  XLA_PYTHON_CLIENT_MEM_FRACTION=${frac:-0.75} \
    run "${TEST_TIMEOUT:-240}" "$DEST/$(basename "$file" .py).log" \
    "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider -p no:benchmark "${n[@]}" --durations=5 \
    "$file" "${k[@]}"
}

case "$PART" in
  ragged-tests) tests tests/kernels/ragged_paged_attention/test_ragged_gpu.py "${@:3}" ;;
  decode-tests) tests tests/kernels/paged_attention/test_paged_attention_gpu_hardware.py "${@:3}" ;;
  prefill)
    v=()
    [ $# -gt 2 ] && v=(--variants "${@:3}" --variant-lengths ${VARIANT_LENGTHS:-4096 16384 8192 2048})
    run "${BENCH_TIMEOUT:-300}" "$DEST/prefill.log" "$PY" benchmarks/prefill_attention.py \
      "${v[@]}" --out "$DEST/prefill_${TAG}.json"
    ;;
  decode)
    v=()
    [ $# -gt 2 ] && v=(--variants "${@:3}")
    [ -n "${RAGGED_VARIANTS:-}" ] && v+=(--ragged-variants $RAGGED_VARIANTS)
    run "${BENCH_TIMEOUT:-300}" "$DEST/decode.log" "$PY" benchmarks/decode_attention.py --quick \
      ${DECODE_ARGS:-} "${v[@]}" --out "$DEST/decode_quick_${TAG}.json"
    ;;
  ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    : "${NCU:?ncu (Nsight Compute) not found}"
    # Without preallocation ncu saves the memory a replayed kernel may write on the device;
    # with JAX's 75% preallocated it backs it up in host memory, minutes per kernel.
    XLA_PYTHON_CLIENT_PREALLOCATE=false \
      run "${BENCH_TIMEOUT:-300}" "$DEST/ncu.log" "$NCU" --profile-from-start off \
      --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum \
      -f -o "$DEST/ncu_decode" "$PY" benchmarks/diagnostics/profile_decode_ncu.py "${@:3}"
    # A target left behind by a timeout would hold the GPU for the next part.
    pkill -f "$PY benchmarks/diagnostics/profile_decode_ncu.py" && sleep 2
    "$NCU" --import "$DEST/ncu_decode.ncu-rep" --page details >"$DEST/ncu_decode.txt" 2>&1
    echo "== ncu details: $(wc -l <"$DEST/ncu_decode.txt") lines"
    ;;
  ncu-prefill)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    : "${NCU:?ncu (Nsight Compute) not found}"
    XLA_PYTHON_CLIENT_PREALLOCATE=false \
      run "${BENCH_TIMEOUT:-300}" "$DEST/ncu_prefill.log" "$NCU" --profile-from-start off \
      --clock-control none --kernel-name regex:mosaic_gpu --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis \
      --metrics sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,dram__bytes_read.sum,lts__t_sector_hit_rate.pct${NCU_METRICS:+,$NCU_METRICS} \
      -f -o "$DEST/ncu_prefill" "$PY" benchmarks/diagnostics/profile_prefill_ncu.py "${@:3}"
    pkill -f "$PY benchmarks/diagnostics/profile_prefill_ncu.py" && sleep 2
    "$NCU" --import "$DEST/ncu_prefill.ncu-rep" --page details >"$DEST/ncu_prefill.txt" 2>&1
    echo "== ncu details: $(wc -l <"$DEST/ncu_prefill.txt") lines"
    ;;
  gaps)
    run "${BENCH_TIMEOUT:-300}" "$DEST/gaps.txt" "$PY" benchmarks/diagnostics/profile_launch_gaps.py \
      --out "$DEST" "${@:3}"
    ;;
  *)
    echo "unknown part $PART: ragged-tests, decode-tests, prefill, decode, ncu, ncu-prefill or gaps" >&2
    exit 2
    ;;
esac
