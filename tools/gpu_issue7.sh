#!/usr/bin/env bash
# Issue 7's H200 runs, in parts that each fit one 10-minute device call (a part prints "== rc N"
# per command; each command has its own timeout, so a slow one cannot starve the rest):
#
#   bash tools/gpu_issue7.sh decode  llama-8b $OUT   # engine vs device floor, MBU (~4 min)
#   bash tools/gpu_issue7.sh sweep   llama-8b $OUT jpaged orca-max   # rate sweeps, listed systems
#   bash tools/gpu_issue7.sh serving llama-8b $OUT   # = sweep jpaged orca-max static
#   bash tools/gpu_issue7.sh oracle  llama-8b $OUT   # = sweep orca-oracle orca-pow2
#   bash tools/gpu_issue7.sh memory  llama-8b $OUT [waste,sharing,prefix]  # waste, sharing, prefix
#
# A sweep is `serving.py --quick`: on the GPU models, per-system rate grids around each
# system's capacity, 12 s of Poisson arrivals per rate and a capacity run (every request at
# once), each system in its own process (SWEEP_TIMEOUT seconds, default 250) merged into one
# JSON. MODEL: llama-8b, llama-1b, or tiny (a CPU dry run of the same commands). OUT: where
# the JSON goes (default benchmarks/results); copy it back into benchmarks/results/ afterwards.
set -u
PART=${1:?part: decode, sweep, serving, oracle or memory}
MODEL=${2:-llama-8b}
DEST=${3:-benchmarks/results}
mkdir -p "$DEST"
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jpaged_jax_cache}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.92}
PY=${PYTHON:-python3}

run() {  # run SECONDS script args...
  local limit=$1
  shift
  echo "== $*"
  timeout "$limit" "$PY" "$@" 2>&1 | grep -v -E "^[WI][0-9]{4} "
  echo "== rc ${PIPESTATUS[0]}"
}

sweep() {  # one system per process, merged into one JSON
  for s in "$@"; do
    run "${SWEEP_TIMEOUT:-250}" benchmarks/serving.py --model "$MODEL" --quick --systems "$s" --merge \
      --no-progress --out "$DEST/serving_${MODEL}_sharegpt.json"
  done
}

case "$PART" in
  decode)
    run 330 benchmarks/diagnostics/decode_step.py --model "$MODEL" --batch 64,128,256 \
      --variants default --engine --timeout 320 --out "$DEST/decode_step_${MODEL}.json"
    run 60 tools/summarize_decode_step.py "$DEST/decode_step_${MODEL}.json"
    ;;
  sweep) sweep "${@:4}" ;;
  serving) sweep jpaged orca-max static ;;
  oracle) sweep orca-oracle orca-pow2 ;;
  memory)
    run "${MEMORY_TIMEOUT:-500}" benchmarks/memory.py --model "$MODEL" --quick --no-progress \
      --parts "${4:-waste,sharing,prefix}" --out "$DEST/memory_${MODEL}.json"
    ;;
  *)
    echo "unknown part $PART: decode, sweep, serving, oracle or memory" >&2
    exit 2
    ;;
esac
