#!/usr/bin/env bash
# Issue 36 on the GPU (engine start-up, decode MBU, serving fairness), in parts that fit one
# device call; each command has its own timeout and prints "== rc N":
#
#   bash tools/gpu_issue36.sh startup OUT [MODEL]   # cold + warm start, MBU at 64/128/256
#   bash tools/gpu_issue36.sh serving OUT [MODEL]   # capacity and low-load TTFT: jpaged,
#     reserve-max (jpaged's engine, Orca-Max's admission), orca-max (the TTFT anchor) and
#     SERVING_SYSTEMS (more, e.g. static)
#
# OUT: where JSON and logs go (default benchmarks/results). MODEL: llama-8b (default).
# Timeouts: STARTUP_TIMEOUT (300 s per phase), SERVING_TIMEOUT (300 s).
set -u
PART=${1:?part: startup or serving}
DEST=${2:-benchmarks/results}
MODEL=${3:-llama-8b}
mkdir -p "$DEST"
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
. "$(dirname "$0")/gpu_tag.sh"  # TAG: the GPU in result file names

run() {  # run SECONDS LOG command...
  local limit=$1 log=$2
  shift 2
  echo "== $*"
  timeout "$limit" "$@" 2>&1 | grep -v -E "^[WI][0-9]{4} " | tee -a "$log"
  echo "== rc ${PIPESTATUS[0]}"
}

case "$PART" in
  startup)
    # Two phases of STARTUP_TIMEOUT each at most, in child processes.
    run $((2 * ${STARTUP_TIMEOUT:-300} + 60)) "$DEST/startup.log" "$PY" benchmarks/startup.py \
      --model "$MODEL" --mbu "${MBU_BATCHES:-64,128,256}" --timeout "${STARTUP_TIMEOUT:-300}" \
      --out "$DEST/startup_${MODEL}_${TAG}.json"
    ;;
  serving)
    # Capacity (128 requests at once) and low load (4 req/s, 10 s of arrivals), the paper's
    # pool; results are saved after each run.
    run "${SERVING_TIMEOUT:-300}" "$DEST/serving.log" "$PY" benchmarks/serving.py \
      --model "$MODEL" --quick --no-progress --rates "${SERVING_RATES:-inf,4}" --window 10 \
      --num-requests 128 --systems "jpaged,reserve-max,orca-max${SERVING_SYSTEMS:+,$SERVING_SYSTEMS}" \
      --out "$DEST/serving_${MODEL}_sharegpt_${TAG}.json"
    ;;
  *)
    echo "unknown part $PART: startup or serving" >&2
    exit 2
    ;;
esac
